"""DGL pipelined across MPI ranks: stages x replicas on a :class:`mgrit.parallel.procgrid.ProcessGrid`.

Layer rank ``r`` of a replica owns a contiguous group of the ``K`` stages (one per rank, or
``stages_per_rank``); the stages of a replica form a pipeline along ``grid.layer_comm``. Per
global batch, layer rank 0 takes its replica's shard (chunk ``data_rank`` of
``np.array_split(batch, P_D)``), every rank runs :func:`~layerwise.decoupled.stage_step` on its
stages and sends the **detached** output and the labels to the next rank with non-blocking
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
``ValueError`` on every rank before any step (:mod:`layerwise.replicas`). So ``P_D`` replicas
equal the single-process trainer, weights and buffers, up to rounding.

Asynchronous variant: every stage but the first samples its input from a bounded replay buffer
(FIFO, ``buffer_size``) filled by whatever has arrived; runs are then timing dependent.

Every configuration check happens in ``__init__`` before any message and is a pure function
of the arguments, so bad configurations raise the same ``ValueError`` on every rank. Launch
with ``python -m mpi4py`` (or call :func:`mgrit.training.faults.fail_fast`) so an exception on
one rank aborts the job instead of leaving the neighbours blocked in a receive.
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import ExitStack
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from mgrit.parallel.dataparallel import (GradientBuckets, broadcast_parameters,
                                         check_replicas_consistent)
from mgrit.parallel.procgrid import ProcessGrid

from .common import check_int, make_optimizer, release_gradients, shard
from .decoupled import DecoupledModel, stage_step, summarize
from .replicas import ReplicaSync, refuse_unsynchronized

__all__ = ["DecoupledPipeline"]

_TAG_ACT, _TAG_LAB, _TAG_EACT, _TAG_ELAB, _TAG_EPROB = 101, 102, 201, 202, 203


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class _Recv:
    """Posted receives of one item (several tensors of ``(n, *shape)``, n unknown <= max_n)."""

    def __init__(self, comm, source, specs):
        self.specs, self.done, self.statuses = specs, False, [MPI.Status() for _ in specs]
        self.bufs, self.reqs = [], []
        for tag, dtype, shape, max_n in specs:
            nbytes = max(1, max_n * int(np.prod(shape, dtype=np.int64))
                         * torch.empty((), dtype=dtype).element_size())
            buf = np.empty(nbytes, dtype=np.uint8)
            self.bufs.append(buf)
            self.reqs.append(comm.Irecv([buf, MPI.BYTE], source=source, tag=tag))

    def test(self) -> bool:
        if not self.done:
            self.done = MPI.Request.Testall(self.reqs, self.statuses)
        return self.done

    def wait(self, stats) -> list[torch.Tensor]:
        if not self.done:
            t0 = time.perf_counter()
            MPI.Request.Waitall(self.reqs, self.statuses)
            stats["comm_wait"] += time.perf_counter() - t0
            self.done = True
        out = []
        for (tag, dtype, shape, _), buf, st in zip(self.specs, self.bufs, self.statuses):
            count = st.Get_count(MPI.BYTE)
            per = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
            if count % per:
                raise RuntimeError(f"received {count} bytes (tag {tag}), not a multiple of one "
                                   f"sample {shape} {dtype} ({per} bytes)")
            out.append(torch.from_numpy(buf[:count]).view(dtype).reshape(count // per, *shape))
        return out


class DecoupledPipeline:
    """DGL on a process grid: ``K`` stages over ``P_L`` layer ranks x ``P_D`` replicas.

    Args:
        model: the full :class:`DecoupledModel`, built identically on every rank (only this
            rank's stages are trained; replicas are made identical by a broadcast of the
            parameters and buffers from data rank 0 at set-up).
        grid: the process grid (default: a 1 x 1 grid on ``MPI.COMM_SELF``).
        stages_per_rank: if given, ``K`` must equal ``P_L * stages_per_rank``; default: any
            ``K >= P_L``, stages split as evenly as possible (earlier ranks get more).
        optimizer, lr, momentum, weight_decay: per-stage optimizer.
        asynchronous: replay-buffer variant (default False: exact pipeline).
        buffer_size: replay buffer capacity (default 16).
        max_pending: batches whose sends may be in flight before the sender waits (default 8).
        seed: seeds the replay-buffer sampling (per rank).

    Raises:
        ValueError: more layer ranks than stages; ``K != P_L * stages_per_rank``; bad optimizer
            settings; replicas with different parameter shapes; with ``P_D > 1`` a module other
            than BatchNorm whose buffers change in a training forward
            (:func:`layerwise.replicas.refuse_unsynchronized`). Raised on every rank.
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
        self.buffer_size = check_int("buffer_size", buffer_size)
        self.max_pending = check_int("max_pending", max_pending)
        self.model, self.grid, self.asynchronous = model, grid, bool(asynchronous)
        q, rem = divmod(K, P)
        r = grid.layer_rank
        start = r * q + min(r, rem)
        self.owned = list(range(start, start + q + (1 if r < rem else 0)))
        self.optimizers = {k: make_optimizer(optimizer, model.stage_parameters(k), lr, momentum,
                                             weight_decay) for k in self.owned}
        self.rng = np.random.default_rng([seed, grid.comm.Get_rank(), 7])
        self.comm_stats = {"messages": 0, "bytes_sent": 0, "comm_wait": 0.0}
        self._pending: deque = deque()
        #: per owned stage: BatchNorm synchronization and buffer guard over the replicas
        self.syncs = {k: ReplicaSync([model.bodies[k], model.heads[k]], grid.data_comm,
                                     names=[f"bodies.{k}", f"heads.{k}"]) for k in self.owned} \
            if grid.data_size > 1 else {}
        if grid.data_size > 1:
            mods = [mod for k in self.owned for mod in (model.bodies[k], model.heads[k])]
            state = [t for mod in mods for t in (*mod.parameters(), *mod.buffers())]
            check_replicas_consistent(state, grid.data_comm, what=f"stages {self.owned}")
            refuse_unsynchronized([self.syncs[k] for k in self.owned],
                                  [model.in_shapes[k] for k in self.owned], model.dtype,
                                  grid.data_comm)
            broadcast_parameters(state, grid.data_comm, root=0)

    # ---------------------------------------------------------------- messages
    @property
    def _first(self) -> bool:
        return self.grid.layer_rank == 0

    @property
    def _last(self) -> bool:
        return self.grid.layer_rank == self.grid.layer_size - 1

    def _send(self, tensors: Sequence[torch.Tensor], tags: Sequence[int]) -> None:
        comm, dest = self.grid.layer_comm, self.grid.layer_rank + 1
        group = []
        for t, tag in zip(tensors, tags):
            buf = _bytes(t)
            group.append((comm.Isend([buf, MPI.BYTE], dest=dest, tag=tag), buf))
            self.comm_stats["messages"] += 1
            self.comm_stats["bytes_sent"] += buf.nbytes
        self._pending.append(group)
        while len(self._pending) > self.max_pending:
            self._wait_group(self._pending.popleft())

    def _wait_group(self, group) -> None:
        t0 = time.perf_counter()
        MPI.Request.Waitall([req for req, _ in group])
        self.comm_stats["comm_wait"] += time.perf_counter() - t0

    def _flush(self) -> None:
        while self._pending:
            self._wait_group(self._pending.popleft())

    def _post(self, specs) -> _Recv:
        return _Recv(self.grid.layer_comm, self.grid.layer_rank - 1, specs)

    # ---------------------------------------------------------------- training
    def train_epoch(self, x: torch.Tensor | None, y: torch.Tensor | None,
                    batches: Sequence[np.ndarray]) -> dict:
        """Train one epoch on the global batches ``batches`` (the same list on every rank).

        Args:
            x, y: full training inputs ``(n, *in_shape)`` and int64 labels ``(n,)``; read only on
                layer rank 0 (other ranks may pass ``None``).
            batches: global index arrays; every replica takes its shard of each.

        Returns:
            the same metrics dict on every rank: ``loss``/``train_acc`` of the last stage and
            ``stage_loss``/``stage_train_acc`` of every stage (running averages over the epoch
            and all replicas). The owned stages' ``.grad`` are released (``None``) at the end.

        Raises:
            ValueError (on every replica, before the step): a module other than BatchNorm
                changed a buffer in its training forward while ``P_D > 1``.
        """
        m, g = self.model, self.grid
        D, d = g.data_size, g.data_rank
        nb, K = len(batches), m.num_stages
        n_local = [len(shard(b, d, D)) for b in batches]
        max_n = max(n_local, default=0)
        tot = np.zeros((K, 3))
        syncs = self.syncs
        buckets = {}  # per stage: persistent flat gradient buffers (built alike on replicas)

        def avg(k):
            if D > 1:
                syncs[k].end_step()
                if k not in buckets:
                    buckets[k] = GradientBuckets(m.stage_parameters(k), g.data_comm)
                buckets[k].average()

        specs = None if self._first else [(_TAG_ACT, m.dtype, m.in_shapes[self.owned[0]], max_n),
                                          (_TAG_LAB, torch.int64, (), max_n)]
        recv = self._post(specs) if specs and nb else None
        received = 1 if recv is not None else 0
        buffers = {k: deque(maxlen=self.buffer_size) for k in self.owned if k > 0}
        m.train()
        with ExitStack() as stack:
            for sync in syncs.values():
                stack.enter_context(sync)
            for i, b in enumerate(batches):
                if self._first:
                    idx = torch.as_tensor(shard(b, d, D))
                    xb, yb = x[idx], y[idx]
                elif not self.asynchronous:
                    xb, yb = recv.wait(self.comm_stats)
                    recv = self._post(specs) if i + 1 < nb else None
                else:  # drain what has arrived; block only when the buffer is empty
                    buf = buffers[self.owned[0]]
                    while recv is not None and (not buf or recv.test()):
                        buf.append(tuple(recv.wait(self.comm_stats)))
                        recv = self._post(specs) if received < nb else None
                        received += recv is not None
                for k in self.owned:
                    if self.asynchronous and k > 0:
                        buf = buffers[k]
                        if k != self.owned[0]:
                            buf.append((xb, yb))
                        xb, yb = buf[int(self.rng.integers(len(buf)))]
                    # a replayed item (asynchronous) stands alone: the mean over it, 0 if empty
                    gb = max(len(yb) * D, 1) if self.asynchronous and k > 0 else len(b)
                    if D > 1:
                        syncs[k].begin_step()
                    xb, loss, correct = stage_step(m, k, xb, yb, self.optimizers[k], avg,
                                                   global_batch=gb, num_replicas=D)
                    tot[k] += (loss, correct, len(yb))
                if not self._last:
                    self._send([xb, yb], [_TAG_ACT, _TAG_LAB])
        while recv is not None:  # async: consume the rest so every send is matched
            recv.wait(self.comm_stats)
            recv = self._post(specs) if received < nb else None
            received += recv is not None
        self._flush()
        release_gradients([mod for k in self.owned for mod in (m.bodies[k], m.heads[k])])
        g.comm.Allreduce(MPI.IN_PLACE, [tot, MPI.DOUBLE], op=MPI.SUM)
        return summarize(tot)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, x: torch.Tensor | None, y: torch.Tensor | None, *,
                 batch_size: int = 1024, ensemble: bool = False) -> dict:
        """Evaluate the combined network (and optionally the head ensemble) on ``x, y``.

        Every replica takes its contiguous share of the samples (``x, y`` read on layer rank 0
        only; their length is broadcast). Returns on every rank ``{"loss", "acc"}`` of the output
        head, ``stage_acc`` of every head and, if ``ensemble``, ``ensemble_acc`` (argmax of the
        summed softmax of all heads, accumulated along the pipeline).
        """
        m, g = self.model, self.grid
        check_int("batch_size", batch_size)
        K, C = m.num_stages, m.num_classes
        n = g.layer_comm.bcast(len(y) if self._first else None, root=0)
        local = shard(np.arange(n, dtype=np.int64), g.data_rank, g.data_size)
        chunks = [local[i:i + batch_size] for i in range(0, len(local), batch_size)]
        tot = np.zeros((K + 1, 3))  # rows: stages (loss_sum, correct, n), ensemble
        specs = None if self._first else [(_TAG_EACT, m.dtype, m.in_shapes[self.owned[0]], batch_size),
                                          (_TAG_ELAB, torch.int64, (), batch_size)]
        if specs and ensemble:
            specs.append((_TAG_EPROB, m.dtype, (C,), batch_size))
        mods = [mod for k in self.owned for mod in (m.bodies[k], m.heads[k])]
        modes = [mod.training for mod in mods]
        for mod in mods:
            mod.eval()
        try:
            recv = self._post(specs) if specs and chunks else None
            with torch.no_grad():
                for i, idx in enumerate(chunks):
                    if self._first:
                        t = torch.as_tensor(idx)
                        xb, yb = x[t], y[t]
                        pb = torch.zeros((len(idx), C), dtype=m.dtype)
                    else:
                        got = recv.wait(self.comm_stats)
                        xb, yb = got[0], got[1]
                        pb = got[2].clone() if ensemble else None
                        recv = self._post(specs) if i + 1 < len(chunks) else None
                    for k in self.owned:
                        xb = m.bodies[k](xb)
                        logits = m.heads[k](xb)
                        tot[k] += (float(F.cross_entropy(logits, yb, reduction="sum")),
                                   int((logits.argmax(1) == yb).sum()), len(yb))
                        if ensemble:
                            pb += F.softmax(logits, dim=1)
                    if not self._last:
                        self._send([xb, yb, pb] if ensemble else [xb, yb],
                                   [_TAG_EACT, _TAG_ELAB, _TAG_EPROB])
                    elif ensemble:
                        tot[K] += (0.0, int((pb.argmax(1) == yb).sum()), len(yb))
            self._flush()
        finally:
            for mod, t in zip(mods, modes):
                mod.train(t)
        g.comm.Allreduce(MPI.IN_PLACE, [tot, MPI.DOUBLE], op=MPI.SUM)
        cnt = np.maximum(tot[:, 2], 1)
        res = {"loss": tot[K - 1, 0] / cnt[K - 1], "acc": tot[K - 1, 1] / cnt[K - 1],
               "stage_acc": (tot[:K, 1] / cnt[:K]).tolist()}
        if ensemble:
            res["ensemble_acc"] = tot[K, 1] / cnt[K]
        return {k: (float(v) if isinstance(v, np.floating) else v) for k, v in res.items()}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict | None:
        """The full model's ``state_dict`` on world rank 0 (``None`` elsewhere): each layer rank's
        stages are gathered over ``layer_comm`` (a one-time pickled gather of numpy arrays)."""
        mine = {}
        for k in self.owned:
            for prefix, mod in ((f"bodies.{k}.", self.model.bodies[k]),
                                (f"heads.{k}.", self.model.heads[k])):
                for key, v in mod.state_dict().items():
                    mine[prefix + key] = v.detach().cpu().numpy().copy()
        parts = self.grid.layer_comm.gather(mine, root=0)
        if self.grid.comm.Get_rank() != 0:
            return None
        full = {}
        for part in parts:
            full.update({key: torch.from_numpy(v) for key, v in part.items()})
        return {key: full[key] for key in self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load a full model ``state_dict`` (e.g. from :meth:`state_dict`) on every rank."""
        self.model.load_state_dict(state)
