"""Recorded runs of issue 23: networks with state or noise in their layers, trained serially
(1 rank) and layer-parallel (2 ranks, inexact MGRIT), several seeds, the same budget.

Studies (``--study``):

* ``batchnorm_dropout``: the CIFAR-style ResNet with BatchNorm (``--model cifar-resnet``) and the
  ViT with dropout and DropPath (``--model vit --dropout 0.1 --drop-path 0.1``) on the MNIST
  subset, ``--serial`` vs ``--method mgrit``, seeds 0, 1, 2: mean +- spread (sample standard
  deviation) of the final test accuracy per model and method, and of the MGRIT run's final
  weights evaluated with the exact serial forward (its running statistics are those of the
  approximate final states of the inexact solves: the difference between the two MGRIT columns
  is what the inexact forward costs at evaluation, the difference to serial what it cost in
  training).
* ``tied_resnet``: the weight-tied ResNet (``--tied``, one step module for all layers) vs its
  untied twin, serial and layer-parallel, seeds 0, 1, 2. Needs the main job's ``--tied`` flag;
  without it the study prints why and exits with ``EXIT_SKIP`` (``experiments/regenerate.py``
  lists it as ``skip``).

Usage (plain python: the script launches the 2-rank jobs itself with the venv's mpiexec)::

    python experiments/records/stateful_records.py --study batchnorm_dropout --full
    python experiments/records/stateful_records.py --study tied_resnet --full
    python experiments/records/stateful_records.py --study batchnorm_dropout --report-only
    python experiments/records/stateful_records.py --study batchnorm_dropout --smoke --out /tmp/x

Run directories: ``experiments/results/<study>/runs/<model>-s<seed>-<method>/``; ``table.md``
(every run), ``summary.md`` (mean +- spread), ``headline.json`` for
``experiments/regenerate.py``. Accuracy is valid on a busy machine; times are wall times under
whatever load there was (kind: mixed). ``--smoke``: one seed, tiny runs (seconds to minutes).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "records"  # default results base folder

from experiments.records import records  # noqa: E402
from mgrit.training.report import (add_study_flags, results_dir, run_metadata, skip,  # noqa: E402
                                   write_table)

SEEDS = (0, 1, 2)
_ADAM = ["--optimizer", "adam", "--lr", "1e-3", "--batch-size", "50"]
#: study -> model -> (flags of both methods, flags of the MGRIT run)
STUDIES = {
    "batchnorm_dropout": {
        "cifar-resnet": (["--model", "cifar-resnet", "--dataset", "mnist5k", "--channels", "4",
                          "--layers", "4", *_ADAM, "--epochs", "4"],
                         ["--levels", "2", "--cfactor", "2"]),
        "vit-dropout": (["--model", "vit", "--dataset", "mnist5k", "--d-model", "32", "--heads",
                         "4", "--layers", "8", "--patch", "7", "--T", "1", "--dropout", "0.1",
                         "--drop-path", "0.1", *_ADAM, "--epochs", "6"],
                        ["--levels", "2", "--cfactor", "2", "--nested-iteration",
                         "--fwd-iters", "3", "--bwd-iters", "2"]),
    },
    "tied_resnet": {
        "resnet-tied": (["--model", "resnet", "--tied", "--dataset", "mnist5k", "--layers", "16",
                         "--width", "32", *_ADAM, "--epochs", "4"],
                        ["--levels", "2", "--cfactor", "4"]),
        "resnet-untied": (["--model", "resnet", "--dataset", "mnist5k", "--layers", "16",
                           "--width", "32", *_ADAM, "--epochs", "4"],
                          ["--levels", "2", "--cfactor", "4"]),
    },
}
METHODS = ("serial", "mgrit")


def has_flag(flag: str) -> bool:
    """Whether the main job knows ``flag`` (its ``--help`` lists it)."""
    out = subprocess.run([sys.executable, "experiments/train.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    return flag in out.stdout


def run(study: str, model: str, method: str, seed: int, base: Path, smoke: bool,
        extra: list = ()) -> None:
    common, mg = STUDIES[study][model]
    out = base / "runs" / f"{model}-s{seed}-{method}"
    flags = [*common, "--seed", str(seed), *extra]
    records.run_job(records.command(flags, mg, method, out, smoke), out)


def _mean_spread(values: list) -> str:
    if not values:
        return "-"
    m = statistics.fmean(values) * 100
    if len(values) == 1:
        return f"{m:.2f}% (one seed)"
    return f"{m:.2f} +- {statistics.stdev(values) * 100:.2f}% (n={len(values)})"


def report(study: str, base: Path, seeds) -> None:
    runs = {f"{model}-s{seed}": list(METHODS) for model in STUDIES[study] for seed in seeds}
    rows = records.rows(base, runs, study)
    meta = run_metadata()
    cols = ["model", "method", "ranks", "epochs", "parameters", "train loss", "test accuracy",
            "final weights, exact forward", "time / epoch (s)", "last fwd residual (epoch mean)",
            "commit"]
    lines = [f"Generated by `python experiments/records/stateful_records.py --study {study}` "
             f"(the metadata above: the report's; each run's commit is in its row). One row per "
             f"run (model `-s<seed>`).", "", *records.table(rows, cols), "",
             *records.commands(rows)]
    write_table(base / "table.md", f"{study}: serial (1 rank) vs layer-parallel MGRIT (2 ranks, "
                "inexact)", meta, "\n".join(lines))
    summary, head = [f"# {study}: summary (mean +- sample standard deviation over seeds)", ""], []
    for model in STUDIES[study]:
        acc = {m: [r["test_acc"] for r in rows if r["method"] == m
                   and r["model"].rsplit("-s", 1)[0] == model] for m in METHODS}
        exact = [r["exact"]["test_acc"] for r in rows if r["method"] == "mgrit" and r.get("exact")
                 and r["model"].rsplit("-s", 1)[0] == model]
        summary.append(f"- **{model}**: test accuracy serial {_mean_spread(acc['serial'])}, "
                       f"MGRIT {_mean_spread(acc['mgrit'])}; MGRIT's final weights with the "
                       f"exact forward {_mean_spread(exact)}.")
        if acc["serial"] and acc["mgrit"]:
            head.append({"claim": f"{model}: 2-rank inexact MGRIT vs serial, same budget",
                         "ours": f"serial {_mean_spread(acc['serial'])} vs MGRIT "
                                 f"{_mean_spread(acc['mgrit'])}", "kind": "measured"})
    summary += ["", f"Commits of the runs: {sorted({r['commit'] for r in rows})}.", ""]
    (base / "summary.md").write_text("\n".join(summary))
    (base / "headline.json").write_text(json.dumps(
        {"commits": sorted({r["commit"] for r in rows}), "rows": head}, indent=1))
    print((base / "summary.md").read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_flags(p, "the record: every model, both methods, seeds 0, 1, 2 (the default)")
    p.add_argument("--study", choices=sorted(STUDIES), required=True)
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite table.md, summary.md, headline.json from the runs")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="seeds (default 0 1 2; --smoke: 0)")
    p.add_argument("--extra", default="", help="flags appended to every job, e.g. "
                   "'--limit-train 1000 --epochs 2' for a smaller budget (recorded in the "
                   "commands of table.md)")
    a = p.parse_args(argv)
    base = results_dir(a.study, a.out or OUT)
    seeds = a.seeds or ((0,) if a.smoke else SEEDS)
    if a.study == "tied_resnet" and not has_flag("--tied"):
        return skip("the main job has no --tied flag yet (weight-tied layers, issue 23 item 3); "
                    "rerun after it is merged")
    if not a.report_only:
        for model in STUDIES[a.study]:
            for seed in seeds:
                for method in METHODS:
                    run(a.study, model, method, seed, base, a.smoke, shlex.split(a.extra))
    report(a.study, base, seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
