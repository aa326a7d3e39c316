"""The training loop: :class:`Trainer` -- one step (:meth:`Trainer.step`), evaluation,
checkpoints, and :meth:`Trainer.fit` (epochs with checkpoint/resume and callbacks, in
:mod:`mgrit.training.fit`), the same code for a
:class:`~mgrit.nn.LayerParallelNet`, a serial ``nn.Module`` and a
:class:`~mgrit.training.method.TrainingMethod` (layer-wise training: its own updates)."""
from __future__ import annotations

import contextlib
import inspect
import os
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from ..collective import agreed, rendezvous
from ..parallel import GradientBuckets, ProcessGrid, check_replicas_consistent, clip_grad_norm_
from ..parallel.replicas import (ReplicaSync, batch_statistics_in_eval, has_sync_types,
                                 share_scale)
from .callbacks import check_callbacks, restore_states, state_keys
from .checkpoint import LoadedCheckpoint, load_checkpoint, save_checkpoint
from .support.faults import phase
from .fit import FitLoop, _positive_int
from .guard import name_nonfinite
from .method import TrainingMethod
from .support.nets import as_net
from .records import StepRecord
from .schedule import as_tensors
from .support.solvers import instrument

if TYPE_CHECKING:  # annotations only
    from data import Split

__all__ = ["Trainer"]


def _zero_loss(out, target):
    """Loss of an empty shard (synchronized BatchNorm: the replica joins the backward)."""
    return out.sum() * 0.0


class Trainer(FitLoop):
    """Train ``net`` with ``optimizer`` on the ranks of ``grid``.

    One step (:meth:`step`): ``zero_grad``, forward, ``net.loss``, backward, the
    ``on_after_backward`` hooks, data-parallel gradient averaging over ``grid.data_comm``
    (:class:`~mgrit.parallel.GradientBuckets`, weighted by shard size), global-norm gradient
    clipping (``clip_grad_norm``), ``optimizer.step()``.
    :meth:`fit` is a thin loop over steps with evaluation, checkpoints and hooks.
    With replicas, BatchNorm layers use the statistics of the global batch (each replica's
    loss is then its share of the global mean loss, averaged with the plain mean) and any
    other module whose buffers change in a training forward is refused on every rank before
    its first optimizer step (:class:`~mgrit.parallel.replicas.ReplicaSync`).

    Args:
        net: a :class:`~mgrit.nn.LayerParallelNet` built on ``grid.layer_comm``, or any serial
            ``nn.Module`` (wrapped by :class:`~mgrit.training.support.nets.SerialNet`; then
            ``grid.layer_size`` must be 1). Its MGRIT solves are phase-tagged for fault reports.
            Or a :class:`~mgrit.training.method.TrainingMethod` (layer-wise training), which
            runs its own updates in place of the step above; then ``optimizer=None``.
        optimizer: the user's ``torch.optim.Optimizer`` over ``net``'s parameters on this rank.
            A learning-rate schedule is stepped once per optimizer step by the
            :class:`~mgrit.training.LRSchedule` callback (saved in checkpoints, re-planned
            when a resume changes its length or rate); a scheduler of the user's own is
            stepped in an ``on_step_end`` hook (per step) or ``on_epoch_end`` (per epoch) and
            saved by the user. On ``fit(resume=...)`` this optimizer's hyper-parameters
            (``lr``, ``momentum``, ...) replace the checkpoint's; the changes are in the
            resume notes (see ``docs/features/resume.rst``).
        grid: :class:`~mgrit.parallel.ProcessGrid` (default: one process, ``COMM_SELF``).
        loss: ``loss(output, target) -> mean loss`` (default ``F.cross_entropy``); evaluation
            calls it with ``reduction="sum"`` when it accepts that keyword. (A TrainingMethod
            trains with its own losses; this one is then only the evaluation's.)
        callbacks: objects with ``on_*`` hooks (see :mod:`mgrit.training.callbacks`).
        checkpoint: file to save to (None: no checkpoints): at the end of every epoch and
            every ``checkpoint_every`` optimizer steps (0: only per epoch).
        eval_batch_size: batch size of the test-set evaluation (default 500).
        metric: ``metric(output, target) -> score`` summed over the batch's samples (a number;
            None: no accuracy), reported divided by the number of samples as ``train_acc`` /
            ``test_acc``. Default None: correct argmax classifications of a 2-D output
            against 1-D integer labels (None for other outputs). A language model passes
            :func:`mgrit.models.lm.token_accuracy`.
        clip_grad_norm: clip the gradients to this global norm (2-norm over the whole model,
            after the data-parallel averaging) before every optimizer step, as
            ``torch.nn.utils.clip_grad_norm_`` on the serial model (see
            :func:`mgrit.parallel.clip_grad_norm_`; a per-rank call would clip each rank's
            slice by its own norm). A finite number > 0; None (default): no clipping. Not with
            a TrainingMethod (it runs its own updates).

    Attributes:
        net: the adapted network.
        method: the TrainingMethod, or None.
        optimizer: as given (with a method: its checkpoint view); also ``grid``,
            ``callbacks``, ``steps_done``.
        history: per-epoch metrics of the current fit.
        is_root: rank 0 of ``grid.comm``.
        batch: this replica's ``(x, y)`` of the latest step, for callbacks that redo the
            step's computation such as :class:`~mgrit.training.bias.BiasMonitor`; None
            before the first step.
        grad_norm: the total gradient norm before clipping of the latest step, with
            ``clip_grad_norm``; else None.

    Raises:
        TypeError: ``net`` not a module, ``optimizer`` not a ``torch.optim.Optimizer``, ``grid``
            not a ProcessGrid, ``loss`` not callable, an optimizer with a TrainingMethod.
            ValueError: a network whose layer communicator does not match the grid, bad
            callbacks or numbers. Raised on every rank before any communication.
    """

    def __init__(self, net: nn.Module, optimizer: torch.optim.Optimizer | None,
                 grid: ProcessGrid | None = None, *, loss: Callable = F.cross_entropy,
                 callbacks: Iterable | None = None, checkpoint: str | os.PathLike | None = None,
                 checkpoint_every: int = 0,
                 eval_batch_size: int = 500, metric: Callable | None = None,
                 clip_grad_norm: float | None = None):
        self.method = net if isinstance(net, TrainingMethod) else None
        self.net = as_net(net)
        if self.method is not None:
            if optimizer is not None:
                raise TypeError(f"a TrainingMethod ({type(net).__name__}) runs its own "
                                f"optimizers: pass optimizer=None")
            optimizer = self.method.optimizer  # what checkpoints save (or None)
        elif not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (build it from the "
                            f"network's parameters), got {type(optimizer).__name__}")
        self.grid = ProcessGrid(MPI.COMM_SELF) if grid is None else grid
        if not isinstance(self.grid, ProcessGrid):
            raise TypeError(f"grid must be a mgrit.parallel.ProcessGrid, got {type(grid).__name__}")
        if self.net.comm.Get_size() != self.grid.layer_size:
            raise ValueError(f"the network spans {self.net.comm.Get_size()} layer rank(s) but the "
                             f"grid has P_L={self.grid.layer_size}: build the network on "
                             f"grid.layer_comm (a serial network needs P_L = 1)")
        # replicas: BatchNorm over the global batch, other buffer-changing modules refused
        # (a TrainingMethod synchronizes its own modules)
        self._sync = ReplicaSync([self.net], self.grid.data_comm) \
            if self.grid.data_size > 1 and self.method is None else None
        self._bn = self._sync is not None and has_sync_types([self.net])
        if not callable(loss):
            raise TypeError(f"loss must be callable (output, target) -> loss, got {loss!r}")
        if checkpoint is not None and (not isinstance(checkpoint, (str, os.PathLike))
                                       or not os.fspath(checkpoint)):
            raise ValueError(f"checkpoint={checkpoint!r} is not allowed: use a file path or None")
        if clip_grad_norm is not None and (
                isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float))
                or not np.isfinite(clip_grad_norm) or clip_grad_norm <= 0):
            raise ValueError(f"clip_grad_norm={clip_grad_norm!r} is not allowed: use a finite "
                             f"number > 0 or None")
        if clip_grad_norm is not None and self.method is not None:
            raise ValueError(f"clip_grad_norm is not supported with a TrainingMethod "
                             f"({type(net).__name__} runs its own updates)")
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.grad_norm: float | None = None
        if metric is not None and not callable(metric):
            raise TypeError(f"metric must be callable (output, target) -> score, got {metric!r}")
        self.optimizer, self.loss_fn = optimizer, loss
        self._metric = self._correct if metric is None else metric
        self.callbacks = check_callbacks(callbacks)
        self.checkpoint = None if checkpoint is None else os.fspath(checkpoint)
        self.checkpoint_every = _positive_int("checkpoint_every", checkpoint_every, 0)
        self.eval_batch_size = _positive_int("eval_batch_size", eval_batch_size)
        try:
            self._sum_reduction = "reduction" in inspect.signature(loss).parameters
        except (TypeError, ValueError):  # builtins without a signature: use mean * count
            self._sum_reduction = False
        params = list(self.net.parameters())
        self._dtype = next((p.dtype for p in params if p.is_floating_point()),
                           torch.get_default_dtype())
        # batches go where the network is (data stay on the CPU; --device cuda)
        self._device = next((p.device for p in params), torch.device("cpu"))
        # data-parallel: .grad tensors become views of persistent flat buffers, laid out
        # again when parameters are frozen, unfrozen or replaced (the module is re-read)
        self.buckets = GradientBuckets(self.net, self.grid.data_comm) \
            if self.grid.data_size > 1 and self.method is None else None
        instrument(self.net)
        self.is_root = self.grid.comm.Get_rank() == 0
        self.steps_done = 0
        self.batch = None
        self.history: dict = {}
        # where fit is (0-based epoch, batch of the step in progress; None outside a fit),
        # where it last saved its checkpoint, and its plan: for reports of an interrupted fit
        self.position, self.saved_at, self.plan = None, None, None

    # -- one step ---------------------------------------------------------------------------
    def step(self, x: torch.Tensor, y: torch.Tensor, weight: float | None = None) -> StepRecord:
        """One optimizer step on this replica's batch ``(x, y)`` (``x`` on every layer rank,
        ``(batch, ...)``; ``y`` used on the last). A replica with an empty batch skips forward
        and backward (with BatchNorm: runs them on zero samples, its statistics are
        collective) and joins the averaging with weight 0.

        Args:
            weight: this replica's share of the global batch (``len(y) / global size``); None:
                computed with one tiny allreduce over the replicas (exact for any shard sizes).

        Returns:
            the :class:`StepRecord` (loss and accuracy of this replica's batch).
        """
        if self.grid.data_size > 1 and weight is None:
            total = self.grid.data_comm.allreduce(len(y))
            weight = len(y) / total if total else 0.0
        return self._step(x, y, weight, None, None)

    def _step(self, x, y, weight, epoch, batch) -> StepRecord:
        n = len(y)
        self.batch = (x, y)
        rec = StepRecord(step=self.steps_done, epoch=epoch, batch=batch, samples=n,
                         weight=1.0 if weight is None else float(weight))
        if self.method is not None:  # the method runs its own updates (layer-wise training)
            rec.loss, rec.correct = self.method.train_step(
                x, y, rec.weight, lambda: self._call("on_after_backward", rec))
            self.steps_done += 1
            self._call("on_step_end", rec)
            return rec
        if self.buckets is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.buckets.zero_grad()
        out = loss = None
        if n or self._bn:  # synchronized BatchNorm: an empty shard joins its collectives
            out, loss = self._forward_backward(x, y, rec.weight)
            rec.solves = self.net.solver_results() if n else []
        elif self._sync is not None:  # an empty shard joins the replicas' buffer verdict
            self._sync.begin_step()
            self._sync.end_step()
        self._call("on_after_backward", rec)
        with phase("gradient averaging"):
            if self.buckets is not None:  # BatchNorm: the loss is the share, plain mean
                self.buckets.average(weight=None if self._bn else rec.weight)
        if self.clip_grad_norm is not None:  # global norm: layer ranks, after the averaging
            self.grad_norm = float(clip_grad_norm_(self.net, self.clip_grad_norm,
                                                   self.grid.layer_comm,
                                                   replicated=self.net.replicated_parameters(),
                                                   counted_elsewhere=self.net.tied_duplicates()))
        rec.lr = _first_lr(self.optimizer)
        self.optimizer.step()
        self.steps_done += 1
        if n:
            stats = None
            if self.net.is_last:
                with torch.no_grad():
                    stats = [loss.item(), self._metric(out, y)]
            rec.loss, rec.correct = self.net.from_last(stats)
        self._call("on_step_end", rec)
        return rec

    def _forward_backward(self, x, y, weight=1.0):
        which, n, sync = "forward", len(y), self._sync
        try:
            with sync if sync is not None else contextlib.nullcontext():
                if sync is not None:
                    sync.begin_step()
                out = self.net(x)
                loss = self.net.loss(out, y, self.loss_fn if n else _zero_loss)
                which = "backward"
                scale = share_scale(n, round(n / weight) if n else 0, self.grid.data_size) \
                    if self._bn else 1.0
                (loss if scale == 1.0 else loss * scale).backward()
                if sync is not None:  # the same error on every replica, before the step
                    sync.end_step()
        except FloatingPointError as exc:
            named = name_nonfinite(self.net, which, self.steps_done, exc)
            if named is None:
                raise
            with phase("forward relaxation" if which == "forward" else "adjoint"):
                raise agreed(named) from exc  # named on every rank (collective check)
        return out, loss

    @staticmethod
    def _correct(out, y) -> int | None:
        if out.dim() != 2 or y.dim() != 1 or y.is_floating_point():
            return None
        return (out.argmax(1) == y).sum().item()

    def _call(self, hook: str, record) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, record)

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self, data: Split | Sequence[np.ndarray | torch.Tensor]) -> tuple:
        """``(accuracy, mean loss)`` on ``data`` (a Split or ``(x, y)``), forward only, in eval
        mode, in chunks of ``eval_batch_size`` as on one process; the replicas split the
        samples (all of them evaluate every chunk when a BatchNorm normalizes with batch
        statistics in evaluation, ``track_running_stats=False``). Collective over the grid: ranks that do not call
        it within :func:`~mgrit.collective.collective_timeout` are named
        (:class:`~mgrit.collective.CollectiveTimeout`, which ends the job)."""
        x, y = as_tensors(data, self._dtype, "test")
        return self._evaluate(x, y)

    def _evaluate(self, x, y) -> tuple:
        with phase("evaluation"):  # every rank, or the missing ones named after the deadline
            rendezvous(self.grid.comm, "evaluation")
        # batch statistics in evaluation (BatchNorm without running statistics): every replica
        # evaluates every chunk, as one process does, instead of its shard's
        whole = self.grid.data_size > 1 and batch_statistics_in_eval([self.net])
        idx = np.arange(len(y)) if whole else \
            np.array_split(np.arange(len(y)), self.grid.data_size)[self.grid.data_rank]
        tot = np.zeros(3)
        was_training = self.net.training
        self.net.eval()
        with torch.no_grad(), phase("evaluation"):
            if self.method is not None:  # e.g. the cached features of frozen layers
                x = self.method.inputs(x)
            for s in range(0, len(idx), self.eval_batch_size):
                j = torch.as_tensor(idx[s:s + self.eval_batch_size])
                out = self.net(x[j].to(self._device))
                if self.net.is_last:
                    yj = y[j].to(self._device)
                    lsum = (self.loss_fn(out, yj, reduction="sum").item() if self._sum_reduction
                            else self.loss_fn(out, yj).item() * len(yj))
                    correct = self._metric(out, yj)
                    tot += [lsum, np.nan if correct is None else correct, len(yj)]
        self.net.train(was_training)
        tot = np.asarray(self.net.from_last(tot))
        if not whole:
            tot = self.grid.data_comm.allreduce(tot)
        return float(tot[1] / max(tot[2], 1)), float(tot[0] / max(tot[2], 1))

    # -- checkpoints ------------------------------------------------------------------------
    def _callback_states(self) -> dict:
        return {key: cb.state_dict() for cb, key in zip(self.callbacks, state_keys(self.callbacks))
                if key is not None}

    def save(self, path: str | os.PathLike, extra: dict | None = None) -> None:
        """Save network, optimizer, RNG states, callback states and ``extra`` to ``path``
        (collective; see :func:`mgrit.training.checkpoint.save_checkpoint`). With replicas,
        their parameters are first compared bit for bit (the checkpoint keeps replica 0's):
        replicas that drifted apart raise ValueError on every rank instead."""
        if self.grid.data_size > 1 and self.method is None:
            check_replicas_consistent(self.net.parameters(), self.grid.data_comm,
                                      what="data-parallel model (drifted before a checkpoint)",
                                      check_values=True)
        save_checkpoint(path, self.net, self.optimizer, self.grid,
                        extra={"steps": self.steps_done, **(extra or {})},
                        rank_extra={"callbacks": self._callback_states()})

    def load(self, path: str | os.PathLike, expect: dict | None = None) -> LoadedCheckpoint:
        """Load a checkpoint of :meth:`save` (any grid); restores callback states (by their
        stable keys, :func:`~mgrit.training.callbacks.state_keys`) and the step count. Returns
        the :class:`~mgrit.training.checkpoint.LoadedCheckpoint`; its ``notes`` name the
        callback states that were not restored."""
        loaded = load_checkpoint(path, self.net, self.optimizer, self.grid, expect=expect)
        loaded.notes.extend(restore_states(self.callbacks,
                                           loaded.rank_extra.get("callbacks", {})))
        self.steps_done = int(loaded.extra.get("steps", 0))
        return loaded


def _first_lr(optimizer) -> float | None:
    """The learning rate of ``optimizer``'s first parameter group (None if it has none or it
    is not a number, e.g. a tensor-valued lr is read as its float)."""
    groups = getattr(optimizer, "param_groups", None)
    lr = groups[0].get("lr") if groups else None
    try:
        return None if lr is None else float(lr)
    except (TypeError, ValueError):
        return None
