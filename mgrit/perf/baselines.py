"""The parallel baselines layer-parallel training is measured against, over MPI.

* :class:`GPipe` -- pipeline model parallelism with micro-batches (Huang et al. 2019, GPipe):
  rank ``r`` of the communicator holds stage ``r`` (a contiguous block of layers); the batch is
  split into ``M`` micro-batches; all forwards run first (fill, steady state, drain: stage ``r``
  starts micro-batch ``j`` as soon as stage ``r - 1`` sent it), then all backwards in reverse
  order, gradients summed over the micro-batches, then each rank updates its own parameters. The
  critical path is ``(M + P - 1)`` stage-times per direction. ``M = 1`` is the blocking chain of
  layer-wise model parallelism.
* :class:`LeanDataParallel` -- data parallelism with the lean serial loop on each replica (its
  shard of the global batch), the gradients summed by one ``Allreduce`` of one flat buffer.

Stages: :class:`LeanStage` (a :class:`~mgrit.perf.lean.LeanResNet` block: preallocated buffers,
closed-form backward -- the strongest pipeline for the dense ResNet) and :class:`ModuleStage`
(autograd through any ``nn.Module``: any network, e.g. an opening layer + residual steps on the
first stage and the classifier on the last). Gradients equal serial autograd's
(``tests/perf/test_perf_baselines.py``, float64, 2 and 3 ranks). Point-to-point messages are
``Isend``/``Recv`` of contiguous CPU tensors (mpi4py buffers); communicators: only the one given.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from mpi4py import MPI
from torch import nn

from ..comm import raise_agreed
from .lean import LeanResNet

__all__ = ["LeanStage", "ModuleStage", "GPipe", "LeanDataParallel", "micro_batch_sizes"]


def micro_batch_sizes(batch: int, micro: int) -> list:
    """Sizes of ``micro`` consecutive micro-batches of a batch of ``batch`` samples (the first
    ``batch % micro`` one larger); ValueError unless ``1 <= micro <= batch``."""
    if isinstance(micro, bool) or not isinstance(micro, int) or not 1 <= micro <= batch:
        raise ValueError(f"micro_batches={micro!r} is not allowed with batch {batch}: use an "
                         f"int in 1..{batch} (every micro-batch needs a sample)")
    return [batch // micro + (1 if j < batch % micro else 0) for j in range(micro)]


class LeanStage:
    """A pipeline stage of lean dense residual layers (:class:`LeanResNet`); one buffer set
    per micro-batch, gradients accumulated over micro-batches in ``net.grad_flat``."""

    def __init__(self, net: LeanResNet):
        self.net = net
        self.in_shape = (net.width,)

    def zero_grad(self) -> None:
        self.net.zero_grad()

    def forward(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        return self.net.forward_store(x, slot)

    def backward(self, grad: torch.Tensor, slot: int) -> torch.Tensor:
        return self.net.backward(grad, slot, accumulate=True)

    def step(self, lr: float) -> None:
        self.net.sgd_step(lr)


class ModuleStage:
    """A pipeline stage running ``module`` with autograd. ``in_shape``: one sample's input shape
    (what the previous stage sends). Parameter gradients accumulate in ``.grad`` over the
    micro-batches; the caller's optimizer updates them."""

    def __init__(self, module: nn.Module, in_shape: Sequence[int], first: bool = False):
        self.module, self.in_shape, self.first = module, tuple(in_shape), first
        self._saved = {}

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def forward(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        xin = x if self.first else x.detach().requires_grad_(True)
        y = self.module(xin)
        self._saved[slot] = (xin, y)
        return y.detach()

    def backward(self, grad: torch.Tensor, slot: int) -> torch.Tensor | None:
        xin, y = self._saved.pop(slot)
        y.backward(grad)
        return None if self.first else xin.grad


def _np(t: torch.Tensor):
    return t.detach().contiguous().numpy()


class GPipe:
    """GPipe training over the ranks of ``comm`` (stage ``r`` on rank ``r``).

    Args:
        stage: this rank's :class:`LeanStage` or :class:`ModuleStage`.
        comm: the pipeline communicator (``P`` stages).
        micro_batches: ``M >= 1``; ``M = 1`` is the blocking chain (layer-wise model
            parallelism). Advice: the best ``M`` balances the fill/drain bubble
            ``(P - 1) / (M + P - 1)`` against the per-call cost of small micro-batches
            (:mod:`mgrit.perf.strategies` predicts it).
        dtype: dtype of the messages (the stages' dtype).

    Raises:
        ValueError: on every rank, when any rank's stage is not a stage or ``micro_batches``
            is not a positive int (agreed over ``comm`` in the constructor).
    """

    def __init__(self, stage, comm: MPI.Comm, micro_batches: int, dtype=torch.float32):
        err = None
        if not isinstance(stage, (LeanStage, ModuleStage)):
            err = f"stage {type(stage).__name__} is not allowed: use LeanStage or ModuleStage"
        elif isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            err = f"micro_batches={micro_batches!r} is not allowed: use an int >= 1"
        raise_agreed(comm, err)
        self.stage, self.comm, self.M, self.dtype = stage, comm, micro_batches, dtype
        self.rank, self.P = comm.Get_rank(), comm.Get_size()
        self._rbuf = {}

    def _recv(self, key, shape, src, tag):
        buf = self._rbuf.get(key)
        if buf is None or buf.shape != shape:
            buf = self._rbuf[key] = torch.empty(shape, dtype=self.dtype)
        self.comm.Recv(buf.numpy(), src, tag)
        return buf

    def step(self, x: torch.Tensor | None, batch_size: int,
             loss_fn: Callable[[torch.Tensor, int, slice], torch.Tensor] | None = None,
             validate: bool = True) -> float | None:
        """One forward + backward of a batch of ``batch_size`` samples (gradients summed over
        the micro-batches into this rank's stage; call its optimizer afterwards).

        Args:
            x: the batch ``(batch_size, *in_shape)`` on rank 0 (ignored elsewhere).
            batch_size: the same on every rank.
            loss_fn: on the last rank, ``loss_fn(out_j, j, rows_j)`` -> the scalar loss of
                micro-batch ``j`` (samples ``rows_j`` of the batch), scaled so that the sum over
                ``j`` is the batch loss (e.g. ``mean`` losses times ``n_j / batch_size``).
            validate: agree ``batch_size`` and the local checks over ``comm`` first (one small
                collective; benchmarks pass False after a validated step).

        Returns:
            The batch loss on the last rank, ``None`` elsewhere.

        Raises:
            ValueError: on every rank (with ``validate``): ``x`` missing or of the wrong batch
                size on rank 0, no ``loss_fn`` on the last rank, ``batch_size < M``.
        """
        first, last, r = self.rank == 0, self.rank == self.P - 1, self.rank
        if validate:
            err = None
            if first and (x is None or x.shape[0] != batch_size):
                err = f"x must be a tensor with batch_size={batch_size} rows on rank 0"
            elif last and loss_fn is None:
                err = "loss_fn is required on the last rank"
            elif not isinstance(batch_size, int) or batch_size < self.M:
                err = f"batch_size={batch_size!r} must be an int >= micro_batches={self.M}"
            raise_agreed(self.comm, err, same=batch_size, what="batch_size")
        sizes = micro_batch_sizes(batch_size, self.M)
        offs = [sum(sizes[:j]) for j in range(self.M)]
        st, reqs, outs, keep, total = self.stage, [], {}, [], 0.0
        st.zero_grad()
        for j, n in enumerate(sizes):  # forward of every micro-batch (fill + steady state)
            xin = x[offs[j]:offs[j] + n] if first else self._recv(("f", j), (n, *st.in_shape), r - 1, j)
            y = st.forward(xin, j)
            if last:
                outs[j] = y
            else:
                keep.append(_np(y))
                reqs.append(self.comm.Isend(keep[-1], r + 1, j))
        for j in range(self.M - 1, -1, -1):  # backward, last micro-batch first (drain)
            if last:
                o = outs.pop(j).detach().requires_grad_(True)
                loss = loss_fn(o, j, slice(offs[j], offs[j] + sizes[j]))
                loss.backward()
                total += float(loss.detach())
                g = o.grad
            else:
                g = self._recv(("b", j), self._out_shape(j, sizes[j]), r + 1, self.M + j)
            gx = st.backward(g, j)
            if not first:
                keep.append(_np(gx))
                reqs.append(self.comm.Isend(keep[-1], r - 1, self.M + j))
        MPI.Request.Waitall(reqs)
        return total if last else None

    def _out_shape(self, j: int, n: int) -> tuple:
        """Shape of this stage's output of micro-batch ``j`` (what the next stage sends back)."""
        st = self.stage
        if isinstance(st, LeanStage):
            return (n, st.net.width)
        return (n, *st._saved[j][1].shape[1:])


class LeanDataParallel:
    """Data parallelism over ``comm`` with a :class:`LeanResNet` replica per rank: each rank
    trains on its shard of the global batch (loss ``mean(out^2)`` over the global batch), the
    gradients are summed by one in-place ``Allreduce`` of the flat gradient buffer, then every
    replica takes the same SGD step (replicas stay identical)."""

    def __init__(self, net: LeanResNet, comm: MPI.Comm):
        self.net, self.comm = net, comm

    def train_step(self, x_local: torch.Tensor, global_numel: int, lr: float) -> torch.Tensor:
        """``x_local``: this rank's shard ``(b_r, w)``; ``global_numel``: elements of the global
        output (``global_batch * w``, the loss's mean). Returns this rank's output buffer."""
        net = self.net
        out = net.forward_store(x_local)
        g = net.buffers(x_local.shape[0])["u"]
        torch.mul(out, 2.0 / global_numel, out=g)
        net.backward(g)
        if self.comm.Get_size() > 1:
            self.comm.Allreduce(MPI.IN_PLACE, net.grad_flat.numpy(), op=MPI.SUM)
        net.sgd_step(lr)
        return out
