"""The main job (``experiments/train.py``) as one call: :func:`run_job` builds the process
grid, the run directory, the data, the network (:mod:`mgrit.models`), the optimizer
and the callbacks from a :class:`~layerpar.jobconfig.JobConfig` and trains through
:class:`~mgrit.training.Trainer`, for every method: the network and its optimizer (``--method
serial|mgrit``) or a layer-wise training method of :func:`layerwise.build_method` (``--method
sequential|decoupled``). Threads, the default dtype and ``fail_fast`` belong to
the calling script. The run folder's contents: :mod:`layerpar.runfolder`."""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from torch.nn import functional as F

from data import TEXT_CORPORA, load_dataset, load_text
from data.text import corpus_text, vocabulary
from layerwise import build_method

from mgrit.models import build_model
from mgrit.models.lm import LanguageModelReport, lm_loss, token_accuracy
from mgrit.models.recurrent import SEQUENCE_TASKS, GRUSolverLog, load_sequence_task, regression_loss
from mgrit.models.transformer import describe_model
from mgrit.multilevel.initialization import MultilevelMetricsWriter, run_schedule
from mgrit.parallel import ProcessGrid, device_for_rank
from mgrit.training.bias import BiasMonitor
from mgrit.training.callbacks import ConsoleLog, ProgressBar
from mgrit.training.checkpoint import save_checkpoint
from mgrit.training.support import interrupts
from mgrit.training.support.faults import phase, set_log_dir
from mgrit.training.guard import ConvergenceGuard
from mgrit.training.heldout import Validation
from mgrit.training.lrschedule import LRSchedule
from mgrit.training.metrics import MetricsWriter
from mgrit.training.trainer import Trainer

from .jobconfig import LANGUAGE_MODELS, JobConfig
from .resources import preflight
from .runfolder import (ConsoleCopy, RefuseEmptyResume, clear_run_dir, eval_solve, interrupt_line,
                        never_trained)

__all__ = ["run_job", "hold_out", "OPTIMIZERS", "RUNS"]

#: Default parent folder of run directories (``runs/<method>-<timestamp>``): ``runs/`` at the
#: top of the checkout (``layerpar/`` is one level below it; git ignores ``/runs/``).
RUNS = Path(__file__).resolve().parents[1] / "runs"

#: The ``--optimizer`` choices: name -> ``(parameters, config) -> torch.optim.Optimizer``;
#: ``foreach=True`` (multi-tensor kernels, PyTorch's default on CUDA only): the numbers of the
#: per-tensor loop (``tests/nn/test_stacked_leaves.py``).
OPTIMIZERS = {
    "sgd": lambda params, c: torch.optim.SGD(params, lr=c.lr, momentum=c.momentum,
                                             weight_decay=c.weight_decay, foreach=True),
    "adam": lambda params, c: torch.optim.Adam(params, lr=c.lr, weight_decay=c.weight_decay,
                                               foreach=True),
    "adamw": lambda params, c: torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay,
                                                 foreach=True),
}


def job_device(c: JobConfig, comm: MPI.Comm) -> torch.device:
    """``--device``: ``cpu``; ``cuda`` / ``auto`` with CUDA: this rank's node-local GPU
    (:func:`mgrit.parallel.device_for_rank`, collective over ``comm``); ``auto`` without
    CUDA: ``cpu``. (The GPU path is not measured here.)"""
    if c.device == "cpu":
        return torch.device("cpu")
    dev = device_for_rank(comm)
    if c.device == "cuda" and dev.type != "cuda":
        raise ValueError("--device cuda: no CUDA device is available: use --device cpu or auto")
    return dev


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
                if c.overwrite or never_trained(run):  # the previous run's results go
                    clear_run_dir(run)  # (validated: not the folder of the --resume checkpoint)
                _write_config(run, {"world_size": comm.Get_size(), **c.to_dict()})
                found = ("ok", str(run))
            except OSError as exc:
                found = ("error", f"cannot create the run directory {c.out or run}: "
                                  f"{type(exc).__name__}: {exc.strerror or exc}")
        found = comm.bcast(found, root=0)
        if found[0] == "error":
            raise OSError(found[1])
        return Path(found[1])


def _write_config(run: Path, config: dict) -> None:
    """``run/config.json``: the command line and ``config`` (settings and facts, read back by
    :meth:`JobConfig.from_json`)."""
    (run / "config.json").write_text(json.dumps({"argv": sys.argv, **config}, indent=2,
                                                default=str))


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
        if c.dataset in TEXT_CORPORA:  # int64 token windows (n, context), data.text
            train, test = load_text(c.dataset, context=c.context, seed=c.seed,
                                    test_fraction=c.test_fraction)
        elif c.dataset in SEQUENCE_TASKS:  # generated (n, T, 2) sequences, float targets
            train, test = load_sequence_task(c)
        else:
            train, test = load_dataset(c.dataset, root=c.data_root, seed=c.seed,
                                       test_fraction=c.test_fraction, normalize=True,
                                       flatten=False)
        xtr, ytr = np.asarray(train.x), np.asarray(train.y)
        xte, yte = np.asarray(test.x), np.asarray(test.y)
    if c.limit_train:
        xtr, ytr = xtr[:c.limit_train], ytr[:c.limit_train]
    if c.limit_test:
        xte, yte = xte[:c.limit_test], yte[:c.limit_test]
    xdt = dtype if np.issubdtype(xtr.dtype, np.floating) else torch.long  # token ids stay ints
    ydt = torch.long if np.issubdtype(ytr.dtype, np.integer) else dtype  # regression: floats
    return ((torch.as_tensor(xtr, dtype=xdt), torch.as_tensor(ytr, dtype=ydt)),
            (torch.as_tensor(xte, dtype=xdt), torch.as_tensor(yte, dtype=ydt)),
            train.num_classes)


def hold_out(data: tuple, fraction: float) -> tuple[tuple, tuple | None]:
    """``--val-fraction``: ``(train, validation)`` of the training tensors ``data = (x, y)``;
    the validation split is the last ``round(fraction * n)`` of the ``n`` samples (the
    bundled image sets' training splits are already in a seeded shuffled order; a text
    corpus' windows are consecutive, so the validation windows are one contiguous stretch of
    the training text; they share no target character with the training windows, only the
    seam character that the last training window predicts), the training split the rest, in
    order. ``fraction == 0``: ``(data, None)``. The test split is untouched: the three are
    disjoint. (The image sets' normalization statistics remain those of the whole training
    split, as loaded.)

    Raises:
        ValueError: ``fraction`` outside [0, 1), or a split without samples (too few training
            samples for the fraction), naming the value.
    """
    x, y = data
    if not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
        raise ValueError(f"--val-fraction={fraction!r} is not allowed: use a number in [0, 1)")
    if fraction == 0:
        return data, None
    n = len(y)
    k = int(round(fraction * n))
    if k < 1 or k >= n:
        hint = ("a larger --val-fraction" if k < 1 else "a smaller --val-fraction")
        raise ValueError(f"--val-fraction={fraction} of {n} training samples leaves "
                         f"{k} for validation and {n - k} for training: both need at least "
                         f"one (use {hint} or more training samples: --limit-train)")
    return (x[:n - k], y[:n - k]), (x[n - k:], y[n - k:])


class _Run:
    """What the job has built so far (for the report of an interrupted run)."""

    def __init__(self):
        self.trainer, self.writer, self.val = None, None, None


def run_job(c: JobConfig, comm: MPI.Comm) -> dict:
    """Run the main job described by ``c`` (validated) on the ranks of ``comm``; returns the
    final metrics. Writes the run folder (rank 0; :mod:`layerpar.runfolder`: config,
    console log, metrics per step and per epoch, summary, curves, final weights) and prints
    progress, with the forward that produced the test metrics.

    Raises:
        KeyboardInterrupt: after Ctrl-C (in training: on every rank at the same step boundary,
            never inside a checkpoint write; :mod:`mgrit.training.support.interrupts`), once
            rank 0 has printed where the run stopped, the last checkpoint and the command that
            resumes it, and written the summary so far (``summary.json`` key
            ``interrupted``); the caller ends the job (status 130).
    """
    grid = ProcessGrid(comm, data_parallel=c.dp)
    device = job_device(c, comm)
    run = _make_run_dir(c, comm)
    set_log_dir(run)
    state = _Run()
    state.device = device
    with ConsoleCopy(run / "console.log", append=bool(c.resume)) if comm.Get_rank() == 0 \
            else contextlib.nullcontext():
        interrupts.install()  # Ctrl-C in training: every rank stops at the same step boundary
        try:
            final = _run_job(c, comm, grid, run, state)
        except KeyboardInterrupt as exc:
            _report_interrupt(c, comm, run, state, str(exc))
            raise
        finally:
            interrupts.uninstall()
    grid.free()
    return final


def _report_interrupt(c: JobConfig, comm: MPI.Comm, run: Path, state: _Run,
                      detail: str = "") -> None:
    """Rank 0: the interrupt line and the files of the run so far (``detail``: what the
    interrupt cut, e.g. a checkpoint write)."""
    if comm.Get_rank() != 0:
        return
    if detail:
        print(f"[train] {detail}", file=sys.stderr, flush=True)
    t = state.trainer
    plan = getattr(t, "plan", None)
    ckpt = str(run / "checkpoint.pt") if c.checkpoint_every else None
    line = interrupt_line(None if plan is None else t.position,
                          plan.epochs if plan else c.epochs,
                          plan.batches_per_epoch if plan else 0, ckpt,
                          None if t is None else t.saved_at, sys.argv, comm.Get_size())
    print(f"[train] {line}", file=sys.stderr, flush=True)
    if state.writer is not None and plan is not None:
        try:
            state.writer.write_interrupted(t, line)
            print(f"[train] the results so far are in {run}", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - the interrupt is what we report
            print(f"[train] could not write the results so far: {exc}", file=sys.stderr,
                  flush=True)


def _run_job(c: JobConfig, comm: MPI.Comm, grid, run: Path, state: _Run) -> dict:
    world, rank0 = comm.Get_size(), comm.Get_rank() == 0
    say = (lambda s: print(s, flush=True)) if rank0 else (lambda s: None)
    dtype = torch.get_default_dtype()
    t_load = time.perf_counter()
    train, test, num_classes = _load(c, dtype)
    if c.val_fraction > 0:  # a phase only then: without a split, the phases' entries (the
        # fault injector's counts: the data set, then one per step) stay as they were
        with phase("data loading", hint="choose --val-fraction in [0, 1) that leaves samples "
                                        "in both splits"):
            train, state.val = hold_out(train, c.val_fraction)
    else:
        state.val = None
    t_load = time.perf_counter() - t_load
    in_shape = tuple(train[0].shape[1:])
    config = c.to_dict()
    config.update(world_size=world, P_L=grid.layer_size, P_D=grid.data_size,
                  n_train=len(train[1]), n_test=len(test[1]),
                  n_val=0 if state.val is None else len(state.val[1]), input_shape=list(in_shape),
                  num_classes=num_classes, out=str(run), h=c.T / c.layers,
                  torch_threads=torch.get_num_threads(), device_effective=str(state.device))
    if rank0:  # with the facts export needs (input shape, classes)
        _write_config(run, config)
    val = "" if state.val is None else f"{len(state.val[1])} validation / "
    say(f"[train] {c.method} on {c.dataset}: {len(train[1])} train / {val}{len(test[1])} test "
        f"{in_shape}, {describe_model(c)}, world {world} = "
        f"P_L {grid.layer_size} x P_D {grid.data_size}, run dir {run}")
    with phase("model setup"):
        preflight(c, comm, grid.layer_size, in_shape, num_classes, len(train[1]))
    t0 = time.perf_counter()
    if c.method in ("sequential", "decoupled"):
        final = _run_layerwise(c, grid, train, test, in_shape, num_classes, run, config, t_load,
                               state)
    else:
        final = _run_trainer(c, grid, train, test, in_shape, num_classes, run, config, t_load,
                             state)
    num = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731  (None: no accuracy)
    final["test_metrics_from"] = eval_solve(state.trainer.net, c.method, c.model, c.gru_eval_rtol)
    say(f"[train] done in {time.perf_counter() - t0:.1f}s: loss {num(final['loss'])} train_acc "
        f"{num(final['train_acc'])} test_acc {num(final['test_acc'])} (test metrics from the "
        f"{final['test_metrics_from']}) -> {run}")
    return final


def _run_trainer(c, grid, train, test, in_shape, num_classes, run, config, t_load,
                 state) -> dict:
    mgrit, device = c.method == "mgrit", state.device

    def build(cfg):
        return build_model(c.model, cfg, in_shape, num_classes, comm=grid.layer_comm if mgrit
                           else None).to(device=device, dtype=torch.get_default_dtype())

    def make(cfg, net, levels=None):
        state.trainer = _make_trainer(cfg, grid, net, test, run, config, t_load, levels,
                                      val=state.val)
        state.writer = next(cb for cb in state.trainer.callbacks if isinstance(cb, MetricsWriter))
        return state.trainer

    def fit(trainer, cfg, resume):
        return trainer.fit(train, epochs=cfg.epochs, batch_size=cfg.batch_size, seed=cfg.seed,
                           test=test, resume=resume)

    if c.multilevel_init:  # coarse-to-fine in depth, one fit per depth (multilevel_init)
        final = run_schedule(c, grid, build, make, fit)
    else:
        with phase("model setup"):
            net = build(c)
        final = fit(make(c, net), c, c.resume).final
    # the final weights, for layerpar.export.load_run (a plain PyTorch model)
    save_checkpoint(run / "model.pt", state.trainer.net, None, grid)
    return final


def _make_trainer(c, grid, net, test, run, config, t_load, levels=None, val=None) -> Trainer:
    """Optimizer, callbacks and :class:`Trainer` of ``net``; ``levels``: the
    :class:`~mgrit.multilevel.initialization.LevelHistory` of a ``--multilevel-init`` schedule
    (first callback; one metrics writer for all levels); ``val``: the ``--val-fraction``
    split (a :class:`~mgrit.training.heldout.Validation` callback) or None."""
    mgrit = c.method == "mgrit"
    if mgrit:  # the first layer-parallel segment's (the GRU's for --model gru)
        config["warm_start_effective"] = (net.gru if c.model == "gru"
                                          else net.segments[0]).warm_start
    optimizer = OPTIMIZERS[c.optimizer](net.parameters(), c)
    loss, metric, vocab = F.cross_entropy, None, None
    if c.model in LANGUAGE_MODELS:  # next-token loss, token accuracy, bpc and a sample
        loss, metric = lm_loss, token_accuracy
        text, info = corpus_text(c.dataset)
        vocab = vocabulary(text)
        config["corpus"] = {**vars(info), "vocabulary": "".join(vocab)}
    if c.dataset in SEQUENCE_TASKS:  # the adding problem: a regression (MSE, no accuracy)
        loss = regression_loss
    callbacks = [RefuseEmptyResume()] if levels is None else [levels]
    # stepped after every optimizer step; also "none" (a constant rate), so that a resume
    # with another --lr-schedule re-plans the rates (LRSchedule)
    callbacks.append(LRSchedule(c.lr_schedule, warmup_epochs=c.warmup_epochs,
                                step_epochs=c.lr_step_epochs, gamma=c.lr_gamma))
    if mgrit and c.guard != "off":
        callbacks.append(ConvergenceGuard(window=3, threshold=1.0, action=c.guard,
                                          log_path=str(run / "guard.jsonl")))
    if mgrit and c.bias_monitor != "off":
        callbacks.append(BiasMonitor(action=c.bias_monitor, every=c.bias_every,
                                     ratio=c.bias_ratio, window=c.bias_window,
                                     log_path=str(run / "bias.jsonl")))
    if not c.no_progress:
        callbacks.append(ProgressBar())
    title = (f"{c.method} {c.dataset} {c.model} N={config['layers']} world="
             f"{grid.comm.Get_size()} dp={c.dp}")
    describe = lambda t: eval_solve(t.net, c.method, c.model, c.gru_eval_rtol)  # noqa: E731
    if levels is None:
        writer = MetricsWriter(run, config, title, extra={"method": c.method, "load_s": t_load},
                               eval_solve=describe, tensorboard=c.tensorboard)
    else:
        levels.writer = writer = levels.writer or MultilevelMetricsWriter(
            run, config, f"{title} multilevel {levels.depths}",
            extra={"method": c.method, "load_s": t_load}, levels=levels)
        writer.eval_solve, writer.tensorboard = describe, c.tensorboard
    callbacks.append(ConsoleLog())
    if val is not None:  # after the epoch line, before the writer (its files carry val_*)
        callbacks.append(Validation(val))
    if mgrit and c.model == "gru":
        callbacks.append(GRUSolverLog(extra=writer.extra))
    if vocab is not None:
        callbacks.append(LanguageModelReport(vocab, test[0][0][:32], c.context, run=run,
                                             extra=writer.extra))
    callbacks.append(writer)
    trainer = Trainer(net, optimizer, grid, loss=loss, callbacks=callbacks,
                      checkpoint=run / "checkpoint.pt" if c.checkpoint_every else None,
                      checkpoint_every=c.checkpoint_every, eval_batch_size=c.eval_batch_size,
                      metric=metric, clip_grad_norm=c.clip_grad_norm or None)
    return trainer


def _run_layerwise(c, grid, train, test, in_shape, num_classes, run, config, t_load,
                   state) -> dict:
    """``--method sequential|decoupled``: the layer-wise method (:func:`layerwise.build_method`)
    in the same :class:`Trainer` loop (epochs, evaluation, metrics, progress, checkpoints)."""
    kw = dict(num_stages=c.stages, stages_per_rank=c.stages // grid.layer_size) \
        if c.method == "decoupled" else {}
    with phase("model setup"):
        layers = build_model(c.model, c, in_shape, num_classes, form="layers")
        method = build_method(c.method, layers, num_classes, in_shape, grid=grid,
                              epochs=c.epochs, optimizer=c.optimizer, lr=c.lr,
                              momentum=c.momentum, weight_decay=c.weight_decay, seed=c.seed,
                              cache_batch_size=c.eval_batch_size, **kw)
    extra = {"method": c.method, "load_s": t_load}
    if c.method == "sequential":  # --epochs is per layer: the loop runs the whole schedule
        extra["stage"] = list(method.plan)
    callbacks = [RefuseEmptyResume()] + ([] if c.no_progress else [ProgressBar()])
    state.writer = MetricsWriter(
        run, config, f"{c.method} {c.dataset} {c.model} N={c.layers} world="
                     f"{grid.comm.Get_size()} dp={c.dp}", extra=extra,
        eval_solve=lambda t: eval_solve(t.net, c.method), tensorboard=c.tensorboard)
    callbacks += [ConsoleLog()] + ([Validation(state.val)] if state.val is not None else [])
    callbacks += [state.writer]
    state.trainer = trainer = Trainer(method, None, grid, callbacks=callbacks,
                      checkpoint=run / "checkpoint.pt" if c.checkpoint_every else None,
                      checkpoint_every=c.checkpoint_every, eval_batch_size=c.eval_batch_size)
    epochs = len(method.plan) if c.method == "sequential" else c.epochs
    final = trainer.fit(train, epochs=epochs, batch_size=c.batch_size, seed=c.seed, test=test,
                        resume=c.resume).final
    save_checkpoint(run / "model.pt", method, None, grid)  # the final weights, for export
    return final
