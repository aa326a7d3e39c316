"""Study: spatial coarsening in space-time MGRIT (issue 35 item 3) -- where coarsening the
feature maps on the coarse levels pays and where it slows convergence enough to lose.

Launch (plain python: the script starts its 2-rank measurement and the main job's runs itself,
with the venv's mpiexec)::

    python experiments/studies/study_spatial.py --full              # the record
    python experiments/studies/study_spatial.py --quick --out /tmp/x  # smoke (the test suite)
    python experiments/studies/study_spatial.py --full --part report  # tables from stored parts

Configurations (:data:`experiments.studies.spatial_parts.CONFIGS`): the main job's conv ResNet
(``--step conv``, 4 channels, tanh, T = 1) on ``mnist5k`` (28 x 28, cell-centred: 28 -> 14 ->
7) and on the generated ``voxels`` set (15^3, vertex-centred: 15 -> 7 -> 3; ``data.voxels``).
Arms: time-only MGRIT and space-time MGRIT (level 1 coarsened in space, and at 3 levels also
levels 1 and 2; factor 2 per dimension, full weighting, linear prolongation -- the job's
``--spatial-coarsening`` defaults). Every MGRIT arm relaxes with FCF on every level (a
spatially coarsened level needs C-relaxation on the level above: with F-relaxation the part of
the C-point error the coarse grid cannot represent is never corrected and the solve
stagnates; the job refuses it).

Parts (``--part``; ``all`` runs them in order):

* ``measure`` (``mpiexec -n 2``, :mod:`experiments.studies.spatial_parts`): convergence
  factors per cycle of exact forward and adjoint solves (float64, tol 1e-10, cold start, the
  networks' initial weights, a batch of training samples) for m = 2, 4, 8 and L = 2, 3; the
  gradient error of the inexact training step (2 forward / 1 adjoint cycles) against
  serial autograd; the CPU time (``time.process_time`` per rank, the largest over the ranks;
  median of interleaved repeats) of a training step and of one forward cycle on 1 process
  and on 2 ranks, against the serial step (eager autograd; ``--full`` also torch.compile).
  The load averages before and after are in the metadata of ``table.md``.
* ``record``: the main job (``experiments/train.py``) serial on 1 rank, time-only MGRIT and
  space-time MGRIT on 2 ranks, same seeds (:data:`SEEDS`), flags and epochs
  (:data:`RECORD`); per epoch the paired interval of the test-accuracy gap of each MGRIT arm
  to serial (``experiments/reports/seeds.py``), as the other records.
* ``report``: ``table.md`` (every number), ``summary.md`` (verdicts), ``convergence.png``,
  ``headline.json`` -- in ``experiments/results/studies/spatial_coarsening/``.

Where it pays (computed, never typed): for each configuration and L, the time to reduce the
forward residual 10^6-fold, (cycles at the measured factor) x (measured CPU time of a cycle on
2 ranks), space-time over time-only: < 1 pays.

Needs the solver's spatial coarsening (:mod:`mgrit.spatial`); without it the study prints
``SKIP`` and exits with ``EXIT_SKIP`` (``regenerate.py`` lists it as ``skip``).

Cost: ``--quick`` 98 CPU seconds (5 min wall at a load average of 18 on 2 cores, commit
36d3801). ``--full``: about 35-45 min on 2 idle cores, an estimate from the CPU time of its
pieces (an exact float64 voxel solve at N = 32, batch 16: 45-75 CPU s; the measurement of
the voxel set dominates, ~15-25 min; the record's 18 jobs ~12 min), not a measured record.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "studies"  # default results base

from mgrit.reporting.writers import (add_study_flags, plot_lines, results_dir,  # noqa: E402
                                     run_metadata, skip, spread, write_table)

STUDY = "spatial_coarsening"
SEEDS = (0, 1, 2)
#: configuration -> (flags of every arm, flags of both MGRIT arms, the space-time arm's own)
RECORD = {
    "mnist5k-conv": (["--dataset", "mnist5k", "--step", "conv", "--channels", "4", "--layers",
                      "16", "--optimizer", "adam", "--lr", "1e-3", "--batch-size", "50",
                      "--epochs", "3"], ["--levels", "2", "--cfactor", "4", "--relax", "FCF"],
                     ["--spatial-coarsening", "1"]),
    "voxels-conv": (["--dataset", "voxels", "--step", "conv", "--channels", "4", "--layers",
                     "8", "--optimizer", "adam", "--lr", "1e-3", "--batch-size", "50",
                     "--epochs", "3"], ["--levels", "2", "--cfactor", "4", "--relax", "FCF"],
                    ["--spatial-coarsening", "1"]),
}
ARMS = ("serial", "time-only", "space-time")
SMOKE_JOB = ["--limit-train", "40", "--limit-test", "20", "--epochs", "1", "--layers", "8",
             "--batch-size", "20"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_flags(p, "the record: every configuration, m, L, arm and seed",
                    "tiny settings for the test suite (also --quick)")
    p.add_argument("--quick", dest="smoke", action="store_true", help="the same as --smoke")
    p.add_argument("--part", choices=("all", "measure", "record", "report"), default="all")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the MPI part
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    a = p.parse_args(argv)
    a.seeds = a.seeds or ((0,) if a.smoke else SEEDS)
    if a.smoke:
        a.layers, a.ms, a.Ls, a.batch, a.tbatch, a.iters, a.repeats = 8, (2,), (2,), 4, 4, 6, 1
    else:
        a.layers, a.ms, a.Ls, a.batch, a.tbatch, a.iters, a.repeats = 32, (2, 4, 8), (2, 3), \
            8, 16, 20, 7
    return a


def worker(a, base: Path) -> None:
    """The ``measure`` part on the ranks of COMM_WORLD: ``measurements.json`` (rank 0)."""
    import torch
    from mpi4py import MPI

    from experiments.studies import spatial_parts as sp
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    out = {"meta": run_metadata(world_size=world.Get_size()), "convergence": [],
           "gradient": [], "timing": {}, "notes": {}}
    m_mid = a.ms[len(a.ms) // 2]
    for name in sp.CONFIGS:
        torch.set_default_dtype(torch.float64)  # exact solves and gradient errors in float64
        x, y = sp.batch(name, a.batch, torch.float64)
        k = 10 if name.startswith("mnist") else 4
        out["convergence"] += sp.convergence(name, a.layers, a.ms, a.Ls, x, y, k, world, a.iters)
        out["gradient"] += sp.gradient_errors(name, a.layers, m_mid, a.Ls, x, y, k, world, 2, 1)
        torch.set_default_dtype(torch.float32)  # timings in the job's dtype
        x, y = sp.batch(name, a.tbatch, torch.float32)
        series, note = sp.timings(name, a.layers, m_mid, a.Ls, x, y, k, world, 2, 1, a.repeats,
                                  compile_serial=not a.smoke)
        out["timing"][name], out["notes"][name] = series, note
    if world.Get_rank() == 0:
        (base / "measurements.json").write_text(json.dumps(out, indent=1))


def measure(a, base: Path) -> None:
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", sys.executable, "-m",
           "mpi4py", str(Path(__file__).resolve()), "--worker", "--out", str(base.parent)]
    cmd += ["--smoke"] if a.smoke else []
    print("+", shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=6 * 3600,
                   env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def record(a, base: Path) -> None:
    from experiments.records import records
    for name, (common, mg, space) in RECORD.items():
        for seed in a.seeds:
            for arm in ARMS:
                out = base / "runs" / f"{name}-s{seed}-{arm}"
                flags = [*common, "--seed", str(seed)]
                cmd = records.command(flags, mg + (space if arm == "space-time" else []),
                                      "serial" if arm == "serial" else "mgrit", out,
                                      a.smoke, SMOKE_JOB)
                records.run_job(cmd, out)


def cycles_to(row: dict, reduction: float = 1e-6) -> float:
    """Cycles the measured forward solve of ``row`` took to reduce its residual by
    ``reduction`` (the first cycle at or below it), or, when it stopped before, its cycles plus
    the extrapolation at its factor (``inf`` at a factor >= 1)."""
    res = [float(v) for v in row.get("fwd_res") or ()]
    if res and res[0] > 0:
        hit = next((k for k, r in enumerate(res) if r <= reduction * res[0]), None)
        if hit is not None:
            return float(max(hit, 1))
    f = row["fwd_factor"]
    if not 0 <= f < 1:
        return math.inf
    done, left = (len(res) - 1, res[-1] / (reduction * res[0])) if res and res[0] > 0 \
        else (0, 1 / reduction)
    return max(done + math.log(left) / -math.log(max(f, 1e-300)), 1.0)


def where_it_pays(meas: dict) -> list:
    """Rows ``(config, L, arm, factor, cycles to 1e-6, cycle ms, ratio)``: the time to reduce
    the forward residual 10^6-fold (:func:`cycles_to` x the CPU time of a cycle) of each
    space-time arm over time-only's, at the m of the timings, on 2 ranks (> 1: spatial
    coarsening loses)."""
    rows = []
    for name, series in meas["timing"].items():
        for row in meas["convergence"]:
            if row["config"] != name or f"m = {row['m']}," not in " ".join(series):
                continue
            key = f"cycle: m = {row['m']}, L = {row['L']}, {row['arm']}, P = 2"
            if key not in series:
                continue
            rows.append({"config": name, "L": row["L"], "arm": row["arm"],
                         "factor": row["fwd_factor"], "cycles": cycles_to(row),
                         "cycle_s": spread(series[key])["median"]})
    for r in rows:
        t = next(q for q in rows if q["config"] == r["config"] and q["L"] == r["L"]
                 and q["arm"] == "time-only")
        r["ratio"] = (r["cycles"] * r["cycle_s"]) / (t["cycles"] * t["cycle_s"])
    return rows


def report(a, base: Path) -> None:
    """table.md, summary.md, convergence.png, headline.json from the stored parts."""
    from experiments.benchmarks.baselines_common import cell, timing_table
    from experiments.records import records
    from experiments.reports import seeds as rseeds
    meas = json.loads((base / "measurements.json").read_text())
    meta = meas["meta"]
    L = ["Generated by `experiments/studies/study_spatial.py` (the measurement's metadata "
         "above; the record's runs carry their own). Factor = geometric mean of r_(k+1)/r_k "
         "of an exact solve (tol 1e-10, cold start, float64).", "",
         "## Convergence factors per cycle", "",
         "| configuration | m | L | arm | forward factor (cycles) | adjoint factor (cycles) |",
         "|---|---|---|---|---|---|"]
    for r in meas["convergence"]:
        L.append(f"| {r['config']} | {r['m']} | {r['L']} | {r['arm']} | {r['fwd_factor']:.3g} "
                 f"({r['fwd_cycles']}) | {r['adj_factor']:.3g} ({r['adj_cycles']}) |")
    L += ["", "## Gradient error of the inexact training step (2 forward / 1 adjoint cycles, "
          "cold start) against serial autograd", "",
          "| configuration | m | L | arm | relative gradient error |", "|---|---|---|---|---|"]
    L += [f"| {r['config']} | {r['m']} | {r['L']} | {r['arm']} | {r['grad_error']:.3e} |"
          for r in meas["gradient"]]
    for name, series in meas["timing"].items():
        errors = {f"step: m = {r['m']}, L = {r['L']}, {r['arm']}, P = {P}":
                  f"{r['grad_error']:.2e}" for r in meas["gradient"] if r["config"] == name
                  for P in (1, 2)}
        steps = {k: v for k, v in series.items() if not k.startswith("cycle: ")}
        lines, best, _ = timing_table(steps, [k for k in steps if k.startswith("serial")],
                                      errors=errors, unit="ms CPU", default_err="-")
        L += ["", f"## CPU time per training step: {name} (per rank, the largest over the "
              f"ranks; serial: {meas['notes'][name]})", "", *lines, "",
              f"## CPU time of one forward cycle: {name} (no_grad, solve set-up included)", "",
              "| option | time [ms CPU]: median [IQR] | vs time-only (same L, P) |", "|---|---|---|"]
        for k, v in series.items():
            if k.startswith("cycle: "):
                ref = series[k.replace(k.split(", ")[2], "time-only")]
                ratio = spread(v)["median"] / spread(ref)["median"]
                L.append(f"| {k[7:]} | {cell(v, 1e3)} | {ratio:.2f}x |")
    pays = where_it_pays(meas)
    L += ["", "## Where spatial coarsening pays (forward residual 10^6-fold, 2 ranks)", "",
          "| configuration | L | arm | factor | cycles | cycle [ms CPU] | time vs time-only |",
          "|---|---|---|---|---|---|---|"]
    L += [f"| {r['config']} | {r['L']} | {r['arm']} | {r['factor']:.3g} | {r['cycles']:.1f} | "
          f"{r['cycle_s'] * 1e3:.3g} | {r['ratio']:.2f}x |" for r in pays]
    head = []
    for name in RECORD:
        pairs = {}
        for seed in a.seeds:
            s = {arm: records.load(base / "runs" / f"{name}-s{seed}-{arm}") for arm in ARMS}
            if all(v is not None for v in s.values()):
                pairs[seed] = s
        if not pairs:
            continue
        L += ["", f"## Training record: {name} ({len(pairs)} seeds: {sorted(pairs)}; flags "
              f"`{' '.join(RECORD[name][0])}`, MGRIT `{' '.join(RECORD[name][1])}`, space-time "
              f"also `{' '.join(RECORD[name][2])}`)", ""]
        for arm in ARMS[1:]:
            rows = rseeds.per_epoch({k: (v["serial"], v[arm]) for k, v in pairs.items()},
                                    "test_acc")
            verdict = rseeds.record_verdict(rows[-1]["gap"], 1.0, "points")
            L += [f"### {arm} MGRIT (2 ranks) vs serial", "",
                  *rseeds.gap_table(rows, "test_acc", "test accuracy"), "",
                  f"Verdict (last epoch, test): {verdict}.", ""]
            head.append({"claim": f"{name}: {arm} MGRIT (2 ranks, inexact) vs serial, test "
                                  "accuracy", "ours": verdict, "kind": "measured"})
    write_table(base / "table.md", "Spatial coarsening in space-time MGRIT: convergence, "
                "gradient error, cost, training", meta, "\n".join(L))
    win = [f"{r['config']} L={r['L']} {r['arm']} ({r['ratio']:.2f}x)" for r in pays
           if r["arm"] != "time-only" and r["ratio"] < 1]
    lose = [f"{r['config']} L={r['L']} {r['arm']} ({r['ratio']:.2f}x)" for r in pays
            if r["arm"] != "time-only" and r["ratio"] >= 1]
    say = (f"Space-time vs time-only MGRIT, time to a 10^6-fold forward residual reduction on "
           f"2 ranks: pays at {', '.join(win) or 'no configuration'}; loses at "
           f"{', '.join(lose) or 'no configuration'}.")
    (base / "summary.md").write_text("\n".join(
        ["# Spatial coarsening: summary (generated; every number in table.md)", "", say, ""]
        + [f"- {h['claim']}: {h['ours']}" for h in head]) + "\n")
    head.insert(0, {"claim": "space-time vs time-only MGRIT, time to a 10^6-fold forward "
                             "residual reduction (2 ranks)", "ours": say, "kind": "measured"})
    (base / "headline.json").write_text(json.dumps({"commits": [meta["commit"]],
                                                    "rows": head}, indent=1))
    curves = {f"{r['config']} m={r['m']} L={r['L']} {r['arm']}":
              (list(range(len(r["fwd_res"]))), [max(v, 1e-16) for v in r["fwd_res"]])
              for r in meas["convergence"] if r["m"] == meas["gradient"][0]["m"]}
    plot_lines(base / "convergence.png", curves, "cycle", "forward residual",
               "exact forward solves, cold start", logy=True)
    print((base / "summary.md").read_text())


def main(argv=None) -> int:
    a = parse(argv)
    base = results_dir(STUDY, a.out or OUT)
    if importlib.util.find_spec("mgrit.spatial") is None:
        return skip("the solver has no spatial coarsening yet (mgrit.spatial, issue 35 items "
                    "1-2): rerun after it is merged")
    if a.worker:
        worker(a, base)
        return 0
    if a.part in ("all", "measure"):
        measure(a, base)
    if a.part in ("all", "record"):
        record(a, base)
    if a.part in ("all", "report"):
        report(a, base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
