"""The main job (``experiments/train.py``) as one call: :func:`run_job` builds the process
grid, the run directory, the data, the network (:mod:`mgrit.training.models`), the optimizer
and the callbacks from a :class:`~mgrit.training.jobconfig.JobConfig` and trains through
:class:`~mgrit.training.Trainer` (``--method serial|mgrit``) or ``layerwise``
(``--method sequential|decoupled``). Threads, the default dtype and ``fail_fast`` belong to
the calling script."""
from __future__ import annotations

import datetime as _dt
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from torch.nn import functional as F

from data import load_dataset
from layerwise import train_layerwise

from ..parallel import ProcessGrid
from .callbacks import ConsoleLog, ProgressBar
from .faults import phase, set_log_dir
from .guard import ConvergenceGuard
from .jobconfig import JobConfig
from .metrics import MetricsWriter, write_curves, write_metrics, write_summary
from .models import build_model
from .trainer import Trainer

__all__ = ["run_job", "OPTIMIZERS", "RUNS"]

#: Default parent folder of run directories (``runs/<method>-<timestamp>``).
RUNS = Path(__file__).resolve().parents[2] / "runs"

#: The ``--optimizer`` choices: name -> ``(parameters, config) -> torch.optim.Optimizer``.
OPTIMIZERS = {
    "sgd": lambda params, c: torch.optim.SGD(params, lr=c.lr, momentum=c.momentum),
    "adam": lambda params, c: torch.optim.Adam(params, lr=c.lr),
}


def _make_run_dir(c: JobConfig, comm: MPI.Comm) -> Path:
    """Rank 0 creates the run directory and writes ``config.json``; every rank gets its path
    or the same error (no rank waits for a failed one)."""
    hint = f"choose a writable run directory (--out {c.out})" if c.out else None
    with phase("run directory", hint=hint):
        found = None
        if comm.Get_rank() == 0:
            try:
                run = Path(c.out) if c.out else _default_out(c.method)
                run.mkdir(parents=True, exist_ok=True)
                (run / "config.json").write_text(json.dumps(
                    {"argv": sys.argv, "world_size": comm.Get_size(), **c.to_dict()}, indent=2,
                    default=str))
                found = ("ok", str(run))
            except OSError as exc:
                found = ("error", f"cannot create the run directory {c.out or run}: "
                                  f"{type(exc).__name__}: {exc.strerror or exc}")
        found = comm.bcast(found, root=0)
        if found[0] == "error":
            raise OSError(found[1])
        return Path(found[1])


def _default_out(method: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = RUNS / f"{method}-{stamp}"
    out, i = base, 1
    while out.exists():
        out, i = Path(f"{base}-{i}"), i + 1
    return out


def _load(c: JobConfig, dtype):
    where = f" and the files in --data-root {c.data_root}" if c.data_root else ""
    with phase("data loading", hint=f"check --dataset {c.dataset}{where} (python -m data list "
                                    f"shows the names; a damaged file must be replaced)"):
        train, test = load_dataset(c.dataset, root=c.data_root, seed=c.seed,
                                   test_fraction=c.test_fraction, normalize=True, flatten=False)
        xtr, ytr = np.asarray(train.x), np.asarray(train.y)
        xte, yte = np.asarray(test.x), np.asarray(test.y)
    if c.limit_train:
        xtr, ytr = xtr[:c.limit_train], ytr[:c.limit_train]
    if c.limit_test:
        xte, yte = xte[:c.limit_test], yte[:c.limit_test]
    return ((torch.as_tensor(xtr, dtype=dtype), torch.as_tensor(ytr, dtype=torch.long)),
            (torch.as_tensor(xte, dtype=dtype), torch.as_tensor(yte, dtype=torch.long)),
            train.num_classes)


def run_job(c: JobConfig, comm: MPI.Comm) -> dict:
    """Run the main job described by ``c`` (validated) on the ranks of ``comm``; returns the
    final metrics. Writes ``config.json``, ``metrics.h5``, ``summary.json`` and
    ``curves.png`` into the run directory (rank 0) and prints progress there."""
    world, rank0 = comm.Get_size(), comm.Get_rank() == 0
    say = (lambda s: print(s, flush=True)) if rank0 else (lambda s: None)
    grid = ProcessGrid(comm, data_parallel=c.dp)
    run = _make_run_dir(c, comm)
    set_log_dir(run)
    dtype = torch.get_default_dtype()
    t_load = time.perf_counter()
    train, test, num_classes = _load(c, dtype)
    t_load = time.perf_counter() - t_load
    in_shape = tuple(train[0].shape[1:])
    config = c.to_dict()
    config.update(world_size=world, P_L=grid.layer_size, P_D=grid.data_size,
                  n_train=len(train[1]), n_test=len(test[1]), input_shape=list(in_shape),
                  num_classes=num_classes, out=str(run), h=c.T / c.layers,
                  torch_threads=torch.get_num_threads())
    features = c.width if c.step == "dense" else c.channels
    say(f"[train] {c.method} on {c.dataset}: {len(train[1])} train / {len(test[1])} test "
        f"{in_shape}, {c.layers} x {c.step} steps ({features} features), world {world} = "
        f"P_L {grid.layer_size} x P_D {grid.data_size}, run dir {run}")
    t0 = time.perf_counter()
    if c.method in ("sequential", "decoupled"):
        final = _run_layerwise(c, grid, train, test, in_shape, num_classes, run, config, t_load)
    else:
        final = _run_trainer(c, grid, train, test, in_shape, num_classes, run, config, t_load)
    say(f"[train] done in {time.perf_counter() - t0:.1f}s: loss {final['loss']:.4f} train_acc "
        f"{final['train_acc']:.4f} test_acc {final['test_acc']:.4f} -> {run}")
    grid.free()
    return final


def _run_trainer(c, grid, train, test, in_shape, num_classes, run, config, t_load) -> dict:
    mgrit = c.method == "mgrit"
    with phase("model setup"):
        net = build_model(c.model, c, in_shape, num_classes,
                          comm=grid.layer_comm if mgrit else None).to(torch.get_default_dtype())
    if mgrit:
        config["warm_start_effective"] = net.resnet.warm_start
    optimizer = OPTIMIZERS[c.optimizer](net.parameters(), c)
    callbacks = []
    if mgrit and c.guard != "off":
        callbacks.append(ConvergenceGuard(window=3, threshold=1.0, action=c.guard,
                                          log_path=str(run / "guard.jsonl")))
    if not c.no_progress:
        callbacks.append(ProgressBar())
    callbacks += [ConsoleLog(), MetricsWriter(
        run, config, f"{c.method} {c.dataset} N={c.layers} world={grid.comm.Get_size()} "
                     f"dp={c.dp}", extra={"method": c.method, "load_s": t_load})]
    trainer = Trainer(net, optimizer, grid, loss=F.cross_entropy, callbacks=callbacks,
                      checkpoint=run / "checkpoint.pt" if c.checkpoint_every else None,
                      checkpoint_every=c.checkpoint_every, eval_batch_size=c.eval_batch_size)
    return trainer.fit(train, epochs=c.epochs, batch_size=c.batch_size, seed=c.seed, test=test,
                       resume=c.resume).final


def _run_layerwise(c, grid, train, test, in_shape, num_classes, run, config, t_load) -> dict:
    """``--method sequential|decoupled`` through :func:`layerwise.train_layerwise`."""
    with phase("model setup"):
        layers = build_model(c.model, c, in_shape, num_classes, form="layers")
    kw = {}
    if c.method == "decoupled":
        kw = dict(num_stages=c.stages, stages_per_rank=c.stages // grid.layer_size)
    t0 = time.perf_counter()
    out = train_layerwise(c.method, layers, num_classes, *train, *test, grid=grid,
                          epochs=c.epochs, batch_size=c.batch_size, optimizer=c.optimizer,
                          lr=c.lr, momentum=c.momentum, seed=c.seed,
                          eval_batch_size=c.eval_batch_size, progress=True, **kw)
    total = time.perf_counter() - t0
    n = len(out["epoch"])
    hist = {"epoch": out["epoch"], "loss": out["loss"], "train_acc": out["train_acc"],
            "test_acc": out["test_acc"], "epoch_time": out["time"]}
    fin = out.get("final") or {}
    final = {"loss": out["loss"][-1] if n else float("nan"),
             "train_acc": out["train_acc"][-1] if n else float("nan"),
             "test_acc": fin.get("acc", out["test_acc"][-1] if n else float("nan"))}
    if grid.comm.Get_rank() == 0:
        write_metrics(run, hist, config)
        write_summary(run, {
            "config": config, "method": c.method, "final": final, "epochs": hist,
            "times": {"total_s": total, "load_s": t_load,
                      "train_s": float(np.nansum(hist["epoch_time"])),
                      "mean_epoch_s": float(np.nanmean(hist["epoch_time"]))},
            "world_size": grid.comm.Get_size(), "dp": c.dp, "P_L": grid.layer_size,
            "stage": out.get("stage"),
            "layerwise_final": {k: v for k, v in fin.items() if isinstance(v, (int, float))}})
        write_curves(run, hist, f"{c.method} {c.dataset} N={c.layers} world="
                                f"{grid.comm.Get_size()} dp={c.dp}")
    return final
