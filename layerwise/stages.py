"""The stages of :class:`~layerwise.sequential.SequentialTrainer` (sequential layer-by-layer
training, Kim 2019): which modules a stage trains and on which cached depth
(:meth:`SequentialStages._select`), entering a stage (the layers below it frozen, a fresh
optimizer, gradient buckets and the replica synchronization for data parallelism) and finishing
it (gradients released, optimizer dropped), restoring the layers' ``requires_grad`` flags at the
end; and :class:`StageLog`, the training-loop callback that records every stage epoch.

A mixin: the trainer owns the state (``layers``, ``heads``, ``grow``, ``plan``, ``opt_args``,
``lr``, ``finetune_lr``, ``data_comm``, ``optimizer``, ``_cache``, ``_names``, ...); no
communication here except building :class:`~mgrit.parallel.dataparallel.GradientBuckets` and
:class:`~mgrit.parallel.replicas.ReplicaSync` over ``data_comm``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

from mgrit.parallel.dataparallel import GradientBuckets
from mgrit.parallel.replicas import ReplicaSync

from .common import make_optimizer, no_nan, release_gradients

if TYPE_CHECKING:
    from .sequential import SequentialTrainer

__all__ = ["SequentialStages", "StageLog"]


class SequentialStages:
    """Stage selection, entry and exit of a :class:`~layerwise.sequential.SequentialTrainer`."""

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

    def _enter(self, stage) -> None:
        """Start ``stage``: freeze the layers below it (original flags for fine-tuning), a
        fresh optimizer (given a resumed checkpoint's state for it), gradient buffers and the
        replica synchronization."""
        self._finish()
        if stage == "finetune":  # every layer trains again: cached features go stale
            self._cache.clear()
        if self._flags is None:
            self._flags = [[p.requires_grad for p in layer.parameters()] for layer in self.layers]
        self._select(stage)
        for k, (layer, flags) in enumerate(zip(self.layers, self._flags)):
            for p, f in zip(layer.parameters(), flags):
                p.requires_grad_(f and (stage == "finetune" or k >= self._depth))
        name, momentum, wd = self.opt_args
        params = [p for m in self._mods for p in m.parameters() if p.requires_grad]
        self.stage_optimizer = make_optimizer(name, params, self.finetune_lr if stage ==
                                              "finetune" else self.lr, momentum, wd)
        self.optimizer.adopt(self.stage_optimizer)
        if self._replicas > 1:  # persistent flat buffers; BatchNorm + buffer guard
            self._buckets = GradientBuckets(params, self.data_comm)
            self._sync_now = self._sync(self._mods)

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
