"""BatchNorm inside layer-parallel steps: batch statistics in every application, running
statistics once per training forward.

In training mode ``torch.nn.BatchNorm1d/2d/3d`` normalizes with the mean and biased variance of
the batch it is given and then updates ``running_mean``, ``running_var`` and
``num_batches_tracked``. The first part makes a step a deterministic function of its input
state, which is all MGRIT needs (its relaxations, coarse levels and the adjoint see one ``F``).
The second would be wrong inside a solve: MGRIT applies a layer many times per forward, so the
running statistics would be updated once per application, from iterates that are not the
forward's states. Hence, for a segment (:class:`~mgrit.nn.resnet.LayerParallelResNet`):

* during its solves (forward, adjoint, parameter gradients; :func:`frozen_statistics`) every
  BatchNorm of its steps in training mode normalizes with the statistics of the state it is
  given and leaves its buffers alone (``F.batch_norm`` without running statistics);
* after each forward solve in training mode, :func:`update_running_statistics` applies each
  of the rank's layers once more, without a graph, to the state the solve returned for it (the
  final iterate), with the module's own forward: the buffers are updated exactly as serial
  PyTorch updates them (``momentum``, or the cumulative average for ``momentum=None``, the
  unbiased variance, ``num_batches_tracked``); once per training forward, as in serial;
* in evaluation mode the module's own forward runs (running statistics; no update).

A forward that runs inside another solve (a non-reentrant ``torch.utils.checkpoint``
recomputation, which a rank may start inside its adjoint solve) updates the running
statistics with the modules' forwards from before that solve, as serial PyTorch with the same
checkpoint does (once in the forward, once in the recomputation).

Exact mode (a tolerance) therefore reproduces serial training's outputs, gradients and
running statistics to round-off. In inexact mode (fixed cycle counts) the running statistics
come from the approximate final states of the solve, as the outputs and gradients do; the
evaluation then normalizes with statistics of states that differ from the serial network's by
the solve's residual.

Data-parallel replicas (SyncBN semantics): while :class:`mgrit.parallel.ReplicaSync` is active
(the ``Trainer`` with ``data_parallel > 1``) it registers each BatchNorm it synchronizes here
(:func:`register_replicas`): the statistics in the solves are then those of the global batch
of all replicas (its ``global_moments``: one ``Allgather`` per application, and one per VJP in
the adjoint), and the update pass uses its synchronized forward. Every replica must then apply
the layers equally often, so the stopping test of the segment's solvers reduces the residual
over the replicas too (:func:`replicas_agree`: the global batch's residual, what a single
process would compute). So a run on ``R`` replicas equals the one-replica run.

Refused (ValueError naming the layer, at construction and ``refresh_structure``):
``SyncBatchNorm`` (it needs ``torch.distributed``; use ``BatchNorm*d``, replicas are
synchronized by ``ReplicaSync``) and uninitialized ``LazyBatchNorm*d`` (run it once first).
Every ``momentum`` (``None`` included), ``affine`` and ``track_running_stats`` setting is
honoured. A step with BatchNorm is evaluated layer by layer (never stacked,
:mod:`mgrit.nn.chains.stacking`).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from typing import Sequence

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase
from torch.nn.parameter import is_lazy

__all__ = ["batch_norms", "batchnorm_error", "checked_buffers", "frozen_statistics", "update_running_statistics",
           "register_replicas", "release_replicas", "replicas_agree", "normalize"]

#: BatchNorm module -> (data-parallel communicator, moments function) while a ReplicaSync runs
_REPLICAS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MISSING = object()
#: BatchNorm module -> the forwards it had before each enclosing frozen_statistics (outermost first)
_FROZEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def register_replicas(bn: _BatchNorm, comm: MPI.Comm, moments) -> None:
    """Called by :class:`mgrit.parallel.ReplicaSync` on entering: ``bn`` normalizes with the
    statistics of the global batch over ``comm``; ``moments(x, comm) -> (mean, var, count)``
    (differentiable, its backward sums over the replicas)."""
    _REPLICAS[bn] = (comm, moments)


def release_replicas(bn: _BatchNorm) -> None:
    """Inverse of :func:`register_replicas` (on leaving the ReplicaSync)."""
    _REPLICAS.pop(bn, None)


def batch_norms(steps: Sequence[nn.Module]) -> list:
    """Every BatchNorm module of ``steps`` (each once)."""
    seen, out = set(), []
    for s in steps:
        for m in s.modules():
            if isinstance(m, _BatchNorm) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


def batchnorm_error(steps: Sequence[nn.Module], first: int) -> str | None:
    """A message for a BatchNorm a segment cannot honour, naming the layer and what to do."""
    for j, s in enumerate(steps):
        for name, m in s.named_modules():
            what = f"layer {first + j} contains {type(m).__name__} ({name or 'the step'})"
            if isinstance(m, nn.SyncBatchNorm):
                return (f"{what}, which needs torch.distributed: use BatchNorm1d/2d/3d with the "
                        f"same arguments; with data-parallel replicas the Trainer (ReplicaSync) "
                        f"uses the statistics of the global batch")
            if isinstance(m, _LazyNormBase) and any(is_lazy(t) for t in
                                                    (*m.parameters(recurse=False),
                                                     *m.buffers(recurse=False))):
                return (f"{what}, whose shapes are not known yet: run the step once on a sample "
                        f"state before building the segment, or use BatchNorm1d/2d/3d")
    return None


def checked_buffers(steps: Sequence[nn.Module]) -> list:
    """The buffers of ``steps`` whose in-place change between a forward and its backward is an
    error: all but BatchNorm's running statistics, which its training forward itself updates
    (serial autograd never saves them in training mode either)."""
    stats = {id(b) for m in batch_norms(steps) for b in m.buffers(recurse=False)}
    return [b for s in steps for b in s.buffers() if id(b) not in stats]


def normalize(bn: _BatchNorm, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over channel dim 1 (``mean``, ``var``:
    ``(C,)``)."""
    shape = [1] * x.dim()
    shape[1] = x.shape[1]
    out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + bn.eps)
    if bn.weight is not None:
        out = out * bn.weight.view(shape)
    if bn.bias is not None:
        out = out + bn.bias.view(shape)
    return out


def _solve_forward(bn: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """``bn(x)`` inside a solve: batch statistics, no buffer update (eval: running ones)."""
    if not bn.training and bn.running_mean is not None:
        return type(bn).forward(bn, x)
    bn._check_input_dim(x)
    sync = _REPLICAS.get(bn)
    if sync is None:
        return F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    comm, moments = sync
    mean, var, n = moments(x, comm)
    if n <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {n} over "
                         f"the global batch of all {comm.Get_size()} replicas")
    return normalize(bn, x, mean, var)


@contextlib.contextmanager
def frozen_statistics(bns: Sequence[_BatchNorm]):
    """Inside the block every BatchNorm of ``bns`` normalizes with batch statistics and
    updates no buffer (an instance ``forward``; parameters, buffers and hooks stay the
    module's own); its previous forward (e.g. ReplicaSync's) is restored afterwards."""
    saved = []
    try:
        for m in bns:
            saved.append((m, m.__dict__.get("forward", _MISSING)))
            _FROZEN.setdefault(m, []).append(saved[-1][1])
            m.forward = lambda x, m=m: _solve_forward(m, x)
        yield
    finally:
        for m, old in reversed(saved):
            _FROZEN[m].pop()
            _set_forward(m, old)


def _set_forward(m: _BatchNorm, forward) -> None:
    if forward is _MISSING:
        m.__dict__.pop("forward", None)
    else:
        m.__dict__["forward"] = forward


@contextlib.contextmanager
def _thawed(bns: Sequence[_BatchNorm]):
    """Inside the block the BatchNorms of ``bns`` run the forward they had before the
    outermost :func:`frozen_statistics` around this point (a forward run inside another
    solve: a ``torch.utils.checkpoint`` recomputation triggered in an adjoint solve)."""
    saved = [(m, m.__dict__.get("forward", _MISSING)) for m in bns if _FROZEN.get(m)]
    try:
        for m, _ in saved:
            _set_forward(m, _FROZEN[m][0])
        yield
    finally:
        for m, cur in reversed(saved):
            _set_forward(m, cur)


def update_running_statistics(steps: Sequence[nn.Module], states: torch.Tensor,
                              bns: Sequence[_BatchNorm]) -> None:
    """One pass over the layers that hold a BatchNorm in training mode with running
    statistics: ``steps[j](states[j])`` without a graph, with the modules' own forward (the
    buffers update as in serial PyTorch; with replicas, synchronized)."""
    if not any(m.training and m.track_running_stats for m in bns):
        return
    with torch.no_grad(), _thawed(bns):  # (also when this forward runs inside a solve)
        for j, s in enumerate(steps):
            if any(m.training and m.track_running_stats for m in s.modules()
                   if isinstance(m, _BatchNorm)):
                s(states[j])


def replica_comm(bns: Sequence[_BatchNorm]) -> MPI.Comm | None:
    """The data-parallel communicator of the registered BatchNorms in training mode (None)."""
    for m in bns:
        sync = _REPLICAS.get(m)
        if sync is not None and m.training:
            return sync[0]
    return None


@contextlib.contextmanager
def replicas_agree(solvers, comm: MPI.Comm | None):
    """Inside the block the solvers' stopping test uses the residual and state norm of the
    global batch over the replicas of ``comm`` (2-norm: square root of the sum of squares;
    inf-norm: the maximum), identical on every replica, so every replica runs the same cycles
    (its synchronized BatchNorms communicate in every application)."""
    if comm is None or comm.Get_size() == 1:
        yield
        return
    saved = []
    for solver in solvers:
        own = solver._residual
        inf = solver.options.norm == "inf"

        def joined(own=own, inf=inf):
            r, s = own()
            nan = math.isnan(r) or math.isnan(s)  # MPI's MAX does not propagate NaN: a flag
            v = np.array([math.inf, math.inf, 1.0] if nan else
                         ([r, s, 0.0] if inf else [r * r, s * s, 0.0]))
            if inf:  # exact: the same maximum on every replica whatever the order
                comm.Allreduce(MPI.IN_PLACE, v, op=MPI.MAX)
            else:  # object reduction: one result, identical bits everywhere
                v = comm.allreduce(v, op=MPI.SUM)
            if v[2] > 0:
                return math.nan, math.nan
            return (float(v[0]), float(v[1])) if inf else (math.sqrt(v[0]), math.sqrt(v[1]))
        saved.append(solver)
        solver._residual = joined
    try:
        yield
    finally:
        for solver in saved:
            solver.__dict__.pop("_residual", None)
