"""Module state across data-parallel replicas: BatchNorm statistics over the global batch, and
a guard that refuses every other module whose buffers change in a training forward. Used by
both training families: :class:`mgrit.training.Trainer` (end-to-end, serial and
layer-parallel networks) and :mod:`layerwise` (sequential and decoupled training). Why, and
how the statistics are combined: ``docs/features/dataparallel.rst``.

:class:`ReplicaSync` (a context manager around the training steps of one set of modules):

* **Synchronized types** (:data:`SYNC_TYPES`: every ``torch.nn.modules.batchnorm._BatchNorm``,
  i.e. ``BatchNorm1d/2d/3d``, their ``Lazy`` variants and ``SyncBatchNorm``): in training mode
  their forward is replaced, while the context is active, by :func:`sync_batch_norm`, which
  has ``torch.nn.SyncBatchNorm``'s semantics on the given MPI communicator (PyTorch's own
  needs ``torch.distributed``): the batch mean and biased variance are those of the **global**
  batch, bitwise the same on every replica; the running statistics are updated from them
  exactly as ``torch.nn.BatchNorm`` does; backward sums the gradients of the mean and variance
  over the replicas (one ``Allgather`` per layer in forward and one in backward). In eval
  mode the module's own forward runs (running statistics; no communication). A replica with an empty shard takes part with count 0. Fewer
  than 2 values per channel over the global batch raise ``ValueError`` on every replica, like
  ``torch.nn.BatchNorm``.
* **Every other module** is guarded: at set-up, :func:`refuse_unsynchronized` runs each
  stage once in training mode on zeros (all state restored) and raises the same
  ``ValueError`` on every replica, before any training step, if a buffer of a module of
  another type was modified in place (``Tensor._version``), replaced or added (e.g.
  ``InstanceNorm`` with ``track_running_stats=True``, a step counter, a quantization
  observer); during training :meth:`ReplicaSync.end_step` repeats the check after every
  backward, before the gradients are averaged and the optimizer steps (for changes that
  depend on the data); one 1-int ``Allreduce`` per step agrees on the verdict.

Gradient scale: the backward of the statistics sums each replica's gradient contributions, so
the replica losses must be shares of one global loss (the shard's summed loss over the global
batch size, scaled by ``R`` when the gradients are then averaged with the plain mean; a
shard's mean loss times :func:`share_scale`). Then ``R`` replicas give the single-process
gradient of the global mean loss up to rounding, with and without BatchNorm.

Use::

    with ReplicaSync(modules, grid.data_comm) as sync:
        for batch in batches:
            sync.begin_step()
            loss = loss_fn(net(x_shard), y_shard) * share_scale(len(y_shard), len(batch), R)
            loss.backward()
            sync.end_step()                  # refuses unsynchronized buffer changes
            buckets.average()                # mean over replicas
            optimizer.step()
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mgrit.comm import raise_agreed
from mgrit.nn.steps.batchnorm import normalize, register_replicas, release_replicas

__all__ = ["SYNC_TYPES", "ReplicaSync", "refuse_unsynchronized", "sync_batch_norm",
           "global_moments", "has_sync_types", "share_scale", "batch_statistics_in_eval"]

#: Module types whose buffer updates :class:`ReplicaSync` synchronizes (all BatchNorm kinds).
SYNC_TYPES = (_BatchNorm,)
_MISSING = object()


def share_scale(n_local: int, global_batch: int, replicas: int) -> float:
    """Factor that turns a shard's **mean** loss into its share of the global mean loss for
    gradients averaged with the plain mean over ``replicas``: ``n_local * replicas /
    global_batch``; exactly 1.0 when every replica holds ``global_batch / replicas`` samples
    (then the mean loss is used as it is), 0.0 for an empty shard."""
    if n_local * replicas == global_batch:
        return 1.0
    return n_local * replicas / global_batch if global_batch else 0.0


def has_sync_types(modules: Sequence[nn.Module]) -> bool:
    """Whether any of ``modules`` (recursively) is of a :data:`SYNC_TYPES` type."""
    return any(isinstance(m, SYNC_TYPES) for top in modules for m in top.modules())


def batch_statistics_in_eval(modules: Sequence[nn.Module]) -> bool:
    """Whether any of ``modules`` (recursively) normalizes with the statistics of its batch in
    evaluation mode too (a BatchNorm with ``track_running_stats=False``): its evaluation
    output depends on how the samples are split into batches."""
    return any(isinstance(m, _BatchNorm) and m.running_mean is None
               for top in modules for m in top.modules())


def _allgather_rows(comm: MPI.Comm, row: np.ndarray) -> np.ndarray:
    """``(size, len(row))`` float64 array of every rank's ``row`` (one ``Allgather``)."""
    out = np.empty((comm.Get_size(), row.size), dtype=np.float64)
    comm.Allgather([np.ascontiguousarray(row, dtype=np.float64), MPI.DOUBLE], [out, MPI.DOUBLE])
    return out


class _GlobalMoments(torch.autograd.Function):
    """Per-channel mean and biased variance of ``x`` over ``dims`` and every rank of ``comm``."""

    @staticmethod
    def forward(ctx, x, comm, dims):
        C = x.shape[1]
        n = x.numel() // C if C else 0
        xd = x.detach().to(torch.float64)
        if n:
            shape = [1] * x.dim()
            shape[1] = C
            mean_l = xd.mean(dims)
            m2_l = ((xd - mean_l.view(shape)) ** 2).sum(dims)
        else:
            mean_l = m2_l = torch.zeros(C, dtype=torch.float64, device=x.device)
        rows = _allgather_rows(comm, np.concatenate([[n], mean_l.cpu().numpy(), m2_l.cpu().numpy()]))
        N, mean, m2 = 0.0, np.zeros(C), np.zeros(C)
        for row in rows:  # Chan-Golub-LeVeque pairwise combination, in rank order
            k = row[0]
            if k == 0:
                continue
            delta = row[1:C + 1] - mean
            total = N + k
            mean = mean + delta * (k / total)
            m2 = m2 + row[C + 1:] + delta ** 2 * (N * k / total)
            N = total
        var = m2 / N if N else np.full(C, np.nan)
        mean_t = torch.as_tensor(mean, dtype=x.dtype, device=x.device)
        var_t = torch.as_tensor(var, dtype=x.dtype, device=x.device)
        count = torch.tensor(N, dtype=x.dtype, device=x.device)
        ctx.save_for_backward(x, mean_t)
        ctx.comm, ctx.dims, ctx.N = comm, dims, N
        ctx.mark_non_differentiable(count)
        return mean_t, var_t, count

    @staticmethod
    def backward(ctx, g_mean, g_var, _g_count):
        x, mean = ctx.saved_tensors
        C = x.shape[1]
        local = np.zeros(2 * C)
        if g_mean is not None:
            local[:C] = g_mean.detach().double().cpu().numpy()
        if g_var is not None:
            local[C:] = g_var.detach().double().cpu().numpy()
        total = _allgather_rows(ctx.comm, local).sum(axis=0)  # same rows, same sum on every rank
        shape = [1] * x.dim()
        shape[1] = C
        gm = torch.as_tensor(total[:C] / ctx.N, dtype=x.dtype, device=x.device).view(shape)
        gv = torch.as_tensor(2.0 * total[C:] / ctx.N, dtype=x.dtype, device=x.device).view(shape)
        return gm + gv * (x - mean.view(shape)), None, None


def global_moments(x: torch.Tensor, comm: MPI.Comm) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean and biased variance of ``x`` (shape ``(n, C, *spatial)``, ``n`` may be
    0) over the batch and spatial dimensions of every rank of ``comm``, differentiable (the
    backward sums the gradients over the ranks), and the global count ``N`` of values per
    channel. Shapes ``(C,)``, dtype of ``x``; identical bits on every rank."""
    dims = (0, *range(2, x.dim()))
    mean, var, count = _GlobalMoments.apply(x, comm, dims)
    return mean, var, int(count)


def sync_batch_norm(bn: _BatchNorm, x: torch.Tensor, comm: MPI.Comm) -> torch.Tensor:
    """``bn(x)`` with the statistics of the global batch over ``comm`` in training mode (see
    the module doc); ``bn``'s own forward in eval mode. Raises ``ValueError`` (on every rank)
    for fewer than 2 values per channel over the global batch, as ``nn.BatchNorm`` does."""
    if not bn.training:
        return type(bn).forward(bn, x)
    if x.dim() < 2:
        raise ValueError(f"{type(bn).__name__} expects input of shape (n, C, ...), got {tuple(x.shape)}")
    bn._check_input_dim(x)
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    mean, var, N = global_moments(x, comm)
    if N <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {N} over the "
                         f"global batch of all {comm.Get_size()} replicas (input size of this "
                         f"replica {tuple(x.shape)}): use a larger batch size")
    if bn.track_running_stats and bn.running_mean is not None:
        with torch.no_grad():
            bn.running_mean.mul_(1.0 - factor).add_(mean.detach(), alpha=factor)
            bn.running_var.mul_(1.0 - factor).add_(var.detach() * (N / (N - 1)), alpha=factor)
    return normalize(bn, x, mean, var)


def _named_modules(modules: Sequence[nn.Module],
                   names: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    seen, out = set(), []
    for i, top in enumerate(modules):
        for name, m in top.named_modules(prefix=str(i) if names is None else names[i]):
            if id(m) not in seen:
                seen.add(id(m))
                out.append((name, m))
    return out


class ReplicaSync:
    """Synchronize BatchNorm and guard every other buffer-changing module over ``comm`` while
    training ``modules`` (see the module doc).

    Args:
        modules: the modules trained in the steps (searched recursively; shared submodules
            once).
        comm: the data-parallel communicator (every replica enters with the same structure).
        names: names of ``modules`` in messages (default: their indices); submodules are
            ``<name>.<submodule path>``.

    Entering replaces the forward of every :data:`SYNC_TYPES` module (an instance attribute,
    so parameters, buffers, hooks and ``state_dict`` stay the module's own); leaving restores
    it, also on an exception.
    """

    def __init__(self, modules: Sequence[nn.Module], comm: MPI.Comm,
                 names: Sequence[str] | None = None):
        self.comm = comm
        self.modules = list(modules)
        named = _named_modules(self.modules, names)
        self.synced = [(n, m) for n, m in named if isinstance(m, SYNC_TYPES)]
        self.watched = [(n, m) for n, m in named if not isinstance(m, SYNC_TYPES)]
        self._saved: list = []
        self._snapshot: list | None = None

    def __enter__(self) -> "ReplicaSync":
        comm = self.comm
        for _, m in self.synced:
            self._saved.append((m, m.__dict__.get("forward", _MISSING)))
            m.forward = lambda x, m=m: sync_batch_norm(m, x, comm)
            register_replicas(m, comm, global_moments)  # inside layer-parallel solves too
        return self

    def __exit__(self, *exc) -> None:
        for m, old in reversed(self._saved):
            release_replicas(m)
            if old is _MISSING:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = old
        self._saved.clear()

    def begin_step(self) -> None:
        """Record the identity and version of every buffer of the guarded modules."""
        self._snapshot = [{k: None if b is None else (id(b), b._version) for k, b in m._buffers.items()}
                          for _, m in self.watched]

    def _changes(self) -> str | None:
        for (name, m), before in zip(self.watched, self._snapshot):
            now = {k: None if b is None else (id(b), b._version) for k, b in m._buffers.items()}
            if now != before:
                keys = sorted(k for k in set(now) | set(before) if now.get(k, 0) != before.get(k, 0))
                return (f"module {name} ({type(m).__name__}) changed its buffer(s) "
                        f"{', '.join(repr(k) for k in keys)} in a training forward: with "
                        f"{self.comm.Get_size()} data-parallel replicas each replica would update "
                        f"them from its own shard, so the result would differ from the "
                        f"single-process run and the replicas would drift apart. Synchronized "
                        f"over the replicas are only BatchNorm1d/2d/3d, LazyBatchNorm*d and "
                        f"SyncBatchNorm (torch.nn.modules.batchnorm._BatchNorm); train this "
                        f"module with one replica (data_parallel=1) or replace it (e.g. "
                        f"GroupNorm/LayerNorm keep no running state)")
        return None

    def end_step(self) -> None:
        """Raise the same ``ValueError`` on every replica if a guarded module changed a buffer
        since :meth:`begin_step` (one 1-int ``Allreduce``; the messages are gathered only
        then). Call after backward, before the gradient averaging and the optimizer step."""
        if self._snapshot is None:
            raise RuntimeError("ReplicaSync.end_step() without begin_step()")
        error = self._changes()
        self._snapshot = None
        flag = np.array([1 if error else 0], dtype=np.int32)
        self.comm.Allreduce(MPI.IN_PLACE, [flag, MPI.INT], op=MPI.MAX)
        if flag[0]:
            raise_agreed(self.comm, error)

    def probe(self, in_shape: Sequence[int], dtype: torch.dtype) -> str | None:
        """Run ``modules`` in order, in training mode, on 2 zero samples of shape ``in_shape``
        without a graph, and report (a message, or None) a guarded module that changed a
        buffer. Everything is restored afterwards: buffers (values and objects), modes and
        torch's RNG state. Rank-local (no communication; not inside the context)."""
        everything = _named_modules(self.modules, None)
        saved = [(m, dict(m._buffers), {k: None if b is None else b.detach().clone()
                                        for k, b in m._buffers.items()}, m.training)
                 for _, m in everything]
        try:
            for top in self.modules:
                top.train()
            self.begin_step()
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                x = torch.zeros((2, *in_shape), dtype=dtype)
                for top in self.modules:
                    x = top(x)
            return self._changes()
        finally:
            self._snapshot = None
            with torch.no_grad():
                for m, objects, values, training in saved:
                    m._buffers.clear()
                    m._buffers.update(objects)
                    for k, b in objects.items():
                        if b is not None:
                            b.copy_(values[k])
                    m.training = training


def refuse_unsynchronized(syncs: Sequence[ReplicaSync], in_shapes: Sequence[Sequence[int]],
                          dtype: torch.dtype, comm: MPI.Comm) -> None:
    """Set-up check before any training step: :meth:`ReplicaSync.probe` of every stage
    (``syncs[i]`` fed inputs of shape ``in_shapes[i]``); the same ``ValueError`` on every rank
    of ``comm`` if any stage has a module whose buffers change in a training forward and that
    is not synchronized. (Data-dependent changes the probe cannot see are still caught by
    :meth:`ReplicaSync.end_step`, before the first step they would spoil.)"""
    error = None
    for sync, shape in zip(syncs, in_shapes):
        error = error or sync.probe(shape, dtype)
    raise_agreed(comm, error)
