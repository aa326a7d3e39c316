"""Run-directory output: ``metrics.h5`` (one dataset per metric, one entry per epoch; the
config in attributes), ``summary.json`` (config, final metrics, history, times, command, git
commit, machine) and ``curves.png`` (loss and accuracy per epoch). :class:`MetricsWriter` is
the training-loop callback (root rank only); the ``write_*`` functions serve other loops."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from . import report
from .records import EpochRecord, FitPlan, FitResult

__all__ = ["MetricsWriter", "write_metrics", "write_curves", "write_summary"]


def write_metrics(run, hist: dict, config: dict) -> None:
    """``run/metrics.h5`` atomically: ``hist[key]`` as float64 datasets (None -> NaN; HDF5
    Fletcher-32 checksummed, :func:`~mgrit.training.report.create_checked`), the
    ``config`` as JSON attribute ``config`` plus its scalar entries as attributes."""
    run = Path(run)
    tmp = run / "metrics.h5.tmp"
    with h5py.File(tmp, "w") as f:
        for k, v in hist.items():
            report.create_checked(f, k, np.array([np.nan if x is None else x for x in v],
                                                 dtype=np.float64))
        f.attrs["config"] = json.dumps(config, default=str)
        for k, v in config.items():
            if isinstance(v, (int, float, str, bool)):
                f.attrs[k] = v
    os.replace(tmp, run / "metrics.h5")


def write_curves(run, hist: dict, title: str) -> None:
    """``run/curves.png``: training loss, and train/test accuracy, per epoch."""
    # matplotlib is imported here: it takes about a second and only the root rank plots
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ep = hist["epoch"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(ep, hist["loss"], "o-", label="train loss")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    if any(x is not None for x in hist.get("train_acc", [])):
        ax2.plot(ep, [np.nan if x is None else x for x in hist["train_acc"]], "o-", label="train")
    if any(x is not None for x in hist.get("test_acc", [])):
        ax2.plot(ep, [np.nan if x is None else x for x in hist["test_acc"]], "s-", label="test")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("accuracy")
    ax2.legend()
    ax2.grid(alpha=0.3)
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(run) / "curves.png", dpi=100)
    plt.close(fig)


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
    """Callback writing ``metrics.h5`` after every epoch and ``metrics.h5``, ``summary.json``
    and ``curves.png`` at the end of the fit, on the root rank, into ``run``.

    Args:
        run: the run directory (must exist).
        config: dict stored in ``metrics.h5`` and ``summary.json`` (JSON-serializable).
        title: title of ``curves.png``.
        extra: more ``summary.json`` entries (may be updated until the fit ends).
    """

    def __init__(self, run, config: dict | None = None, title: str = "",
                 extra: dict | None = None):
        self.run, self.config, self.title = Path(run), dict(config or {}), title
        self.extra = dict(extra or {})
        self._t0 = None

    def on_fit_start(self, trainer, plan: FitPlan) -> None:
        self._t0 = time.perf_counter()
        self.config.setdefault("parameters", plan.parameters)

    def on_epoch_end(self, trainer, record: EpochRecord) -> None:
        if trainer.is_root:
            write_metrics(self.run, trainer.history, self.config)

    def on_fit_end(self, trainer, result: FitResult) -> None:
        if not trainer.is_root:
            return
        hist = result.history
        write_metrics(self.run, hist, self.config)
        times = [t for t in hist["epoch_time"] if t is not None]
        grid = trainer.grid
        write_summary(self.run, {
            "config": self.config, "final": result.final, "epochs": hist,
            "times": {"total_s": time.perf_counter() - self._t0, "train_s": float(np.sum(times)),
                      "mean_epoch_s": float(np.mean(times)) if times else float("nan")},
            "world_size": grid.comm.Get_size(), "dp": grid.data_size, "P_L": grid.layer_size,
            "steps": result.steps, "forward_stats": result.solver_stats, **self.extra})
        write_curves(self.run, hist, self.title)
