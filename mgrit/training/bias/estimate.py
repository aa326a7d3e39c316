"""The estimator of the gradient-bias monitor (:mod:`mgrit.training.bias`, whose docstring
states the criterion, its sources and its cost): :func:`measure_bias` compares the current
``.grad`` of a layer-parallel network (the inexact, fixed-iteration gradient) with the gradient
of a tight reference solve of the same batch, split into micro-batches whose spread estimates
the SGD noise. Collective over a :class:`~mgrit.parallel.ProcessGrid`; no side effect on
training (RNG states, buffers, ``.grad`` objects, warm starts, latest results and solver
options are restored).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI
from torch.nn import functional as F

from ..support.faults import phase
from ..support.nets import as_net
from ..support.solvers import replace_solver

__all__ = ["BiasEstimate", "measure_bias", "REFERENCES"]

REFERENCES = ("serial", "converged")
_HINT = ("the gradient-bias monitor's reference solve of the step's batch failed (the step "
         "itself had succeeded); check the network, or run without the monitor")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_pos_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


@dataclass
class BiasEstimate:
    """One measurement of :func:`measure_bias` (identical on every rank of the grid).

    Attributes:
        bias: ``||g - G||`` (see module doc). noise: ``s`` (NaN with fewer than two
            micro-batches). grad_norm: ``||G||``. ratio: ``bias / noise`` (``inf`` for zero
            noise, NaN without an estimate). micro_batches: ``J`` over all replicas.
            samples: ``N``, the global batch. reference_residual: largest final residual of
            the ``"converged"`` reference solves (None for ``"serial"``).
    """

    bias: float
    noise: float
    grad_norm: float
    ratio: float
    micro_batches: int
    samples: int
    reference_residual: float | None = None


def _flat(tensors, params) -> torch.Tensor:
    """This rank's parameter-shaped tensors as one float64 CPU vector (None: zeros)."""
    return torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if t is None
                      else t.detach().reshape(-1).to("cpu", torch.float64)
                      for t, p in zip(tensors, params)]) if params \
        else torch.zeros(0, dtype=torch.float64)


def _reference_options(opts, reference: str, tol: float, max_iter: int):
    if reference == "serial":
        return dataclasses.replace(opts, max_levels=1)
    return dataclasses.replace(opts, tol=tol, rtol=0.0, max_iter=max(opts.max_iter, max_iter))


@contextlib.contextmanager
def _reference_mode(net, params, reference: str, tol: float, max_iter: int):
    """Switch every segment to the reference solve without side effects: on exit the solver
    options, warm-start flags, latest results, buffers, ``.grad`` objects and RNG states are
    as on entry."""
    segs = as_net(net).solver_segments()
    saved = [(s.fwd_opts, s.bwd_opts, s.warm_start, s.warm_start_adjoint, s.last_forward,
              s.last_backward) for s in segs]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in net.buffers()]
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            for s in segs:
                s.warm_start = s.warm_start_adjoint = False  # cold start, keep the warm states
                for which, o in (("forward", s.fwd_opts), ("backward", s.bwd_opts)):
                    new = _reference_options(o, reference, tol, max_iter)
                    if new != o:
                        replace_solver(s, which, new)
            yield
    finally:
        for s, (fo, bo, ws, wa, lf, lb) in zip(segs, saved):
            for which, o, cur in (("forward", fo, s.fwd_opts), ("backward", bo, s.bwd_opts)):
                if cur is not o:
                    replace_solver(s, which, o)
            s.warm_start, s.warm_start_adjoint = ws, wa
            s.last_forward, s.last_backward = lf, lb
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        for p, g in zip(params, grads):
            p.grad = g


def measure_bias(net, x: torch.Tensor, y: torch.Tensor, grid, *,
                 loss_fn: Callable = F.cross_entropy, micro_batches: int = 4,
                 reference: str = "serial", reference_tol: float = 1e-9,
                 reference_max_iter: int = 50) -> BiasEstimate:
    """Bias of the current ``.grad`` of ``net`` against a reference solve of the same batch,
    and the stochastic noise of that batch's gradient (see module doc). Collective over
    ``grid`` (every rank calls it, right after the step's ``backward`` and before the
    replicas' gradients are averaged); leaves no trace on training.

    Args:
        net: a :class:`~mgrit.nn.LayerParallelNet` on ``grid.layer_comm`` whose ``.grad`` holds
            this replica's gradient of the mean loss over ``(x, y)``.
        x, y: this replica's batch ``(n, ...)`` and targets ``(n,)`` (as for the step; ``n``
            may be 0 on a replica with an empty shard).
        grid: the :class:`~mgrit.parallel.ProcessGrid`.
        loss_fn: ``(output, target) -> mean loss`` (default ``F.cross_entropy``).
        micro_batches: ``M >= 2`` micro-batches per replica (fewer if ``n < M``).
        reference: ``"serial"`` (default; exact) or ``"converged"``.
        reference_tol, reference_max_iter: absolute tolerance and cycle cap of
            ``"converged"`` (defaults 1e-9, 50; the cap never below the current ``max_iter``).

    Returns:
        :class:`BiasEstimate`.

    Raises:
        ValueError: a network without layer-parallel segments, or bad arguments (every rank,
            before any communication).
    """
    if not as_net(net).solver_segments():
        raise ValueError("measure_bias needs a layer-parallel network (a LayerParallelNet with "
                         "at least one LayerParallelResNet segment): a serial network has no "
                         "solver bias")
    if not _is_int(micro_batches) or micro_batches < 2:
        raise ValueError(f"micro_batches={micro_batches!r} is not allowed: use an int >= 2")
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r} is not allowed: use one of {list(REFERENCES)}")
    if not _is_pos_number(reference_tol):
        raise ValueError(f"reference_tol={reference_tol!r} is not allowed: use a finite number > 0")
    if not _is_int(reference_max_iter) or reference_max_iter < 1:
        raise ValueError(f"reference_max_iter={reference_max_iter!r} is not allowed: use an "
                         f"int >= 1")
    params = [p for p in net.parameters() if p.requires_grad]
    n = int(len(y))
    g_inexact = _flat([p.grad for p in params], params)
    micro, sizes, residual = [], [], None
    if n:
        with phase("bias monitor", hint=_HINT), \
                _reference_mode(net, params, reference, reference_tol, reference_max_iter):
            for idx in torch.arange(n).tensor_split(min(micro_batches, n)):
                for p in params:
                    p.grad = None
                out = net(x[idx])
                net.loss(out, y[idx], loss_fn).backward()
                micro.append(_flat([p.grad for p in params], params))
                sizes.append(len(idx))
                if reference == "converged":
                    for s in as_net(net).solver_segments():
                        for r in (s.last_forward, s.last_backward):
                            if r is not None and r.residuals:
                                residual = max(residual or 0.0, float(r.residuals[-1]))
    data = grid.data_comm
    N = data.allreduce(n)
    # D = sum_replicas (n/N) (g - G_replica), G = sum_j (n_j / N) g_j: one allreduce
    local = torch.zeros(2 * g_inexact.numel(), dtype=torch.float64)
    if n:
        g_ref = sum(m * (k / N) for m, k in zip(micro, sizes))
        local[:g_inexact.numel()] = g_inexact * (n / N) - g_ref
        local[g_inexact.numel():] = g_ref
    buf = local.numpy()
    if data.Get_size() > 1:
        data.Allreduce(MPI.IN_PLACE, buf)
    D, G = local[:g_inexact.numel()], local[g_inexact.numel():]
    spread = sum(k * float(((m - G) ** 2).sum()) for m, k in zip(micro, sizes)) if n else 0.0
    norms = grid.layer_comm.allreduce(np.array([float(D @ D), float(G @ G)]))
    spread = grid.comm.allreduce(spread)
    J = data.allreduce(len(sizes))
    if reference == "converged":
        r = residual or 0.0  # NaN as +inf: Python's max (MPI.MAX on objects) drops a NaN
        residual = grid.comm.allreduce(math.inf if math.isnan(r) else r, op=MPI.MAX)
    bb, gg, ss, J = grid.comm.bcast((float(norms[0]), float(norms[1]), float(spread), int(J)),
                                    root=0)
    bias, gnorm = math.sqrt(bb), math.sqrt(gg)
    noise = math.sqrt(ss / ((J - 1) * N)) if J >= 2 else float("nan")
    ratio = (bias / noise if noise > 0 else (math.inf if bias > 0 else float("nan"))) \
        if J >= 2 else float("nan")
    return BiasEstimate(bias=bias, noise=noise, grad_norm=gnorm, ratio=ratio, micro_batches=J,
                        samples=int(N), reference_residual=residual)
