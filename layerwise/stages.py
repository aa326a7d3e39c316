"""The stages of :class:`~layerwise.sequential.SequentialTrainer` (sequential layer-by-layer
training, Kim 2019): which modules a stage trains and on which cached depth
(:meth:`SequentialStages._select`), the replica synchronization of a stage's modules, finishing
a stage (gradients released, optimizer dropped) and restoring the layers' ``requires_grad``
flags at the end; and :class:`StageLog`, the training-loop callback that records every stage
epoch. Entering a stage (the layers below it frozen, a fresh optimizer, gradient buckets) is
``SequentialTrainer._enter`` in :mod:`layerwise.sequential`, which makes the optimizers.

A mixin: the trainer owns the state (``layers``, ``heads``, ``grow``, ``plan``, ``data_comm``,
``stage_optimizer``, ``_names``, ...); no communication here except building
:class:`~mgrit.parallel.replicas.ReplicaSync` over ``data_comm``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

from mgrit.parallel.replicas import ReplicaSync

from .common import no_nan, release_gradients

if TYPE_CHECKING:
    from .sequential import SequentialTrainer

__all__ = ["SequentialStages", "StageLog"]


class SequentialStages:
    """Stage selection, synchronization and exit of a :class:`~layerwise.sequential.SequentialTrainer`."""

    def _sync(self, modules: Sequence[nn.Module]) -> ReplicaSync:
        return ReplicaSync(modules, self.data_comm, names=[self._names[id(m)] for m in modules])

    @property
    def _replicas(self) -> int:
        return 1 if self.data_comm is None else self.data_comm.Get_size()

    def _select(self, stage) -> None:
        """The modules, input depth and learning rate of ``stage`` (no training state)."""
        L = len(self.layers)
        if stage == "head":
            mods, depth = [self.output_head], L
        elif stage == "finetune":
            mods, depth = [*self.layers, self.output_head], 0
        else:
            mods, depth = [self.layers[stage], self.heads[stage if self.grow == "top" else 0]], stage
        self._stage, self._mods, self._depth = stage, mods, depth

    def _finish(self) -> None:
        """End the stage being trained: its gradients released, its optimizer dropped."""
        if self.stage_optimizer is not None:
            self.stage_optimizer = self._buckets = self._sync_now = None
            release_gradients(self._mods)

    def _restore_flags(self) -> None:
        if self._flags is not None:
            for layer, flags in zip(self.layers, self._flags):
                for p, f in zip(layer.parameters(), flags):
                    p.requires_grad_(f)
            self._flags = None


class StageLog:
    """Trainer callback: appends every epoch's ``{"stage", "epoch", "loss", "train_acc",
    "test_acc", "test_loss", "time"}`` to ``method.history`` and calls ``method.log`` with it
    (accuracies None when the loop has none: MSE)."""

    def __init__(self, method: SequentialTrainer):
        self.method = method

    def on_epoch_end(self, trainer, rec) -> None:
        m = self.method
        entry = {"stage": m.plan[rec.epoch - 1], "epoch": rec.epoch, "loss": rec.loss,
                 "train_acc": rec.train_acc, "test_acc": no_nan(rec.test_acc),
                 "test_loss": rec.test_loss, "time": rec.epoch_time + rec.eval_time}
        m.history.append(entry)
        if m.log is not None:
            m.log(entry)
