"""Shared machinery of the main job's recorded comparisons (``experiments/records/transformer_records.py``,
``experiments/records/compare_mainjob.py``): serial (1 rank) vs layer-parallel MGRIT (2 ranks) runs of
``experiments/train.py`` with the same seed and epochs (and ``stateful_records.py``).

A record keeps each run in ``<base>/runs/<name>/`` (the job's ``config.json``,
``metrics.h5``, ``summary.json``, ``curves.png``). :func:`command` builds the job's command line
(``--serial`` on 1 rank, or ``mpiexec -n 2 ... --method mgrit`` with a checkpoint at the end),
:func:`run_job` launches it (``OMP_NUM_THREADS=1``, the venv's mpiexec) and evaluates a
layer-parallel run's final weights with the exact forward (:func:`exact_evaluation`,
``exact_eval.json``); :func:`load` and :func:`row` turn a run directory into a table row,
:func:`table` / :func:`commands` into markdown. The statistics over seeds (intervals, the gap
per epoch, the held-out choice, the verdict) are ``experiments/reports/seeds.py``. Every number
comes from the runs' files; nothing is typed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))

from mgrit.training import Trainer  # noqa: E402
from data import TEXT_CORPORA, load_dataset, load_text  # noqa: E402
from layerpar.job import OPTIMIZERS  # noqa: E402
from layerpar.jobconfig import LANGUAGE_MODELS, JobConfig  # noqa: E402
from mgrit.models.lm import lm_loss, token_accuracy  # noqa: E402
from mgrit.models import build_model  # noqa: E402

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
#: --smoke: the same jobs, tiny (seconds each; for the test suite)
SMOKE = ["--limit-train", "64", "--limit-test", "32", "--epochs", "1", "--layers", "4"]


def command(common: list, mgrit: list, method: str, out: Path, smoke: bool = False,
            smoke_flags: list = SMOKE) -> list:
    """``experiments/train.py`` with ``common`` flags into ``out``: ``--serial`` on 1 rank when
    ``method`` is ``serial``, else 2 ranks with ``--method mgrit`` and the ``mgrit`` flags;
    ``smoke``: with ``smoke_flags`` too."""
    job = [sys.executable, "-m", "mpi4py", "experiments/train.py", *common, "--no-progress",
           *(smoke_flags if smoke else []), "--out", str(out), "--overwrite"]  # a rerun replaces
    if method == "serial":
        return job + ["--serial"]
    # a checkpoint after every epoch (the last one is evaluated exactly, then deleted)
    return [MPIEXEC, "-n", "2", *job, "--method", "mgrit", *mgrit, "--checkpoint-every",
            "1000000000"]


def require_runs(parser, runs) -> None:
    """``--report-only``'s check: ``parser.error`` (status 2) naming every run directory of
    ``runs`` without its ``summary.json``, before anything is created or written."""
    missing = [str(Path(d) / "summary.json") for d in runs
               if not (Path(d) / "summary.json").is_file()]
    if missing:
        parser.error(f"--report-only needs every run; missing {', '.join(missing)} (run "
                     f"without --report-only first)")


def run_job(cmd: list, out: Path) -> None:
    """Run ``cmd`` (from the repository root, one torch thread per rank), with the load average
    before and after it in ``out/load.json``; a run that left a checkpoint gets
    :func:`exact_evaluation`, then the checkpoint is deleted."""
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    before = os.getloadavg()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=3 * 3600)
    (out / "load.json").write_text(json.dumps(
        {"before": before, "after": os.getloadavg(), "cores": os.cpu_count()}, indent=1))
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
    cfg.update(method="serial", dp=1, resume=None, checkpoint_every=0,
               spatial_coarsening="", spatial_restrict=None, spatial_prolong=None)  # MGRIT only
    c = JobConfig(**cfg).validated(1)
    dtype = torch.float64 if c.dtype == "float64" else torch.float32
    torch.set_default_dtype(dtype)
    if c.dataset in TEXT_CORPORA:  # as the job loads them (layerpar.job)
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


def load(run: Path) -> dict | None:
    """The run's ``summary.json`` with ``exact_eval`` (its ``exact_eval.json`` or None); None
    when the run has no summary."""
    path = run / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    exact = run / "exact_eval.json"
    s["exact_eval"] = json.loads(exact.read_text()) if exact.is_file() else None
    return s


def cmd_text(s: dict, run: Path, study: str) -> str:
    """The job's command line as run (from its summary), relative to the repository, with
    ``--out`` the run directory where it is kept."""
    argv = list(s["argv"])
    argv[0] = os.path.relpath(argv[0], ROOT) if os.path.isabs(argv[0]) else argv[0]
    if "--out" in argv:
        i = argv.index("--out")
        argv[i + 1] = f"experiments/results/records/{study}/runs/{run.name}"
    pre = "OMP_NUM_THREADS=1 " + ("mpiexec -n 2 python -m mpi4py " if s["world_size"] > 1
                                  else "python ")
    return pre + " ".join(shlex.quote(a) for a in argv)


def row(model: str, method: str, s: dict, run: Path, study: str) -> dict:
    """A table row from a run's summary (:func:`load`)."""
    f, t, e = s["final"], s["times"], s["epochs"]
    r = {"model": model, "method": method, "ranks": s["world_size"],
         "epochs": len(e["epoch"]), "test_acc": f["test_acc"], "test_loss": f["test_loss"],
         "epoch_s": t["mean_epoch_s"], "train_s": t["train_s"], "commit": s["git_commit"],
         "date": s["date"], "command": cmd_text(s, run, study),
         "fwd_res": e["fwd_residual_mean"][-1] if e.get("fwd_residual_mean") else None,
         "parameters": s["config"].get("parameters"), "train_loss": f["loss"],
         "last3_acc": sum(e["test_acc"][-3:]) / len(e["test_acc"][-3:]),
         "test_accs": e["test_acc"], "exact": s.get("exact_eval"),
         "load": json.loads((run / "load.json").read_text()) if (run / "load.json").is_file()
         else None}
    if model in LANGUAGE_MODELS:
        r["bpc"] = f["test_loss"] / math.log(2)
    return r


def rows(base: Path, runs: dict, study: str) -> list:
    """The rows of the runs ``{model: [method, ...]}`` recorded under ``base/runs``."""
    out = []
    for model, methods in runs.items():
        for method in methods:
            run = base / "runs" / f"{model}-{method}"
            s = load(run)
            if s is not None:
                out.append(row(model, method, s, run, study))
    return out


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def loadavg(v) -> str:
    """A load-average triple (1, 5, 15 minutes) as text."""
    return " ".join(f"{x:.2f}" for x in v)


def exact_text(r: dict) -> str:
    e = r.get("exact")
    if not e:
        return "-"
    if r["model"] in LANGUAGE_MODELS:
        return f"loss {e['test_loss']:.4f} ({e['test_loss'] / math.log(2):.4f} bpc)"
    return f"{e['test_acc'] * 100:.2f}%"


#: column header -> cell of a row (:func:`table` picks the columns)
CELLS = {
    "model": lambda r: r["model"], "method": lambda r: r["method"],
    "ranks": lambda r: f"{r['ranks']}", "epochs": lambda r: f"{r['epochs']}",
    "parameters": lambda r: f"{r['parameters']}",
    "train loss": lambda r: f"{r['train_loss']:.4f}",
    "test accuracy": lambda r: f"{fmt(r['test_acc'] * 100, '.2f')}%",
    "mean of the last 3 epochs": lambda r: f"{r['last3_acc'] * 100:.2f}%",
    "validation loss": lambda r: fmt(r["test_loss"], ".4f"),
    "test loss": lambda r: fmt(r["test_loss"], ".4f"),
    "bpc": lambda r: fmt(r.get("bpc"), ".4f"),
    "final weights, exact forward": exact_text,
    "time / epoch (s)": lambda r: fmt(r["epoch_s"], ".1f"),
    "train time (s)": lambda r: fmt(r["train_s"], ".0f"),
    "last fwd residual (epoch mean)": lambda r: fmt(r["fwd_res"], ".2e"),
    "commit": lambda r: r["commit"], "date": lambda r: r["date"],
}


def table(rows: list, columns: list, cells: dict | None = None) -> list:
    """Markdown lines of a table of ``rows`` with ``columns`` (headers of :data:`CELLS`, or of
    ``cells`` where it has them)."""
    cells = {**CELLS, **(cells or {})}
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells[c](r) for c in columns) + " |" for r in rows]
    return lines


def commands(rows: list) -> list:
    """Markdown lines: each run's command line."""
    return (["Commands (run from the repository root):", ""]
            + [f"- {r['model']} {r['method']}: `{r['command']}`" for r in rows])
