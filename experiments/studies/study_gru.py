"""Row-by-row MNIST with a GRU parallel in time: the main job's ``--model gru`` on 2 time ranks
(MGRIT in time, inexact training) against the serial job (PyTorch's fused ``nn.GRU``), same
seed, data, batches and epochs.

Launch (runs the main job as subprocesses; rank counts are its own)::

    python experiments/studies/study_gru.py                  # seed 0, 10 epochs, + the contrast run
    python experiments/studies/study_gru.py --seeds 0 1 2
    python experiments/studies/study_gru.py --smoke --out /tmp/x

Network: 28 rows of 28 pixels -> GRU (``--hidden`` 32) -> linear head; Adam (lr 3e-3), batch 50,
``mnist5k`` (4,000 train / 1,000 test). MGRIT settings of the layer-parallel runs
(:data:`SETTINGS`): 2 levels, coarsening factor 4 (28 -> 7 time steps), FCF relaxation on
every level, 3 forward / 2 adjoint cycles per training step, warm start; evaluation forwards
iterate to the relative residual ``--gru-eval-rtol`` 1e-5. Contrasts: the usual 2 forward /
1 adjoint cycles (every seed) and the main job's ResNet defaults (3 levels, F-relaxation on the
fine level; first seed). ``--sweep`` compares settings on one time rank (``sweep.md``): why
3/2 cycles.

Writes ``experiments/results/studies/gru/`` (or ``--out``/gru): ``table.md`` (final test accuracy of
both, the difference, mean wall time per epoch under the machine's load, the GRU solver's
mean final forward residual), ``summary.md`` (generated from the table), ``accuracy.png``, and
the run directories ``runs/<name>/`` (config.json, metrics.h5, summary.json, curves.png).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "studies"  # default results base folder

from mgrit.training import report  # noqa: E402

STUDY = "gru"
#: The layer-parallel runs' MGRIT flags (the recommended GRU settings, chosen by ``--sweep``).
SETTINGS = ["--levels", "2", "--cfactor", "4", "--relax", "FCF", "--fwd-iters", "3",
            "--bwd-iters", "2"]
#: Contrast on every seed: the usual inexact training cycles (2 forward / 1 adjoint).
CYCLES_2_1 = ["--levels", "2", "--cfactor", "4", "--relax", "FCF", "--fwd-iters", "2",
              "--bwd-iters", "1"]
#: The contrast: the main job's defaults (made for ResNets).
DEFAULTS = ["--levels", "3", "--cfactor", "4", "--relax", "F,FCF", "--fwd-iters", "2",
            "--bwd-iters", "1"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    report.add_study_flags(p, "3 seeds", "tiny settings (seconds)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ranks", type=int, default=2, help="time ranks of the MGRIT runs")
    p.add_argument("--no-contrast", action="store_true", help="skip the default-flags run")
    p.add_argument("--sweep", action="store_true", help="instead: MGRIT settings on one time "
                   "rank (the same iterates as on several ranks, up to round-off), the first "
                   "seed, against its serial run; writes sweep.md")
    a = p.parse_args(argv)
    a.common = ["--dataset", "mnist5k", "--model", "gru", "--hidden", str(a.hidden),
                "--optimizer", "adam", "--lr", "0.003", "--batch-size", "50", "--no-progress"]
    if a.full:
        a.seeds = [0, 1, 2]
    if a.smoke:
        a.seeds, a.epochs, a.hidden = [0], 1, 4
        a.common = ["--dataset", "digits", "--model", "gru", "--hidden", "4", "--optimizer",
                    "adam", "--lr", "0.003", "--batch-size", "50", "--limit-train", "100",
                    "--limit-test", "50", "--no-progress"]
    return a


def run_job(name: str, ranks: int, flags: list, out: Path) -> dict:
    """One main-job run into ``out/runs/name``; returns its summary.json."""
    run = out / "runs" / name
    py = [sys.executable, "-m", "mpi4py", str(ROOT / "experiments" / "train.py")]
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = ((py if ranks == 1 else [mpiexec, "-n", str(ranks)] + py) + flags
           + ["--out", str(run), "--overwrite"])  # a rerun replaces the run
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    launch = "python -m mpi4py" if ranks == 1 else f"mpiexec -n {ranks} python -m mpi4py"
    summary["_command"] = " ".join([launch, "experiments/train.py", *flags])
    return summary


def _row(label, seed, ranks, s, ref=None):
    fin, hist = s["final"], s["epochs"]
    solver = s.get("gru_solver") or []
    fres = [r["fwd_residual_mean"] for r in solver if r["fwd_residual_mean"] is not None]
    acc = fin["test_acc"]
    return [seed, label, ranks, f"{acc:.4f}",
            "-" if ref is None else f"{100 * (acc - ref):+.1f}",
            f"{s['times']['mean_epoch_s']:.1f}",
            f"{fres[0]:.1e} / {fres[-1]:.1e}" if fres else "-", len(hist["epoch"])]


#: Settings tried by ``--sweep`` (label, flags).
SWEEP = [
    ("FCF, 2 levels, m=4, 2/1 cycles", CYCLES_2_1),
    ("FCF, 2 levels, m=4, 2/1 cycles, no warm start", CYCLES_2_1 + ["--no-warm-start"]),
    ("FCF, 2 levels, m=4, 3/2 cycles", SETTINGS),
    ("FCF, 2 levels, m=2, 2/1 cycles", ["--levels", "2", "--cfactor", "2", "--relax", "FCF",
                                        "--fwd-iters", "2", "--bwd-iters", "1"]),
    ("FCFCF, 2 levels, m=4, 2/1 cycles", ["--levels", "2", "--cfactor", "4", "--relax",
                                          "FCFCF", "--fwd-iters", "2", "--bwd-iters", "1"]),
]


def sweep(a, out: Path, argv) -> None:
    seed = a.seeds[0]
    flags = a.common + ["--epochs", str(a.epochs), "--seed", str(seed)]
    ser = run_job(f"serial-seed{seed}", 1, flags + ["--serial"], out)
    ref = ser["final"]["test_acc"]
    rows = [_row("serial nn.GRU", seed, 1, ser) + [f"{ser['final']['loss']:.4f}"]]
    commands = [ser["_command"]]
    for i, (label, extra) in enumerate(SWEEP):
        s = run_job(f"sweep{i}-seed{seed}", 1, flags + ["--method", "mgrit"] + extra, out)
        rows.append(_row(label, seed, 1, s, ref) + [f"{s['final']['loss']:.4f}"])
        commands.append(s["_command"])
    meta = report.run_metadata(["experiments/studies/study_gru.py", *(argv or sys.argv[1:])])
    header = ["seed", "MGRIT settings (inexact, 1 time rank)", "ranks", "final test acc",
              "vs serial [points]", "mean epoch wall [s] (load: header)",
              "mean final fwd residual (first / last epoch)", "epochs", "final train loss"]
    body = [report.markdown_table(header, rows), "", "Job commands:", ""]
    body += [f"- `{c}`" for c in commands]
    report.write_table(out / "sweep.md", "GRU row-by-row MNIST: MGRIT settings", meta,
                       "\n".join(body))


def main(argv=None):
    a = parse(argv)
    out = report.results_dir(STUDY, a.out or OUT)
    if a.sweep:
        return sweep(a, out, argv)
    epochs = ["--epochs", str(a.epochs)]
    rows, curves, commands = [], {}, []
    for seed in a.seeds:
        flags = a.common + epochs + ["--seed", str(seed)]
        ser = run_job(f"serial-seed{seed}", 1, flags + ["--serial"], out)
        par = run_job(f"mgrit{a.ranks}-seed{seed}", a.ranks, flags + SETTINGS, out)
        ref = ser["final"]["test_acc"]
        rows.append(_row("serial nn.GRU", seed, 1, ser))
        rows.append(_row("MGRIT in time, FCF 2 levels m=4, 3/2 cycles", seed, a.ranks, par, ref))
        c21 = run_job(f"mgrit{a.ranks}-2-1-seed{seed}", a.ranks, flags + CYCLES_2_1, out)
        rows.append(_row("MGRIT, FCF 2 levels m=4, 2/1 cycles", seed, a.ranks, c21, ref))
        commands += [ser["_command"], par["_command"], c21["_command"]]
        for lab, s in (("serial", ser), (f"MGRIT {a.ranks} ranks", par)):
            curves[f"seed {seed} {lab}"] = (s["epochs"]["epoch"], s["epochs"]["test_acc"])
        if seed == a.seeds[0] and not a.no_contrast:
            con = run_job(f"mgrit{a.ranks}-defaults-seed{seed}", a.ranks, flags + DEFAULTS, out)
            rows.append(_row("MGRIT, job defaults: F,FCF 3 levels m=4, 2/1", seed, a.ranks,
                             con, ref))
            commands.append(con["_command"])
            curves[f"seed {seed} MGRIT job defaults"] = (con["epochs"]["epoch"],
                                                         con["epochs"]["test_acc"])
    meta = report.run_metadata(["experiments/studies/study_gru.py", *(argv or sys.argv[1:])])
    report.plot_lines(out / "accuracy.png", curves, "epoch", "test accuracy",
                      title="row-by-row MNIST subset, GRU: MGRIT in time vs serial")
    header = ["seed", "method", "ranks", "final test acc", "vs serial [points]",
              "mean epoch wall [s] (load: header)", "mean final fwd residual (first / last epoch)",
              "epochs"]
    body = [report.markdown_table(header, rows), "", "Job commands (each with `--out "
            "experiments/results/studies/gru/runs/<name>`):", ""]
    body += [f"- `{c}`" for c in commands]
    report.write_table(out / "table.md", "GRU parallel in time: row-by-row MNIST subset", meta,
                       "\n".join(body))
    write_summary(out, rows, meta)


def write_summary(out: Path, rows: list, meta: dict) -> None:
    """``summary.md`` from the table rows (so the numbers in the text are the table's)."""
    par = [r for r in rows if r[1].startswith("MGRIT in time")]
    c21 = [r for r in rows if "2/1 cycles" in r[1] and "defaults" not in r[1]]
    con = [r for r in rows if "defaults" in r[1]]
    worst = max(abs(float(r[4])) for r in par)
    lines = [f"# Summary: GRU parallel in time on row-by-row MNIST ({meta['date']}, commit "
             f"{meta['commit']})", "",
             f"- Largest difference in final test accuracy, MGRIT on {par[0][2]} time ranks vs "
             f"serial nn.GRU (same seed and epochs) over {len(par)} seed(s): {worst:.1f} points "
             f"({'within' if worst <= 1.0 else 'NOT within'} the 1-point target); per seed: "
             f"{', '.join(r[4] for r in par)}.",
             "- Settings: 2 levels, coarsening factor 4 (28 -> 7 steps), FCF on every level, "
             "3 forward / 2 adjoint cycles per training step, warm start; evaluation forwards "
             "to relative residual 1e-5 (sweep.md compares settings)."]
    if c21:
        lines.append(f"- With 2 forward / 1 adjoint cycles (otherwise the same): "
                     f"{', '.join(r[4] for r in c21)} points per seed; mean final forward "
                     f"residual per step in the last epoch "
                     f"{', '.join(r[6].split(' / ')[1] for r in c21)} vs "
                     f"{', '.join(r[6].split(' / ')[1] for r in par)} with 3/2 cycles.")
    if con:
        lines.append(f"- With the job's ResNet defaults (3 levels, F-relaxation on the fine "
                     f"level, 2/1 cycles), seed {con[0][0]}: {con[0][4]} points; last-epoch "
                     f"mean final forward residual {con[0][6].split(' / ')[1]}.")
    lines.append("- Times per epoch are wall times on a shared, loaded machine (not a timing "
                 "result); see the table.")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
