"""The strongest serial and data-parallel baselines of the dense tanh ResNet (issue 34, item 2),
with the optimizer the compared job uses, for every study that claims a speed.

* :class:`LeanOptim` -- :class:`mgrit.perf.lean.LeanResNet` (stacked weights, preallocated
  buffers, closed-form backward) with a ``torch.optim`` optimizer (momentum SGD or Adam,
  ``foreach``) over its two stacked tensors: one update for all layers. Element-wise
  optimizers give the same numbers on the stacked (transposed) layout as on per-layer tensors.
  ``compiled=True``: the forward and backward ``torch.compile``'d in blocks
  (:func:`mgrit.perf.lean.compiled_train_step`), the same optimizer after it.
* :class:`LeanDataParallel` -- a :class:`LeanOptim` replica per rank on its shard of the batch
  (equal shards), one ``Allreduce`` (mpi4py) of the flat stacked gradient, then the optimizer;
  eager or compiled.
* :func:`optimizer` -- ``"sgd"`` (lr, momentum 0.9 by default: the main job's), ``"adam"``.

Loss: ``mean(out^2)`` over the global batch (the benchmarks' loss), float32 by default.
Pipelining baselines: :mod:`experiments.benchmarks.torch_pipeline`.
"""
from __future__ import annotations

import torch

from mgrit.perf.lean import COMPILE_ERRORS, LeanResNet, compiled_train_step

__all__ = ["OPTIMIZERS", "optimizer", "LeanOptim", "LeanDataParallel", "random_lean"]

OPTIMIZERS = ("sgd", "adam")


def optimizer(params, kind: str, lr: float, momentum: float = 0.9):
    """``torch.optim.SGD(momentum=momentum)`` or ``torch.optim.Adam`` with ``foreach=True`` over
    ``params``; ValueError for another ``kind``."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, foreach=True)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=True)
    raise ValueError(f"optimizer kind={kind!r} is not allowed: use one of {list(OPTIMIZERS)}")


def random_lean(N: int, width: int, T: float = 1.0, seed: int = 0,
                dtype=torch.float32) -> LeanResNet:
    """A dense tanh ResNet of ``N`` layers of width ``width`` (``h = T / N``), weights drawn as
    ``nn.Linear``'s default initialization with ``torch.manual_seed(seed)``."""
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / width ** 0.5
    W = (torch.rand(N, width, width, generator=g, dtype=dtype) * 2 - 1) * bound
    b = (torch.rand(N, width, generator=g, dtype=dtype) * 2 - 1) * bound
    return LeanResNet(W, b, T / N)


class LeanOptim:
    """The lean loop with a real optimizer over its stacked tensors.

    Args:
        net: the :class:`LeanResNet` (trained in place).
        kind, lr, momentum: :func:`optimizer`'s.
        compiled: compile forward + backward in blocks of ``block`` layers (``block`` must
            divide N); the first :meth:`step` compiles and may raise one of
            :data:`mgrit.perf.lean.COMPILE_ERRORS` (see :meth:`try_compiled`).
        grad_hook: ``hook(net)`` after the gradients are in ``net.grad_flat`` and before the
            update (data parallelism's Allreduce); default None.
        global_numel: the element count of the loss's mean (default: the batch's own).
        backend: torch.compile's backend when ``compiled`` (default inductor).
    """

    def __init__(self, net: LeanResNet, kind: str = "sgd", lr: float = 1e-3,
                 momentum: float = 0.9, compiled: bool = False, block: int = 16,
                 grad_hook=None, global_numel: int | None = None, backend: str = "inductor"):
        self.net, self.hook, self.numel = net, grad_hook, global_numel
        net.WT.grad, net.b.grad = net.gWT, net.gb  # views of grad_flat: no copy
        self.opt = optimizer([net.WT, net.b], kind, lr, momentum)
        self.compiled = None
        if compiled:
            if global_numel is not None:
                raise ValueError("compiled=True takes the loss's mean over the batch it is "
                                 "given: pass global_numel=None (data parallelism scales in "
                                 "grad_hook)")
            self.compiled = compiled_train_step(net, block, backend, grad_hook=grad_hook,
                                                update=lambda n, lr_: self.opt.step())

    def _loss_grad(self, out):
        return out * (2.0 / (self.numel or out.numel()))

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One training step on ``x`` ``(batch, width)``; returns the output (a buffer)."""
        if self.compiled is not None:
            return self.compiled(x, 0.0)
        net = self.net
        out = net.forward_store(x)
        net.backward(self._loss_grad(out))
        if self.hook is not None:
            self.hook(net)
        self.opt.step()
        return out

    @classmethod
    def try_compiled(cls, net: LeanResNet, x: torch.Tensor, **kw):
        """``(LeanOptim, note)`` compiled and warmed with one step on a throwaway copy of the
        weights' optimizer state (the weights themselves are restored), or ``(None, "does not
        compile here: ...")``."""
        saved = net.WT.clone(), net.b.clone()
        try:
            lo = cls(net, compiled=True, **kw)
            lo.step(x)
        except COMPILE_ERRORS as e:
            return None, f"does not compile here: {type(e).__name__}"
        finally:
            net.WT.copy_(saved[0])
            net.b.copy_(saved[1])
        lo.opt.state.clear()  # the warm-up step's momentum / moments
        return lo, "inductor, blocks of %d layers" % kw.get("block", 16)


class LeanDataParallel:
    """Data parallelism of :class:`LeanOptim` replicas over an mpi4py communicator: rank ``r``
    trains on rows ``tensor_split(batch, P)[r]`` (equal shards: ValueError otherwise at
    :meth:`step`), the stacked gradient summed by one ``Allreduce``; every replica applies the
    same update (replicas stay equal). ``compiled``: as :class:`LeanOptim` (each shard's mean,
    averaged over the ranks)."""

    def __init__(self, net: LeanResNet, comm, batch: int, kind: str = "sgd", lr: float = 1e-3,
                 momentum: float = 0.9, compiled: bool = False, block: int = 16):
        from mpi4py import MPI
        P = comm.Get_size()
        if batch % P:
            raise ValueError(f"batch {batch} is not divisible by {P} ranks: data parallelism "
                             f"here needs equal shards")
        self.comm, self.P, self.batch = comm, P, batch
        self.rows = torch.tensor_split(torch.arange(batch), P)[comm.Get_rank()]

        def allreduce(n):
            comm.Allreduce(MPI.IN_PLACE, n.grad_flat.numpy(), op=MPI.SUM)
            if compiled:
                n.grad_flat.mul_(1.0 / P)  # shard means -> the batch's mean
        self.inner = LeanOptim(net, kind, lr, momentum, compiled, block, allreduce,
                               None if compiled else batch * net.width)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One step on the global batch ``x`` (every rank passes the same); returns this
        rank's shard output."""
        if x.shape[0] != self.batch:
            raise ValueError(f"batch of {x.shape[0]} rows; this data parallelism was built "
                             f"for {self.batch}")
        return self.inner.step(x[self.rows].contiguous())
