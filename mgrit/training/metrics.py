"""Run-directory output: ``metrics.h5`` (one dataset per metric, one entry per epoch; group
``steps`` with one entry per optimizer step; the config and the test metrics before training in
attributes), ``metrics.csv`` (per epoch, row 0 = before training), ``steps.csv`` (per step,
written as the steps finish), ``summary.json`` (config, final metrics, history, times,
command, git commit, machine, which forward produced the test metrics) and ``curves.png``
(per-step and per-epoch training loss, test loss and accuracies over epochs, epoch 0 = before
training); optionally TensorBoard event files (``tensorboard/``, :mod:`torch.utils.tensorboard`).
:class:`MetricsWriter` is the training-loop callback (root rank only); the ``write_*``
functions serve other loops."""
from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import h5py
import numpy as np
import torch

from ..reporting import writers as report
from .records import EpochRecord, FitPlan, FitResult, StepRecord

if TYPE_CHECKING:  # annotations only: no import cycle with the trainer
    from .trainer import Trainer

__all__ = ["MetricsWriter", "write_metrics", "write_curves", "write_summary", "write_csv",
           "STEP_KEYS"]

#: Per-step series (``metrics.h5`` group ``steps``, ``steps.csv``): the 0-based step, the
#: epoch position (``epoch + batches done / batches per epoch``, so step curves share the
#: epoch axis), the mean loss and accuracy of replica 0's share of the batch (NaN: none) and
#: the learning rate the step used (the optimizer's first parameter group; NaN: none).
STEP_KEYS = ("step", "epoch", "loss", "accuracy", "lr")


def _floats(v) -> np.ndarray:
    return np.array([np.nan if x is None else x for x in v], dtype=np.float64)


def write_metrics(run, hist: dict, config: dict, steps: dict | None = None,
                  initial: tuple | None = None) -> None:
    """``run/metrics.h5`` atomically: ``hist[key]`` as float64 datasets (None -> NaN; HDF5
    Fletcher-32 checksummed, :func:`~mgrit.reporting.writers.create_checked`), the ``config`` as JSON attribute ``config`` plus its scalar entries as attributes; ``steps``
    (:data:`STEP_KEYS` -> lists) as the group ``steps``; ``initial`` = ``(test accuracy, test
    loss)`` before training as attributes ``initial_test_acc`` / ``initial_test_loss``."""
    run = Path(run)
    tmp = run / "metrics.h5.tmp"
    with h5py.File(tmp, "w") as f:
        for k, v in hist.items():
            report.create_checked(f, k, _floats(v))
        if steps is not None:
            g = f.create_group("steps")
            for k in STEP_KEYS:
                report.create_checked(g, k, _floats(steps.get(k, [])))
        if initial is not None:
            f.attrs["initial_test_acc"], f.attrs["initial_test_loss"] = _floats(initial)
        f.attrs["config"] = json.dumps(config, default=str)
        for k, v in config.items():
            if isinstance(v, (int, float, str, bool)):
                f.attrs[k] = v
    os.replace(tmp, run / "metrics.h5")


def write_curves(run, hist: dict, title: str, steps: dict | None = None,
                 initial: tuple | None = None) -> None:
    """``run/curves.png``, two panels over epochs (integer ticks; epoch 0 = before training):
    the training loss per step (thin line, ``steps``) and per epoch (mean), the test loss
    (from epoch 0 with ``initial`` = ``(test accuracy, test loss)`` before training); the
    train and test accuracy per epoch (test from epoch 0); the validation loss and accuracy
    per epoch when ``hist`` has ``val_loss`` / ``val_acc``."""
    # matplotlib is imported here: it takes about a second and only the root rank plots
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ep = list(hist["epoch"])
    init_acc, init_loss = initial if initial is not None else (None, None)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    if steps and len(steps.get("loss", [])):
        ax1.plot(steps["epoch"], _floats(steps["loss"]), "-", lw=0.8, alpha=0.6,
                 color="tab:blue", label="train loss per step")
    ax1.plot(ep, _floats(hist["loss"]), "o", color="tab:blue", label="train loss (epoch mean)")
    test_loss = _floats(hist.get("test_loss", []))
    if len(test_loss) and not np.all(np.isnan(test_loss)) or init_loss is not None:
        xs = ([0] if init_loss is not None else []) + ep[:len(test_loss)]
        ys = ([init_loss] if init_loss is not None else []) + list(test_loss)
        ax1.plot(xs, ys, "s-", color="tab:orange", label="test loss")
    for key, ax, label in (("val_loss", ax1, "validation loss"), ("val_acc", ax2, "validation")):
        v = _floats(hist.get(key, []))  # a held-out split (mgrit.training.heldout.Validation)
        if len(v) and not np.all(np.isnan(v)):
            ax.plot(ep[:len(v)], v, "^--", color="tab:green", label=label)
    ax1.set_ylabel("loss")
    acc_drawn = False
    train_acc = _floats(hist.get("train_acc", []))
    if len(train_acc) and not np.all(np.isnan(train_acc)):
        ax2.plot(ep, train_acc, "o-", color="tab:blue", label="train (epoch)")
        acc_drawn = True
    test_acc = _floats(hist.get("test_acc", []))
    if (len(test_acc) and not np.all(np.isnan(test_acc))) or init_acc is not None:
        xs = ([0] if init_acc is not None else []) + ep[:len(test_acc)]
        ys = ([init_acc] if init_acc is not None else []) + list(test_acc)
        ax2.plot(xs, ys, "s-", color="tab:orange", label="test")
        acc_drawn = True
    if not acc_drawn:
        ax2.text(0.5, 0.5, "no accuracy (not a classification)", ha="center", va="center",
                 transform=ax2.transAxes)
    if "val_acc" in hist and not np.all(np.isnan(_floats(hist["val_acc"]))):
        acc_drawn = True
    ax2.set_ylabel("accuracy")
    last = max([1] + [int(np.ceil(e)) for e in ep])
    for ax in (ax1, ax2):
        ax.set_xlabel("epoch (0 = before training)")
        ax.set_xlim(-0.05 * last, last * 1.05)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(run) / "curves.png", dpi=100)
    plt.close(fig)


def write_csv(run, hist: dict, initial: tuple | None = None) -> None:
    """``run/metrics.csv``: one row per epoch (the :data:`HISTORY_KEYS` columns), after a row
    ``epoch 0`` with the test metrics before training (``initial``); empty cells for None."""
    keys = list(hist)
    rows = []
    if initial is not None:
        rows.append({"epoch": 0, "test_acc": initial[0], "test_loss": initial[1]})
    n = len(hist.get("epoch", []))
    rows += [{k: hist[k][i] for k in keys if i < len(hist[k])} for i in range(n)]
    with open(Path(run) / "metrics.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r[k] for k in keys})


def write_summary(run, summary: dict) -> None:
    """``run/summary.json`` with ``summary`` plus the command line, git commit, machine,
    torch version and date (keys already in ``summary`` win)."""
    world = int(summary.get("world_size", 1))
    meta = {"command": ((f"mpiexec -n {world} python -m mpi4py " if world > 1 else "python ")
                        + " ".join(shlex.quote(x) for x in sys.argv)),
            "argv": sys.argv, "git_commit": report.run_metadata()["commit"],
            "host": platform.node(), "platform": platform.platform(), "torch": torch.__version__,
            "date": _dt.datetime.now().isoformat(timespec="seconds")}
    (Path(run) / "summary.json").write_text(json.dumps({**summary, **{k: v for k, v in meta.items()
                                                                      if k not in summary}},
                                                       indent=2, default=str))


class MetricsWriter:
    """Callback writing, on the root rank, into ``run``: ``steps.csv`` after every step,
    ``metrics.h5`` and ``metrics.csv`` after every epoch, and ``metrics.h5``, ``metrics.csv``,
    ``summary.json`` and ``curves.png`` at the end of the fit (and from
    :meth:`write_interrupted`). The per-step series are part of its state (checkpoints), so a
    resumed run's files cover the steps before the resume too.

    Args:
        run: the run directory (must exist).
        config: dict stored in ``metrics.h5`` and ``summary.json`` (JSON-serializable).
        title: title of ``curves.png``.
        extra: more ``summary.json`` entries (may be updated until the fit ends).
        eval_solve: ``trainer -> str``, which forward produced the test metrics (summary key
            ``test_metrics_from``), asked at the end of the fit; None: not reported.
        tensorboard: also write TensorBoard event files into ``run/tensorboard``
            (:class:`torch.utils.tensorboard.SummaryWriter`; ImportError with the install
            line when the ``tensorboard`` package is missing).
    """

    def __init__(self, run: str | os.PathLike, config: dict | None = None, title: str = "",
                 extra: dict | None = None, eval_solve: Callable[[Trainer], str] | None = None,
                 tensorboard: bool = False):
        self.run, self.config, self.title = Path(run), dict(config or {}), title
        self.extra = dict(extra or {})
        self.eval_solve, self.tensorboard = eval_solve, bool(tensorboard)
        self.steps = {k: [] for k in STEP_KEYS}
        self.initial = None
        self._t0, self._nb, self._csv, self._tb = None, 1, None, None
        self._start_epoch = 0

    def state_dict(self) -> dict:
        return {"steps": {k: list(v) for k, v in self.steps.items()}}

    def load_state_dict(self, state: dict) -> None:
        steps = state.get("steps", {})
        n = len(steps.get("step", []))  # a key older checkpoints lack (lr): NaN per step
        self.steps = {k: list(steps.get(k, [np.nan] * n)) for k in STEP_KEYS}

    def on_fit_start(self, trainer: Trainer, plan: FitPlan) -> None:
        self._t0 = time.perf_counter()
        self._start_epoch = plan.start_epoch
        self._nb = max(1, plan.batches_per_epoch)
        self.initial = (plan.initial_test_acc, plan.initial_test_loss)
        self.config.setdefault("parameters", plan.parameters)
        if plan.resumed_from:  # what the resume changed (summary.json; the list may grow in
            # later callbacks' on_fit_start, e.g. a re-planned learning-rate schedule)
            self.extra["resumed"] = {"from": plan.resumed_from, "at_epoch": plan.start_epoch + 1,
                                     "at_batch": plan.start_batch, "notes": plan.notes}
        if not trainer.is_root:
            return
        if self._csv is None:  # steps.csv, rewritten with the steps restored by a resume
            self._csv = open(self.run / "steps.csv", "w", newline="", buffering=1)
            self._csv.write(",".join(STEP_KEYS) + "\n")
            for row in zip(*(self.steps[k] for k in STEP_KEYS)):
                self._write_step(row)
        if self.tensorboard and self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("--tensorboard / MetricsWriter(tensorboard=True) needs the "
                                  "tensorboard package: pip install 'layerpar[tensorboard]' "
                                  "(or pip install tensorboard)") from exc
            self._tb = SummaryWriter(str(self.run / "tensorboard"))
            for name, v in zip(("test/accuracy", "test/loss"), self.initial):
                if v is not None:
                    self._tb.add_scalar(name, v, 0)

    def _write_step(self, row) -> None:
        self._csv.write(",".join("" if v is None or v != v else repr(float(v)) if k != "step"
                                 else str(int(v)) for k, v in zip(STEP_KEYS, row)) + "\n")

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        if not trainer.is_root or record.loss is None:
            return
        pos = (record.epoch + (record.batch + 1) / self._nb if record.epoch is not None
               else float(record.step + 1) / self._nb)
        acc = (record.correct / record.samples if record.correct is not None and record.samples
               else None)
        row = (record.step, pos, float(record.loss), acc, record.lr)
        for k, v in zip(STEP_KEYS, row):
            self.steps[k].append(np.nan if v is None else v)
        if self._csv is not None:
            self._write_step(row)
        if self._tb is not None:
            self._tb.add_scalar("train/loss_step", row[2], record.step + 1)

    def _files(self, hist) -> None:
        write_metrics(self.run, hist, self.config, self.steps, self.initial)
        write_csv(self.run, hist, self.initial)

    def on_epoch_end(self, trainer: Trainer, record: EpochRecord) -> None:
        if not trainer.is_root:
            return
        self._files(trainer.history)
        if self._tb is not None:
            step = trainer.steps_done
            for name, v in (("train/loss", record.loss), ("train/accuracy", record.train_acc),
                            ("test/loss", record.test_loss), ("test/accuracy", record.test_acc)):
                if v is not None:
                    self._tb.add_scalar(name, v, step)
            self._tb.flush()

    def _summary(self, trainer, hist, final, **more) -> None:
        all_times = hist.get("epoch_time", [])
        times = [t for t in all_times if t is not None]
        this_run = [t for t in all_times[self._start_epoch:] if t is not None]
        grid = trainer.grid
        if self.eval_solve is not None:
            self.extra["test_metrics_from"] = self.eval_solve(trainer)
        write_summary(self.run, {
            "config": self.config, "final": final, "epochs": hist,
            # this run's wall time and training time; a resumed fit adds all runs' epochs
            "times": {"total_s": time.perf_counter() - (self._t0 or time.perf_counter()),
                      "train_s": float(np.sum(this_run)),
                      **({"train_s_all_runs": float(np.sum(times))} if self._start_epoch else {}),
                      "mean_epoch_s": float(np.mean(times)) if times else float("nan")},
            "world_size": grid.comm.Get_size(), "dp": grid.data_size, "P_L": grid.layer_size,
            **more, **self.extra})
        write_curves(self.run, hist, self.title, self.steps, self.initial)

    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        if not trainer.is_root:
            return
        self._files(result.history)
        self._summary(trainer, result.history, result.final, steps=result.steps,
                      forward_stats=result.solver_stats)
        self.close()

    def write_interrupted(self, trainer: Trainer, report: str) -> None:
        """The files of a fit stopped early (root rank): metrics so far, ``summary.json``
        with ``interrupted`` = ``report`` and the last finished epoch's metrics as
        ``final`` (None before the first), ``curves.png``."""
        if not trainer.is_root:
            return
        hist = trainer.history or {}
        final = ({k: hist[k][-1] for k in ("loss", "train_acc", "test_acc", "test_loss")}
                 if hist.get("loss") else None)
        try:  # the summary first: an interrupt inside the epoch's own file writing may leave
            # those files half written, and their rewrite must not cost the summary
            self._summary(trainer, hist or {"epoch": [], "loss": []}, final,
                          steps=trainer.steps_done, interrupted=report)
            if hist:
                self._files(hist)
        finally:
            self.close()

    def close(self) -> None:
        """Close ``steps.csv`` and the TensorBoard writer (idempotent)."""
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
