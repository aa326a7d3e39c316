"""Differentiable point-to-point transfers of a state between layer ranks, and the join that
keeps every layer-parallel segment in every rank's backward graph (used by
:class:`~mgrit.nn.net.LayerParallelNet`).

* :func:`send`: forward sends the state to ``dest`` and returns an empty placeholder connected
  to it; backward receives the gradient from ``dest``.
* :func:`recv`: forward receives the state from ``source``; its input ``link`` (this rank's
  placeholder of everything before) orders it in the graph; backward sends the gradient back.
* :func:`join`: ``a`` unchanged (a copy), with ``b`` as a second autograd input, so that the
  backward of ``a``'s producer and of everything behind ``b`` are both in the graph.

Messages go through :class:`mgrit.comm.Exchanger`: mpi4py's buffer API on the raw bytes of the
tensor, so every dtype crosses exactly (no float64 -> float32 downcast), with the byte count
checked on arrival. Shapes and dtypes are agreed statically: the receiver passes the template
(the next segment's state), and the network checks the sender's tensor against it on every
rank before any message is sent. Tags ``TAG_BASE + 2 k`` (state into segment ``k``) and
``+ 1`` (its gradient) stay clear of the solver's tags (below 10,000).
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from ..comm import Exchanger
from ..stats import SolverStats

__all__ = ["send", "recv", "join", "transfer_tag", "TAG_BASE"]

TAG_BASE = 20_000
_MAX_SEGMENTS = 6_000  # keeps every tag below 32,767, the smallest MPI_TAG_UB MPI allows


def transfer_tag(segment: int) -> int:
    """Tag of the state message into segment ``segment`` (its gradient uses ``tag + 1``)."""
    if not 0 <= segment < _MAX_SEGMENTS:
        raise ValueError(f"segment index {segment} is not allowed: use 0..{_MAX_SEGMENTS - 1}")
    return TAG_BASE + 2 * segment


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dest, tag, stats):
        ex = Exchanger(comm, x.shape, x.dtype, x.device, stats)
        ex.isend(x.detach(), dest, tag)
        ex.waitall()
        ctx.meta = (comm, dest, tag + 1, x.shape, x.dtype, x.device, stats)
        return x.new_zeros(0)

    @staticmethod
    def backward(ctx, _grad):
        comm, dest, tag, shape, dtype, device, stats = ctx.meta
        g = Exchanger(comm, shape, dtype, device, stats).recv(dest, tag)
        return g, None, None, None, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, link, comm, source, tag, shape, dtype, device, stats):
        ex = Exchanger(comm, shape, dtype, device, stats)
        x = ex.recv(source, tag)
        ctx.meta = (comm, source, tag + 1, shape, dtype, device, stats)
        ctx.link = (link.shape, link.dtype, link.device)
        return x

    @staticmethod
    def backward(ctx, grad):
        comm, source, tag, shape, dtype, device, stats = ctx.meta
        ex = Exchanger(comm, shape, dtype, device, stats)
        ex.isend(grad.detach().contiguous(), source, tag)
        ex.waitall()
        lshape, ldtype, ldevice = ctx.link
        return torch.zeros(lshape, dtype=ldtype, device=ldevice), *([None] * 7)


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, zero_b):
        ctx.b = (b.shape, b.dtype, b.device) if zero_b else None
        return a.clone()  # not a view: the caller may modify it in place (e.g. ReLU(inplace))

    @staticmethod
    def backward(ctx, grad):
        if ctx.b is None:  # b's producers still run (their gradient is undefined), b gets None
            return grad, None, None
        shape, dtype, device = ctx.b
        return grad, torch.zeros(shape, dtype=dtype, device=device), None


def send(x: torch.Tensor, comm: MPI.Comm, dest: int, tag: int, stats: SolverStats) -> torch.Tensor:
    """Send ``x`` (any shape and dtype) to rank ``dest`` of ``comm``; returns an empty
    placeholder of ``x``'s dtype that carries ``x``'s gradient (received from ``dest`` with
    ``tag + 1`` during backward). Blocks until the message is delivered to MPI."""
    return _Send.apply(x, comm, int(dest), int(tag), stats)


def recv(link: torch.Tensor | None, comm: MPI.Comm, source: int, tag: int, shape, dtype,
         device, stats: SolverStats) -> torch.Tensor:
    """Receive a state ``shape``/``dtype`` from ``source`` onto ``device``. ``link``: this rank's
    placeholder of the computation so far (it orders the receive in the backward graph; the
    result requires grad exactly when ``link`` does). Backward sends the gradient to
    ``source`` with ``tag + 1``. Raises RuntimeError when the message has another size."""
    if link is None:
        link = torch.zeros(0, dtype=dtype, device=device)
    return _Recv.apply(link, comm, int(source), int(tag), torch.Size(shape), dtype,
                       torch.device(device), stats)


def join(a: torch.Tensor, b: torch.Tensor, zero_b: bool = True) -> torch.Tensor:
    """A copy of ``a`` that also depends on ``b`` (gradient ``0`` to ``b``, or none when
    ``zero_b`` is false), so that a backward through the result runs the backward of ``b``'s
    producers too."""
    return _Join.apply(a, b, zero_b)
