"""The agreement before a collective backward of a parallel autograd node (shared by the
layer-parallel ResNet bridge and the parallel-in-time GRU).

A backward whose body is a collective solve (adjoint MGRIT, a gradient ``Allreduce``) is only
correct when every rank of the communicator backpropagates the same forward, and only safe
when no rank has failed the checks that precede the solve (a freed graph, a tensor modified in
place, ``create_graph``): a rank that raised alone would leave the others waiting in the
solve. :func:`agree_backward` turns both into the same RuntimeError on every rank, and merges
the ranks' needs so that all of them run the same collectives.
"""
from __future__ import annotations

from typing import Sequence

import torch

from mpi4py import MPI

from ...collective import agreed, allgather_within, guarded

__all__ = ["agree_backward", "saved_or_error"]


def agree_backward(comm: MPI.Comm, what: str, forward_id: int, error: str | None,
                   need: Sequence[bool]) -> tuple[bool, ...]:
    """Agree, over ``comm``, on one backward of a ``what`` (a class name) before its solve.

    Args:
        comm: the communicator of the collective backward (every rank calls this once per
            backward of the node).
        what: the module's name (``"ParallelGRU"``), in the messages and in the tag that tells
            this agreement from any other collective that might meet it.
        forward_id: the number of the forward being backpropagated (the same on every rank
            for the same forward: forwards are collective, so ranks count them alike).
        error: this rank's failure of its pre-solve checks (a message), or ``None``.
        need: this rank's per-item needs (e.g. ``(input gradient, *per-parameter)``); the
            same length on every rank.

    Returns:
        The element-wise OR of ``need`` over the ranks: what the collectives must compute
        (a rank computes its share of an item it does not need itself when another rank
        does). One small ``allgather``; none on one rank.

    Raises:
        RuntimeError: on every rank, naming each rank's ``error``, or the forward numbers
            when ranks backpropagate different forwards, or the ranks that met this
            agreement inside another collective (marked :func:`~mgrit.collective.agreed`).
        ~mgrit.collective.CollectiveTimeout: ranks that never called backward within
            :func:`~mgrit.collective.collective_timeout` (default 600 s), named; it ends the
            job (:class:`~mgrit.collective.guarded`) unless that guard is turned off.
    """
    need = tuple(bool(v) for v in need)
    if comm.Get_size() == 1:
        if error:
            raise RuntimeError(error)
        return need
    tag = f"{what}.backward"
    with guarded("backward agreement"):
        gathered = allgather_within(comm, (error, (tag, forward_id, need)),
                                    f"the backward of a {what} forward")
        return _verdict(gathered, what, tag, need)


def _verdict(gathered: list, what: str, tag: str, need: tuple) -> tuple[bool, ...]:
    """The merged needs of the gathered ``(error, (tag, forward id, need))``, or the agreed
    RuntimeError (see :func:`agree_backward`)."""
    strays = [r for r, g in enumerate(gathered)
              if not (isinstance(g, tuple) and len(g) == 2 and isinstance(g[1], tuple)
                      and len(g[1]) == 3 and g[1][0] == tag and len(g[1][2]) == len(need))]
    if strays:  # another collective met this one: those ranks are not in this backward
        raise agreed(RuntimeError(f"rank(s) {strays} did not enter the backward of a {what} "
                                  f"forward while the others did: every rank must call "
                                  f"backward on the same forwards"))
    errs = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
    ids = [t[1] for _, t in gathered]
    if len(set(ids)) > 1:
        errs.append(f"ranks backpropagate different forwards of this {what} ("
                    + ", ".join(f"rank {r}: forward #{i}" for r, i in enumerate(ids))
                    + "): every rank must call backward on the same forwards, in the same order")
    if errs:
        raise agreed(RuntimeError("; ".join(errs)))
    return tuple(any(t[2][i] for _, t in gathered) for i in range(len(need)))


def saved_or_error(ctx, forward_id: int, what: str) -> tuple:
    """``(ctx.saved_tensors, None)``, or ``(None, message)`` when autograd refuses them (an
    in-place change, a freed graph) or when the backward is recorded for a double backward
    (``create_graph=True``, unsupported: the gradients of ``what`` are not differentiable).
    Local: the message goes to :func:`agree_backward`, which ends the backward on every rank."""
    try:
        saved = ctx.saved_tensors  # autograd's version check and freed-graph check
    except RuntimeError as exc:
        return None, f"backward of forward #{forward_id} of this {what}: {exc}"
    if torch.is_grad_enabled():
        return saved, (f"double backward (create_graph=True) through a {what} is not "
                       f"supported: its gradients are not differentiable")
    return saved, None
