"""A validation split evaluated after every epoch: the :class:`Validation` callback (Keras'
``validation_data``, Lightning's validation loop), for choices made on held-out training data
instead of the test data a study reports."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from .records import EpochRecord, FitPlan

if TYPE_CHECKING:  # annotations only: no import cycle with the trainer
    from .trainer import Trainer

__all__ = ["Validation", "VALIDATION_KEYS"]

#: The per-epoch series :class:`Validation` adds to ``trainer.history`` (and so to
#: ``metrics.h5``, ``metrics.csv`` and ``summary.json``'s ``epochs``).
VALIDATION_KEYS = ("val_acc", "val_loss")


class Validation:
    """Callback: after every epoch, :meth:`Trainer.evaluate` on ``data`` (forward only, eval
    mode, the same forward as the test metrics: an inexact MGRIT network evaluates with its
    fixed cycles) and the accuracy and mean loss appended to ``trainer.history`` as
    ``val_acc`` / ``val_loss`` (one entry per epoch; ``val_acc`` NaN where the metric gives
    none, e.g. a regression). Put it before :class:`~mgrit.training.MetricsWriter` in the
    callback list so the files of each epoch carry it. Collective: every rank holds the same
    ``data``. Its series are its state, so a resumed fit's files cover the epochs before the
    resume too.

    Args:
        data: ``(x, y)`` (or a :class:`data.Split`): inputs ``(n, *in_shape)``, targets
            ``(n,)`` or ``(n, context)``; the same on every rank, disjoint from the training
            and test data (the job's ``--val-fraction`` holds out the end of the training set).
        print_fn: a line per epoch on the root rank (default ``print``, flushed; None: silent).

    Raises:
        ValueError: ``data`` is empty.
    """

    def __init__(self, data: Sequence, print_fn=lambda s: print(s, flush=True)):
        if len(data[1]) == 0:
            raise ValueError("Validation(data): the validation split holds no samples")
        self.data, self.print_fn = data, print_fn
        self.series = {k: [] for k in VALIDATION_KEYS}

    def state_dict(self) -> dict:
        return {k: list(v) for k, v in self.series.items()}

    def load_state_dict(self, state: dict) -> None:
        self.series = {k: [float(x) for x in state.get(k, [])] for k in VALIDATION_KEYS}

    def on_fit_start(self, trainer: Trainer, plan: FitPlan) -> None:
        # the history is rebuilt at every fit (restored series after a resume)
        self.series = {k: v[:plan.start_epoch] for k, v in self.series.items()}
        trainer.history.update({k: list(v) for k, v in self.series.items()})

    def on_epoch_end(self, trainer: Trainer, record: EpochRecord) -> None:
        acc, loss = trainer.evaluate(self.data)
        acc = float("nan") if acc is None or not np.isfinite(acc) else float(acc)
        for k, v in zip(VALIDATION_KEYS, (acc, float(loss))):
            self.series[k].append(v)
            trainer.history.setdefault(k, []).append(v)
        if trainer.is_root and self.print_fn is not None:
            self.print_fn(f"  validation ({len(self.data[1])} samples) acc {acc:.4f} loss "
                          f"{loss:.4f}")
