"""DGL pipelined across MPI ranks: stages x replicas on a :class:`mgrit.parallel.procgrid.ProcessGrid`.

Layer rank ``r`` of a replica owns a contiguous group of the ``K`` stages (one per rank, or
``stages_per_rank``); the stages of a replica form a pipeline along ``grid.layer_comm``. Per
global batch, layer rank 0 takes its replica's shard (chunk ``data_rank`` of
``np.array_split(batch, P_D)``), every rank runs :func:`~layerwise.decoupled.stage_step` on its
stages and sends the **detached** output and the targets (int64 labels, or float targets
``(n, D)`` in the model's dtype with ``loss="mse"``) to the next rank with non-blocking
``Isend`` of the tensors' raw bytes (mpi4py buffer API, no pickling; float64 stays float64).
Receives are posted one batch ahead, so rank ``r`` computes batch ``i`` while rank ``r - 1``
computes batch ``i + 1``. Because DGL has no backward dependency between stages, the updates are
exactly those of :class:`~layerwise.decoupled.DecoupledTrainer` with the same batch order; with
``P_D > 1`` each stage's gradients (body + head) are averaged over ``grid.data_comm`` before its
step (each replica's loss is its share of the global mean loss,
:func:`~layerwise.common.shard_loss`), which equals the global-batch gradient up to rounding,
for every batch size: a replica whose shard of a batch is empty (the batch has fewer samples
than replicas) runs the stage on zero samples and contributes zero. BatchNorm layers use the
statistics of the global batch and update their running statistics identically on every
replica; any other module whose buffers change in a training forward is refused with a
``ValueError`` on every rank before any step (:mod:`mgrit.parallel.replicas`). So ``P_D`` replicas
equal the single-process trainer, weights and buffers, up to rounding.

Asynchronous variant: every stage but the first samples its input from a bounded replay buffer
(FIFO, ``buffer_size``) filled by whatever has arrived; runs are then timing dependent.

The pipeline is a :class:`~mgrit.training.method.TrainingMethod`: ``Trainer(pipeline, None,
grid).fit(...)`` runs it in the library's training loop (epochs, evaluation, metrics,
checkpoints), one :meth:`DecoupledPipeline.train_step` per global batch; evaluation forwards
chunks along the pipeline (:meth:`DecoupledPipeline.forward`). Without the Trainer:
:meth:`~DecoupledPipeline.train_epoch` (or ``begin_epoch`` / ``train_batch`` / ``end_epoch``)
and :meth:`~DecoupledPipeline.evaluate` (with the head ensemble). Checkpoints hold this rank's
stages under the keys of the whole :class:`~layerwise.decoupled.DecoupledModel` (a checkpoint
loads on another grid) and every stage's optimizer state; the asynchronous variant's replay
buffers are not saved (that variant is timing dependent anyway).

Every configuration check happens in ``__init__`` before any message and is a pure function
of the arguments, so bad configurations raise the same ``ValueError`` on every rank. Launch
with ``python -m mpi4py`` (or call :func:`mgrit.training.support.faults.fail_fast`) so an exception on
one rank aborts the job instead of leaving the neighbours blocked in a receive.
"""
from __future__ import annotations

from collections import deque
from contextlib import ExitStack
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from mgrit.parallel.dataparallel import (GradientBuckets, broadcast_parameters,
                                         check_replicas_consistent)
from mgrit.comm import raise_agreed
from mgrit.parallel.procgrid import ProcessGrid
from mgrit.parallel.replicas import ReplicaSync, refuse_unsynchronized
from mgrit.training.support.faults import phase
from mgrit.training.method import MethodOptimizer, TrainingMethod

from .common import (check_int, check_targets, eval_loss, make_optimizer, release_gradients,
                     shard)
from .decoupled import DecoupledModel, stage_step, summarize
from .messages import PostedRecv, Sender, recv_tensor, send_tensor
from .pipeline_eval import evaluate_pipeline

__all__ = ["DecoupledPipeline"]

_TAG_ACT, _TAG_LAB, _TAG_FWD = 101, 102, 301  # (evaluation: 201-203, pipeline_eval)


class DecoupledPipeline(TrainingMethod):
    """DGL on a process grid: ``K`` stages over ``P_L`` layer ranks x ``P_D`` replicas.

    Args:
        model: the full :class:`DecoupledModel`, built identically on every rank (its ``loss``
            is every stage's local loss; only this
            rank's stages are trained and registered as this module's ``bodies``/``heads``;
            replicas are made identical by a broadcast of the parameters and buffers from data
            rank 0 at set-up).
        grid: the process grid (default: a 1 x 1 grid on ``MPI.COMM_SELF``).
        stages_per_rank: if given, ``K`` must equal ``P_L * stages_per_rank``; default: any
            ``K >= P_L``, stages split as evenly as possible (earlier ranks get more).
        optimizer, lr, momentum, weight_decay: per-stage optimizer.
        asynchronous: replay-buffer variant (default False: exact pipeline).
        buffer_size: replay buffer capacity (default 16).
        max_pending: batches whose sends may be in flight before the sender waits (default 8).
        seed: seeds the replay-buffer sampling (per rank).

    Attributes:
        model: the full model (also ``grid``).
        owned: this rank's stage indices.
        optimizers: an optimizer per owned stage.
        optimizer: :class:`~mgrit.training.method.MethodOptimizer` over them, for checkpoints.
        loss_function: the per-sample loss ``fn(out, y, reduction)`` of the model's loss for
            the Trainer's evaluation: ``Trainer(pipe, None, grid, loss=pipe.loss_function)``.
        comm_stats: message counters.
        epoch_metrics: per-stage metrics of the latest epoch (see :meth:`end_epoch`).

    Raises:
        ValueError: more layer ranks than stages; ``K != P_L * stages_per_rank``; bad optimizer
            settings; replicas with different parameter shapes; with ``P_D > 1`` a module other
            than BatchNorm whose buffers change in a training forward
            (:func:`mgrit.parallel.replicas.refuse_unsynchronized`). Raised on every rank.
    """

    def __init__(self, model: DecoupledModel, grid: ProcessGrid | None = None, *,
                 stages_per_rank: int | None = None, optimizer: str = "sgd", lr: float = 0.05,
                 momentum: float = 0.9, weight_decay: float = 0.0, asynchronous: bool = False,
                 buffer_size: int = 16, max_pending: int = 8, seed: int = 0):
        grid = ProcessGrid(MPI.COMM_SELF) if grid is None else grid
        K, P = model.num_stages, grid.layer_size
        if stages_per_rank is not None:
            spr = check_int("stages_per_rank", stages_per_rank)
            if P * spr != K:
                raise ValueError(f"{K} stages do not fit {P} layer ranks x {spr} stage(s) per rank: "
                                 f"need {K // spr if K % spr == 0 else 'a divisor of the stages'} "
                                 f"layer ranks, i.e. world size = stages / stages_per_rank x "
                                 f"replicas ({grid.data_size})")
        if P > K:
            raise ValueError(f"{P} layer ranks but only {K} stages: use at most {K} layer ranks "
                             f"(world size = layer ranks x replicas = {K} x {grid.data_size})")
        super().__init__(grid.layer_comm)
        self.buffer_size = check_int("buffer_size", buffer_size)
        self.max_pending = check_int("max_pending", max_pending)
        # the full model is not a submodule: this module's state is this rank's stages only
        self.__dict__["model"] = model
        self.grid, self.asynchronous = grid, bool(asynchronous)
        q, rem = divmod(K, P)
        r = grid.layer_rank
        start = r * q + min(r, rem)
        self.owned = list(range(start, start + q + (1 if r < rem else 0)))
        self.bodies = nn.ModuleDict({str(k): model.bodies[k] for k in self.owned})
        self.heads = nn.ModuleDict({str(k): model.heads[k] for k in self.owned})
        self.optimizers = {k: make_optimizer(optimizer, model.stage_parameters(k), lr, momentum,
                                             weight_decay) for k in self.owned}
        self.optimizer = MethodOptimizer(
            [p for k in self.owned for p in model.stage_parameters(k)],
            lambda: [self.optimizers[k] for k in self.owned])
        self.rng = np.random.default_rng([seed, grid.comm.Get_rank(), 7])
        self.loss_function = eval_loss(model.loss)
        self.comm_stats = {"messages": 0, "bytes_sent": 0, "comm_wait": 0.0}
        self._sender = None if self._last else Sender(
            grid.layer_comm, grid.layer_rank + 1, self.max_pending, self.comm_stats)
        self._buckets: dict = {}  # per stage: persistent flat gradient buffers
        self._epoch = None  # state of the epoch in progress (begin_epoch .. end_epoch)
        self.epoch_metrics: dict | None = None
        #: per owned stage: BatchNorm synchronization and buffer guard over the replicas
        self.syncs = {k: ReplicaSync([model.bodies[k], model.heads[k]], grid.data_comm,
                                     names=[f"bodies.{k}", f"heads.{k}"]) for k in self.owned} \
            if grid.data_size > 1 else {}
        if grid.data_size > 1:
            state = [t for mod in self._modules_owned()
                     for t in (*mod.parameters(), *mod.buffers())]
            check_replicas_consistent(state, grid.data_comm, what=f"stages {self.owned}")
            refuse_unsynchronized([self.syncs[k] for k in self.owned],
                                  [model.in_shapes[k] for k in self.owned], model.dtype,
                                  grid.data_comm)
            broadcast_parameters(state, grid.data_comm, root=0)

    def _modules_owned(self) -> list:
        return [mod for k in self.owned for mod in (self.model.bodies[k], self.model.heads[k])]

    # ---------------------------------------------------------------- messages
    @property
    def _first(self) -> bool:
        return self.grid.layer_rank == 0

    @property
    def _last(self) -> bool:
        return self.grid.layer_rank == self.grid.layer_size - 1

    def _post(self, specs) -> PostedRecv:
        return PostedRecv(self.grid.layer_comm, self.grid.layer_rank - 1, specs)

    def _target_spec(self) -> tuple:
        """``(dtype, per-sample shape)`` of the targets sent along the pipeline."""
        m = self.model
        return (m.dtype, (m.num_classes,)) if m.loss == "mse" else (torch.int64, ())

    def _targets(self, y: torch.Tensor | None) -> torch.Tensor | None:
        """``y`` checked against the model's loss, float targets in the model's dtype."""
        if y is None:
            return None
        m = self.model
        check_targets(y, m.loss, m.num_classes)
        return y.to(m.dtype) if m.loss == "mse" else y

    def _agreed_targets(self, y: torch.Tensor | None) -> torch.Tensor | None:
        """:meth:`_targets` of ``y`` given on some ranks only (layer rank 0): the same
        ``ValueError`` on every rank of the grid (one small ``allgather``)."""
        err = None
        try:
            y = self._targets(y)
        except ValueError as exc:
            err = str(exc)
        raise_agreed(self.grid.comm, err)
        return y

    # ---------------------------------------------------------------- training
    def begin_epoch(self, epoch: int = 0, epochs: int = 1, shards: Sequence[int] = ()) -> None:
        """Start an epoch of ``len(shards)`` batches whose shards on this replica hold
        ``shards[i]`` samples (receives are posted one batch ahead with buffers of the
        largest shard). ``epoch``/``epochs`` are not used (the Trainer's hook signature)."""
        m = self.model
        specs = None if self._first else [
            (_TAG_ACT, m.dtype, m.in_shapes[self.owned[0]], max(shards, default=0)),
            (_TAG_LAB, *self._target_spec(), max(shards, default=0))]
        recv = self._post(specs) if specs and len(shards) else None
        self._epoch = {"nb": len(shards), "i": 0, "specs": specs, "recv": recv,
                       "received": 1 if recv is not None else 0,
                       "tot": np.zeros((m.num_stages, 3)),
                       "replay": {k: deque(maxlen=self.buffer_size) for k in self.owned if k > 0}}
        self.model.train()

    def _next_received(self):
        """Rank > 0: the next item from the previous rank (asynchronous: from the replay buffer,
        draining what has arrived and blocking only when it is empty)."""
        ep = self._epoch
        if not self.asynchronous:
            xb, yb = ep["recv"].wait(self.comm_stats)
            ep["recv"] = self._post(ep["specs"]) if ep["i"] + 1 < ep["nb"] else None
            return xb, yb
        buf = ep["replay"][self.owned[0]]
        while ep["recv"] is not None and (not buf or ep["recv"].test()):
            buf.append(tuple(ep["recv"].wait(self.comm_stats)))
            ep["recv"] = self._post(ep["specs"]) if ep["received"] < ep["nb"] else None
            ep["received"] += ep["recv"] is not None
        return None, None

    def train_batch(self, x: torch.Tensor | None, y: torch.Tensor | None, global_batch: int,
                    after_backward: Callable[[], None] | None = None) -> list[tuple]:
        """One DGL update of every owned stage on this replica's shard of a global batch of
        ``global_batch`` samples (``x``, ``y``: the shard, read on layer rank 0 only; the
        other ranks receive their input; ``y`` float targets are cast to the model's dtype).
        Between :meth:`begin_epoch` and :meth:`end_epoch`.

        Returns:
            per owned stage ``(mean loss, correct, n)`` of the samples it trained on
            (``correct`` None for MSE).
        """
        ep, m, g = self._epoch, self.model, self.grid
        if ep is None or ep["i"] >= ep["nb"]:
            raise RuntimeError("train_batch outside begin_epoch(shards) .. end_epoch(), or more "
                               "batches than announced")
        D = g.data_size
        if self._first and m.loss == "mse" and y is not None:
            y = y.to(m.dtype)  # the receivers expect the model's dtype
        xb, yb = (x, y) if self._first else self._next_received()
        stats = []

        def avg(k):
            if after_backward is not None:
                after_backward()
            if D > 1:
                self.syncs[k].end_step()
                if k not in self._buckets:  # built alike on every replica
                    self._buckets[k] = GradientBuckets(m.stage_parameters(k), g.data_comm)
                with phase("gradient averaging"):
                    self._buckets[k].average()

        with ExitStack() as stack:
            for sync in self.syncs.values():
                stack.enter_context(sync)
            for k in self.owned:
                if self.asynchronous and k > 0:
                    buf = ep["replay"][k]
                    if k != self.owned[0]:
                        buf.append((xb, yb))
                    xb, yb = buf[int(self.rng.integers(len(buf)))]
                # a replayed item (asynchronous) stands alone: the mean over it, 0 if empty
                gb = max(len(yb) * D, 1) if self.asynchronous and k > 0 else global_batch
                if D > 1:
                    self.syncs[k].begin_step()
                xb, loss, correct = stage_step(m, k, xb, yb, self.optimizers[k], avg,
                                               global_batch=gb, num_replicas=D)
                ep["tot"][k] += (loss * len(yb), np.nan if correct is None else correct,
                                 len(yb))
                stats.append((loss, correct, len(yb)))
        if not self._last:
            self._sender.send([xb, yb], [_TAG_ACT, _TAG_LAB])
        ep["i"] += 1
        return stats

    def end_epoch(self) -> dict:
        """Finish the epoch: consume what is still in flight, release the owned stages'
        gradients, and sum the per-stage totals over the grid (one ``Allreduce``).

        Returns (and keeps as :attr:`epoch_metrics`) the same dict on every rank:
        ``loss``/``train_acc`` of the last stage and ``stage_loss``/``stage_train_acc`` of
        every stage (averages over the epoch and all replicas)."""
        ep = self._epoch
        while ep["recv"] is not None:  # async: consume the rest so every send is matched
            ep["recv"].wait(self.comm_stats)
            ep["recv"] = self._post(ep["specs"]) if ep["received"] < ep["nb"] else None
            ep["received"] += ep["recv"] is not None
        if self._sender is not None:
            self._sender.flush()
        release_gradients(self._modules_owned())
        tot = ep["tot"]
        self.grid.comm.Allreduce(MPI.IN_PLACE, [tot, MPI.DOUBLE], op=MPI.SUM)
        self._epoch = None
        self.epoch_metrics = summarize(tot)
        return self.epoch_metrics

    def train_epoch(self, x: torch.Tensor | None, y: torch.Tensor | None,
                    batches: Sequence[np.ndarray]) -> dict:
        """Train one epoch on the global batches ``batches`` (the same list on every rank).

        Args:
            x, y: full training inputs ``(n, *in_shape)`` and targets (int64 labels ``(n,)``,
                or float ``(n, D)`` with ``loss="mse"``); read only on layer rank 0 (other ranks
                may pass ``None``).
            batches: global index arrays; every replica takes its shard of each.

        Returns:
            the :meth:`end_epoch` metrics. The owned stages' ``.grad`` are released at the end.

        Raises:
            ValueError (on every rank, before any message): targets of the wrong dtype or
                shape for the model's loss (checked on layer rank 0, agreed over the grid).
                (On every replica, before the step): a module other than BatchNorm changed a
                buffer in its training forward while ``P_D > 1``.
        """
        y = self._agreed_targets(y if self._first else None)
        D, d = self.grid.data_size, self.grid.data_rank
        mine = [shard(b, d, D) for b in batches]
        self.begin_epoch(shards=[len(i) for i in mine])
        for b, idx in zip(batches, mine):
            if self._first:
                t = torch.as_tensor(idx)
                self.train_batch(x[t], y[t], len(b))
            else:
                self.train_batch(None, None, len(b))
        return self.end_epoch()

    # ---------------------------------------------------------------- the Trainer's hooks
    def train_step(self, x: torch.Tensor, y: torch.Tensor, weight: float,
                   after_backward: Callable[[], None]) -> tuple:
        """:meth:`train_batch` for :class:`~mgrit.training.Trainer` (global batch size
        ``len(y) / weight``). Returns the last stage's ``(mean loss, correct)`` on the last
        layer rank (asynchronous: of the replayed item, scaled to ``len(y)`` samples;
        ``correct`` None for MSE), ``(None, None)`` elsewhere and for an empty shard.

        Raises:
            ValueError: ``y`` not targets of the model's loss (the loop gives every rank the
                same targets: the same error everywhere, before any message)."""
        y = self._targets(y)
        n = len(y)
        stats = self.train_batch(x, y, round(n / weight) if n else 1, after_backward)
        if not self._last or not n or not stats[-1][2]:
            return None, None
        loss, correct, got = stats[-1]
        return (loss, correct) if got == n or correct is None else (loss, correct * n / got)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Evaluation: the combined network's logits ``(len(x), C)`` of a chunk ``x`` (given
        on every rank; read on layer rank 0, the others receive their stages' input) on the
        last layer rank, None elsewhere. Blocking messages; no graph is kept."""
        m, g = self.model, self.grid
        h = x if self._first else recv_tensor(
            g.layer_comm, (len(x), *m.in_shapes[self.owned[0]]), m.dtype, g.layer_rank - 1,
            _TAG_FWD)
        for k in self.owned:
            h = m.bodies[k](h)
        if not self._last:
            send_tensor(g.layer_comm, h, g.layer_rank + 1, _TAG_FWD)
            return None
        return m.heads[self.owned[-1]](h)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, x: torch.Tensor | None, y: torch.Tensor | None, *,
                 batch_size: int = 1024, ensemble: bool = False) -> dict:
        """Evaluate the combined network (and optionally the head ensemble) on ``x, y``
        (read on layer rank 0 only): :func:`layerwise.pipeline_eval.evaluate_pipeline`.
        Returns on every rank ``{"loss", "acc"}`` of the output head (``acc`` None for MSE),
        ``stage_loss``/``stage_acc`` of every head and, if ``ensemble``, ``ensemble_acc``
        (and ``ensemble_loss`` for MSE). Collective over the grid."""
        return evaluate_pipeline(self, x, y, batch_size=batch_size, ensemble=ensemble)

    # ---------------------------------------------------------------- state
    def full_state_dict(self) -> dict | None:
        """The full model's ``state_dict`` on world rank 0 (``None`` elsewhere): each layer rank's
        stages are gathered over ``layer_comm`` (a one-time pickled gather of numpy arrays).
        (``state_dict()`` is this rank's stages, under the same keys.)"""
        mine = {key: v.detach().cpu().numpy().copy() for key, v in self.state_dict().items()}
        parts = self.grid.layer_comm.gather(mine, root=0)
        if self.grid.comm.Get_rank() != 0:
            return None
        full = {}
        for part in parts:
            full.update({key: torch.from_numpy(v) for key, v in part.items()})
        return {key: full[key] for key in self.model.state_dict()}

    def load_full_state_dict(self, state: dict) -> None:
        """Load a full model ``state_dict`` (e.g. from :meth:`full_state_dict`) on every rank."""
        self.model.load_state_dict(state)
