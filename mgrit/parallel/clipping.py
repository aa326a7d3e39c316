"""Global-norm gradient clipping over the layer-parallel x data-parallel grid
(:func:`clip_grad_norm_`): the same total norm and the same scaling as
``torch.nn.utils.clip_grad_norm_`` on the whole serial model.

Why the plain call is wrong here: each layer rank holds only its own layers' parameters, so
``torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)`` on every rank clips each rank's
slice by the norm of that slice -- every rank a different factor, a rank whose slice is below
``max_norm`` not at all -- and the update leaves the serial trajectory (2 ranks: slice norms
2.09 and 1.87 against the global 2.80). The global norm needs the squares of every rank's
gradients, each parameter counted once:

* layer-parallel parameters are disjoint over the layer ranks (every parameter of a
  :class:`~mgrit.nn.LayerParallelNet` lives on exactly one rank): summed over the layer
  communicator;
* parameters replicated on every layer rank with identical gradients (a ``ParallelGRU``'s
  weights) are counted once (on layer rank 0): passed as ``replicated``, or declared by the
  network passed as ``parameters`` (``replicated_parameters()``, and ``tied_duplicates()``
  for weight-tied groups spanning ranks);
* data-parallel replicas hold identical averaged gradients, so nothing is reduced over the
  data communicator: call this *after* averaging, and every replica computes the same norm and
  the same factor.

Cost: one tiny ``allgather`` (a float per rank) over the layer communicator; each rank sums the
gathered values in rank order, so the norm is bitwise identical on every rank.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..nn.protocol import shared_parameters
from ._flatbuffers import distinct_tensors
from .procgrid import ProcessGrid

__all__ = ["clip_grad_norm_"]


def _tensors(parameters) -> list:
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return distinct_tensors(parameters)


def _number_error(name: str, v, allow_inf: bool = False) -> str | None:
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0 \
        and (math.isfinite(v) or (allow_inf and v == math.inf))
    return None if ok else (f"{name}={v!r} is not allowed: use a number > 0"
                            + (" or math.inf" if allow_inf else " (finite)"))


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
                    max_norm: float, grid: ProcessGrid | MPI.Comm | None = None, *,
                    norm_type: float = 2.0, replicated: Iterable[torch.Tensor] | None = None,
                    counted_elsewhere: Iterable[torch.Tensor] | None = None,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of this rank's ``parameters`` in place so that the gradient norm
    of the whole (serial) model is at most ``max_norm``; returns that norm before clipping.
    Collective over the layer communicator.

    Equals ``torch.nn.utils.clip_grad_norm_(serial_model.parameters(), max_norm, norm_type)``
    up to the order of the summation (round-off): the total norm is
    ``(sum over all parameters of ||g||_p^p)^(1/p)`` (the maximum for ``p = inf``), and every
    gradient is multiplied by ``min(1, max_norm / (total + 1e-6))`` (torch's formula).

    Args:
        parameters: this rank's parameters (a module, an iterable of tensors or one tensor);
            those without ``.grad`` are ignored, as in torch.
        max_norm: the largest allowed norm, a finite number > 0.
        grid: the :class:`ProcessGrid` (its ``layer_comm`` is used), a layer communicator, or
            None (``COMM_SELF``: a serial model, or data parallelism only). Call it after the
            data-parallel averaging: replicas then hold identical gradients and clip alike.
        norm_type: ``p`` of the p-norm, > 0, or ``math.inf`` (default 2.0).
        replicated: those of ``parameters`` present with identical gradients on every rank of
            the layer communicator (e.g. a ``ParallelGRU``'s weights, summed over its time
            ranks in backward): counted once. Every other parameter must live on one layer
            rank only (as in :class:`~mgrit.nn.LayerParallelNet`), or it is counted once per
            rank holding it. None (default): when ``parameters`` is a module, the module is
            asked (:func:`mgrit.nn.protocol.shared_parameters`: a network's
            ``replicated_parameters()``); else none.
        counted_elsewhere: those of ``parameters`` whose (identical) gradient another layer
            rank counts: left out of this rank's share of the norm, still scaled (e.g. the
            replicas of a weight-tied group spanning ranks, counted by the rank holding the
            group's first layer; :meth:`mgrit.nn.protocol.NetMixin.tied_duplicates`). None
            (default): asked of a module as ``replicated``; else none.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) when the total norm is NaN
            or Inf instead of scaling by a NaN factor (torch's option, default False).

    Returns:
        The total norm before clipping, a 0-dim float64 CPU tensor, bitwise identical on every
        rank of the layer communicator.

    Raises:
        ValueError: ``max_norm`` or ``norm_type`` not allowed, or different on some ranks
            (on every rank, before any gradient changes).
        TypeError: an item that is not a tensor, or ``grid`` not a ProcessGrid/communicator.
        RuntimeError: a non-finite total norm with ``error_if_nonfinite``.
    """
    if grid is None:
        comm = MPI.COMM_SELF
    elif isinstance(grid, ProcessGrid):
        comm = grid.layer_comm
    elif isinstance(grid, MPI.Comm):
        comm = grid
    else:
        raise TypeError(f"grid must be a mgrit.parallel.ProcessGrid, an mpi4py communicator or "
                        f"None, got {type(grid).__name__}")
    if isinstance(parameters, nn.Module) and (replicated is None or counted_elsewhere is None):
        asked = shared_parameters(parameters)  # the network knows what it replicates
        replicated = asked[0] if replicated is None else replicated
        counted_elsewhere = asked[1] if counted_elsewhere is None else counted_elsewhere
    params = _tensors(parameters)
    shared = {id(p) for p in _tensors(() if replicated is None else replicated)}
    error = _number_error("max_norm", max_norm) or _number_error("norm_type", norm_type, True)
    if error is None and not shared <= {id(p) for p in params}:
        error = "replicated holds tensors that are not among the parameters"
    p = float(norm_type) if error is None else 0.0
    elsewhere = {id(p) for p in _tensors(() if counted_elsewhere is None else counted_elsewhere)}
    grads = [q.grad for q in params if q.grad is not None and id(q) not in elsewhere
             and (id(q) not in shared or comm.Get_rank() == 0)]
    partial = 0.0
    if grads and error is None:
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), p).to("cpu", torch.float64)
                             for g in grads])
        partial = float(norms.max()) if p == math.inf else float((norms ** p).sum())
    mine = (error, None if error else (float(max_norm), p))
    gathered = comm.allgather((partial, mine)) if comm.Get_size() > 1 else [(partial, mine)]
    errors = [f"rank {r}: {e}" for r, (_, (e, _)) in enumerate(gathered) if e]
    settings = {s for _, (e, s) in gathered if not e}
    if not errors and len(settings) > 1:
        errors.append(f"ranks disagree on (max_norm, norm_type): "
                      f"{[s for _, (_, s) in gathered]}")
    if errors:
        raise ValueError("clip_grad_norm_: " + "; ".join(errors))
    parts = np.array([v for v, _ in gathered], dtype=np.float64)
    if p == math.inf:
        total = float(np.max(parts))  # np.max propagates NaN
    else:
        s = 0.0
        for v in parts:  # rank order: the same bits on every rank
            s += v
        total = s ** (1.0 / p)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total}, "
                           f"so they cannot be clipped; set error_if_nonfinite=False to scale "
                           f"them anyway")
    coef = float(max_norm) / (total + 1e-6)
    if not coef >= 1.0:  # (NaN too, as torch: the gradients become NaN)
        with torch.no_grad():
            for q in params:
                if q.grad is not None:
                    q.grad.mul_(coef)
    return torch.tensor(total, dtype=torch.float64)
