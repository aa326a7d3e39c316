"""Recorded runs of issue 23: networks with state or noise in their layers, trained serially
(1 rank) and layer-parallel (2 ranks, inexact MGRIT), several seeds, the same budget.

Studies (``--study``):

* ``batchnorm_dropout``: the CIFAR-style ResNet with BatchNorm (``--model cifar-resnet``) and the
  ViT with dropout and DropPath (``--model vit --dropout 0.1 --drop-path 0.1``) on the MNIST
  subset, ``--serial`` vs ``--method mgrit``, seeds 0, 1, 2: per model and epoch the mean test
  accuracy of each method with its 95% interval and the paired interval of the gap MGRIT -
  serial (issue 24 item 2; verdict against +-1 point), and the MGRIT run's final
  weights evaluated with the exact serial forward (its running statistics are those of the
  approximate final states of the inexact solves: the difference between the two MGRIT columns
  is what the inexact forward costs at evaluation, the difference to serial what it cost in
  training).
* ``tied_resnet``: the weight-tied ResNet (``--tied``, one step module for all layers) vs its
  untied twin, serial and layer-parallel, seeds 0-4 (runs of ~13 s: five seeds), reported
  like ``batchnorm_dropout``. Needs the main job's ``--tied`` flag;
  without it the study prints why and exits with ``EXIT_SKIP`` (``experiments/regenerate.py``
  lists it as ``skip``).

Full-mode run time: ``batchnorm_dropout`` 938 s (16 min) measured at 01fee7f, 2 idle cores,
``tied_resnet`` 273 s (5 min) measured at 01fee7f, 2 idle cores (``results/manifest.json``).

Usage (plain python: the script launches the 2-rank jobs itself with the venv's mpiexec)::

    python experiments/records/stateful_records.py --study batchnorm_dropout --full
    python experiments/records/stateful_records.py --study tied_resnet --full
    python experiments/records/stateful_records.py --study batchnorm_dropout --report-only
    python experiments/records/stateful_records.py --study batchnorm_dropout --smoke --out /tmp/x

Run directories: ``experiments/results/<study>/runs/<model>-s<seed>-<method>/``; ``table.md``
(every run), ``summary.md`` (intervals, the gap per epoch), ``gap.png``, ``headline.json`` for
``experiments/regenerate.py``. Accuracy is valid on a busy machine; times are wall times under
whatever load there was (kind: mixed). ``--smoke``: one seed, tiny runs (seconds to minutes).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "records"  # default results base folder

from experiments.records import records  # noqa: E402
from experiments.reports import seeds as rseeds  # noqa: E402
from mgrit.reporting.writers import (add_study_flags, interval, paired_interval,  # noqa: E402
                                   results_dir, run_metadata, skip, write_table)

#: seeds per study (issue 24 item 2: >= 5 where a run takes under a minute, >= 3 otherwise;
#: a tied_resnet run takes ~13 s, a batchnorm_dropout run ~80 s at commit 48a9d82)
SEEDS = {"batchnorm_dropout": (0, 1, 2), "tied_resnet": (0, 1, 2, 3, 4)}
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


#: the equivalence margin of the verdicts, in points (the main job's, ``compare_mainjob.TOL``)
TOL = 1.0


def _pairs(base: Path, model: str, seeds) -> dict:
    """``{seed: (serial summary, MGRIT summary)}`` of the seeds that have both runs."""
    got = {}
    for k in seeds:
        s, g = (records.load(base / "runs" / f"{model}-s{k}-{m}") for m in METHODS)
        if s is not None and g is not None:
            got[k] = (s, g)
    return got


def analyse(base: Path, study: str, seeds) -> dict:
    """Per model of ``study``: the per-epoch test accuracy of both methods and the paired gap
    MGRIT - serial (:func:`experiments.reports.seeds.per_epoch`), the verdict of the last
    epoch's gap against :data:`TOL`, and the paired gaps of the MGRIT run's final weights with
    the exact forward (to serial, and to the same run's inexact forward)."""
    out = {}
    for model in STUDIES[study]:
        pairs = _pairs(base, model, seeds)
        if not pairs:
            continue
        test = rseeds.per_epoch(pairs, "test_acc")
        ks = [k for k in sorted(pairs) if pairs[k][1].get("exact_eval")]
        ser = [100 * pairs[k][0]["final"]["test_acc"] for k in ks]
        mg = [100 * pairs[k][1]["final"]["test_acc"] for k in ks]
        ex = [100 * pairs[k][1]["exact_eval"]["test_acc"] for k in ks]
        out[model] = {"pairs": pairs, "test": test,
                      "verdict": rseeds.record_verdict(test[-1]["gap"], TOL, "points"),
                      "exact": interval(ex) if ks else None,
                      "exact_vs_serial": paired_interval(ser, ex) if ks else None,
                      "exact_vs_inexact": paired_interval(mg, ex) if ks else None}
    return out


def _iv(r, unit: str = "", signed: bool = False) -> str:
    return "-" if r is None else rseeds.fmt_interval(r, unit, 2, signed)


def report(study: str, base: Path, seeds) -> None:
    """table.md (every run), summary.md (intervals and the gap per epoch), gap.png and
    headline.json of ``study`` from ``base/runs``."""
    runs = {f"{model}-s{seed}": list(METHODS) for model in STUDIES[study] for seed in seeds}
    rows = records.rows(base, runs, study)
    a = analyse(base, study, seeds)
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
    summary = [f"# {study}: summary (generated from the runs; every run in table.md)", "",
               "Per model: the mean test accuracy over seeds with its two-sided 95% Student-t "
               "interval, per epoch, and the paired interval of the gap MGRIT - serial (the same "
               f"seed in both arms: same initial weights and batch order); the verdict is what "
               f"the last epoch's gap supports against +-{TOL:g} point. `exact forward`: the "
               "MGRIT run's final weights evaluated with the serial forward.", ""]
    head = []
    for model, m in a.items():
        last = m["test"][-1]
        summary += [f"## {model} ({len(m['pairs'])} seeds: {sorted(m['pairs'])})", "",
                    *rseeds.gap_table(m["test"], "test_acc", "test accuracy"), "",
                    f"Verdict (last epoch, test): {m['verdict']}.", "",
                    f"MGRIT's final weights with the exact forward: {_iv(m['exact'], '%')}; "
                    f"minus serial {_iv(m['exact_vs_serial'], ' points', True)}; minus the "
                    f"same run's inexact forward {_iv(m['exact_vs_inexact'], ' points', True)} "
                    "(paired over seeds).", ""]
        head.append({"claim": f"{model}: 2-rank inexact MGRIT vs serial, same budget, test "
                              "accuracy",
                     "ours": f"serial {_iv(last['serial'], '%')} vs MGRIT "
                             f"{_iv(last['mgrit'], '%')} ({len(m['pairs'])} seeds, "
                             f"{last['epoch']} epochs); {m['verdict']}",
                     "kind": "measured"})
    if a:
        rseeds.gap_figure(base / "gap.png", {model: m["test"] for model, m in a.items()},
                          "points", f"{study}: MGRIT - serial, test accuracy")
    summary += [f"Commits of the runs: {sorted({r['commit'] for r in rows})}.", ""]
    (base / "summary.md").write_text("\n".join(summary))
    (base / "headline.json").write_text(json.dumps(
        {"commits": sorted({r["commit"] for r in rows}), "rows": head}, indent=1))
    print((base / "summary.md").read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_flags(p, "the record: every model, both methods, the seeds of SEEDS (the default)")
    p.add_argument("--study", choices=sorted(STUDIES), required=True)
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite table.md, summary.md, headline.json from the runs")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="seeds (default: batchnorm_dropout 0 1 2, tied_resnet 0-4; --smoke: 0)")
    p.add_argument("--extra", default="", help="flags appended to every job, e.g. "
                   "'--limit-train 1000 --epochs 2' for a smaller budget (recorded in the "
                   "commands of table.md)")
    a = p.parse_args(argv)
    base = Path(a.out or OUT) / a.study  # created below, after --report-only's check
    seeds = a.seeds or ((0,) if a.smoke else SEEDS[a.study])
    if a.report_only:
        records.require_runs(p, [base / "runs" / f"{model}-s{k}-{m}"
                                 for model in STUDIES[a.study] for k in seeds for m in METHODS])
    base = results_dir(a.study, a.out or OUT)
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
