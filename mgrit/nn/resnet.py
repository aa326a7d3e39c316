"""Layer-parallel ResNet: MGRIT forward solve, adjoint-MGRIT backward, ordinary autograd outside.

``x_{k+1} = x_k + h F_k(x_k)``, ``k = 0..N-1``, ``h = T / N``; each rank of the layer
communicator holds a contiguous block of layers (:class:`mgrit.grid.Partition`). Autograd
bridge after TorchBraid's ``braid_function.py``: the whole chain is one
``torch.autograd.Function`` whose forward is an MGRIT solve and whose backward is an MGRIT
solve of the adjoint chain (Guenther et al. 2020, SIMODS) followed by one parallel sweep of
parameter vector-Jacobian products, so optimizers see ordinary ``.grad`` on every rank.

Every rank of the layer communicator calls ``forward`` and ``backward``; the final state
exists on the last layer rank, the input gradient on the first. Exact mode (iterate to a
tolerance) reproduces serial backpropagation; inexact mode (fixed small iteration counts,
``tol = 0``; TorchBraid: 2 forward / 1 backward) is how training gets fast, with a warm start
from the previous batch's states. ``adjoint="serial"`` is Kirby et al.'s variant: MGRIT
forward, the backward chain swept serially across ranks (a one-level adjoint solve).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from mpi4py import MPI
from torch import nn

from ..comm import raise_agreed
from ..grid import Partition
from ..options import MGRITOptions
from ..solver import MGRIT
from .chains import AdjointChain, ForwardChain
from .steps import ResidualStep

__all__ = ["LayerParallelResNet", "serial_resnet", "layer_seed"]

_UNSUPPORTED = (nn.modules.batchnorm._BatchNorm, nn.Dropout, nn.Dropout2d, nn.AlphaDropout)


def layer_seed(seed: int, k: int) -> int:
    """Seed of layer ``k``'s initialization, so every partition builds identical weights."""
    return (int(seed) * 1_000_003 + int(k)) % (2 ** 63)


def serial_resnet(make_step: Callable[[int], nn.Module], n_layers: int, T: float = 1.0,
                  seed: int = 0) -> nn.Sequential:
    """The serial reference: ``nn.Sequential`` of ``ResidualStep(make_step(k), T/N)`` with the
    same per-layer seeds as :meth:`LayerParallelResNet.build`."""
    layers = []
    for k in range(n_layers):
        torch.manual_seed(layer_seed(seed, k))
        layers.append(ResidualStep(make_step(k), T / n_layers))
    return nn.Sequential(*layers)


class _MGRITFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, model, x0, *params):
        ctx.model = model
        return model._forward_solve(x0)

    @staticmethod
    def backward(ctx, grad):
        gx0, pgrads = ctx.model._backward_solve(grad)
        return (None, gx0, *pgrads)


class LayerParallelResNet(nn.Module):
    """This rank's block of a forward-Euler ResNet, solved layer-parallel by MGRIT.

    Args:
        steps: the step modules ``F_k`` of this rank's layers ``first .. first+len(steps)-1``
            (see :meth:`build`, which creates them for the default partition). Each maps a
            state ``(batch, *state_shape)`` to the same shape. BatchNorm and Dropout are not
            supported yet (repeated sweeps would update statistics / redraw masks): ValueError.
        n_layers: ``N``, the global number of residual layers (``>= P``).
        state_shape: shape of one sample's state, e.g. ``(width,)`` or ``(C, H, W)``.
        T: final time (default 1.0); ``h = T / N``.
        comm: layer-parallel communicator (default ``COMM_SELF``).
        forward, backward: :class:`~mgrit.options.MGRITOptions` of the forward and adjoint
            solves (defaults: 2 levels, cfactor 4, exact to 1e-10 abs / 50 cycles).
            For inexact training use ``tol=0`` with ``max_iter`` 2 (forward) / 1 (backward).
        adjoint: ``"mgrit"`` (default) or ``"serial"`` (Kirby et al. 2020: serial sweep
            across ranks, exact adjoint of the MGRIT-approximate forward states).
        warm_start: start each forward solve from the previous training forward's states (same
            batch shape). Default ``None``: on when ``forward.tol == forward.rtol == 0``.
            Forwards under ``torch.no_grad()`` (evaluation) use but never replace them.
        warm_start_adjoint: start each adjoint solve from the previous one's adjoints
            (Guenther et al.'s simultaneous training warm-starts both directions; default
            False, as TorchBraid).
        partition: layer ownership (default :meth:`Partition.even`).

    Attributes:
        first: global index of this rank's first layer. ``is_first``/``is_last``: whether this
        rank holds layer 0 / layer N-1. ``last_forward``/``last_backward``: the
        :class:`~mgrit.solver.MGRITResult` of the latest solves (residual history, stats).
    """

    def __init__(self, steps: Sequence[nn.Module], n_layers: int, state_shape, T: float = 1.0,
                 comm: MPI.Comm | None = None, forward: MGRITOptions | None = None,
                 backward: MGRITOptions | None = None, adjoint: str = "mgrit",
                 warm_start: bool | None = None, partition: Partition | None = None,
                 warm_start_adjoint: bool = False):
        super().__init__()
        self.comm = MPI.COMM_SELF if comm is None else comm
        P, rank = self.comm.Get_size(), self.comm.Get_rank()
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers={n_layers!r} is not allowed: use an int >= 1")
        if isinstance(T, bool) or not isinstance(T, (int, float)) or not math.isfinite(T) or T <= 0:
            raise ValueError(f"T={T!r} is not allowed: use a finite number > 0")
        if adjoint not in ("mgrit", "serial"):
            raise ValueError(f"adjoint={adjoint!r} is not allowed: use 'mgrit' or 'serial'")
        for name, o in (("forward", forward), ("backward", backward)):
            if o is not None and not isinstance(o, MGRITOptions):
                raise ValueError(f"{name}={o!r} is not allowed: use MGRITOptions or None")
        try:
            shape = torch.Size(state_shape)
        except TypeError:
            shape = None
        if shape is None or any(d < 1 for d in shape):
            raise ValueError(f"state_shape={state_shape!r} is not allowed: use a tuple of "
                             f"positive ints (one sample's state, without the batch dimension)")
        self.partition = Partition.even(n_layers, P) if partition is None else partition
        a, b = self.partition.block(rank)
        self.first, n_local = a, min(b, n_layers) - a
        # checks of this rank's modules: agreed by all ranks (same message everywhere)
        error = None
        if len(steps) != n_local:
            error = (f"holds layers {a}..{a + n_local - 1} ({n_local}) but got {len(steps)} "
                     f"step modules")
        bad = [(a + k, type(m).__name__) for k, s in enumerate(steps) for m in s.modules()
               if isinstance(m, _UNSUPPORTED)]
        if error is None and bad:
            error = (f"layer {bad[0][0]} contains {bad[0][1]}, which is not supported in "
                     f"layer-parallel steps yet (statistics/masks would change across MGRIT "
                     f"sweeps); remove it")
        raise_agreed(self.comm, error)
        self.steps = nn.ModuleList(steps)
        self._params = list(self.steps.parameters())  # autograd inputs (fixed set of tensors)
        self.n_layers, self.T, self.h = n_layers, float(T), float(T) / n_layers
        self.state_shape = shape
        self.fwd_opts = forward or MGRITOptions(max_levels=2, cfactor=4, tol=1e-10, max_iter=50)
        self.bwd_opts = backward or MGRITOptions(max_levels=2, cfactor=4, tol=1e-10, max_iter=50)
        if adjoint == "serial":
            self.bwd_opts = MGRITOptions(max_levels=1)
        self.adjoint = adjoint
        inexact = self.fwd_opts.tol == 0 and self.fwd_opts.rtol == 0
        self.warm_start = inexact if warm_start is None else bool(warm_start)
        p = next(self.steps[0].parameters(), None) if len(self.steps) else None
        self.dtype = p.dtype if p is not None else torch.get_default_dtype()
        self.device = p.device if p is not None else torch.device("cpu")
        self.is_first, self.is_last = a == 0, min(b, n_layers) == n_layers
        self._chain = ForwardChain(self.steps, a, self.h, batched=self.fwd_opts.batched)
        kw = dict(dtype=self.dtype, device=self.device, comm=self.comm)
        self._fsolver = MGRIT(self._chain, n_layers, options=self.fwd_opts,
                              partition=self.partition, **kw)
        self._bsolver = MGRIT(self._chain, n_layers, options=self.bwd_opts,
                              partition=self.partition.reversed(), **kw)
        self.warm_start_adjoint = bool(warm_start_adjoint)
        self._warm = self._warm_adj = None
        self._states = None
        self.last_forward = self.last_backward = None

    @classmethod
    def build(cls, make_step: Callable[[int], nn.Module], n_layers: int, state_shape,
              comm: MPI.Comm | None = None, seed: int = 0, **kwargs) -> "LayerParallelResNet":
        """Create this rank's layers with ``make_step(k)`` (seeded by :func:`layer_seed`, so the
        weights do not depend on the number of ranks) and wrap them."""
        comm = MPI.COMM_SELF if comm is None else comm
        part = kwargs.pop("partition", None) or Partition.even(n_layers, comm.Get_size())
        a, b = part.block(comm.Get_rank())
        steps = []
        for k in range(a, min(b, n_layers)):
            torch.manual_seed(layer_seed(seed, k))
            steps.append(make_step(k))
        return cls(steps, n_layers, state_shape, comm=comm, partition=part, **kwargs)

    # -- autograd bridge ----------------------------------------------------------------
    def forward(self, x0: torch.Tensor | None = None, batch_size: int | None = None) -> torch.Tensor:
        """MGRIT solve of all states.

        Args:
            x0: the input state ``(batch, *state_shape)`` on the first layer rank (may require
                grad); ignored elsewhere.
            batch_size: the batch size on ranks that do not hold ``x0``.

        Returns:
            ``x_N`` ``(batch, *state_shape)`` on the last layer rank; elsewhere an empty
            placeholder tensor connected to the parameters (call ``.sum().backward()`` on it,
            or on anything built from it, so that this rank joins the adjoint solve).
        """
        if self.is_first:
            if x0 is None:
                raise ValueError("x0 is required on the first layer rank")
            batch = x0.shape[0]
        else:
            if batch_size is None:
                raise ValueError("batch_size is required on ranks other than the first")
            batch, x0 = int(batch_size), torch.zeros(0, dtype=self.dtype, device=self.device)
        self._batch = batch
        self._update_warm = torch.is_grad_enabled()  # evaluation keeps the training warm start
        if not self._update_warm:  # no graph to build: skip the autograd bridge's overhead
            return self._forward_solve(x0)
        return _MGRITFunction.apply(self, x0, *self._params)

    def _forward_solve(self, x0):
        shape = torch.Size((self._batch, *self.state_shape))
        self._chain.refresh()
        guess = self._warm if (self.warm_start and self._warm is not None
                               and self._warm.shape[1:] == shape) else None
        res = self._fsolver.solve(x0.detach() if self.is_first else None, initial_guess=guess,
                                  state_shape=shape)
        self.last_forward, self._states = res, res.states
        if self.warm_start and self._update_warm:
            self._warm = res.states
        if self.is_last:
            return res.states[-1].clone()
        return torch.zeros(0, dtype=self.dtype, device=self.device)

    def _backward_solve(self, grad):
        shape = self._states.shape[1:]
        chain = AdjointChain(self._chain, self.n_layers, self._states)
        self._bsolver.propagator = chain
        lam_N = grad.detach().reshape(shape) if self.is_last else None
        guess = self._warm_adj if (self.warm_start_adjoint and self._warm_adj is not None
                                   and self._warm_adj.shape[1:] == shape) else None
        res = self._bsolver.solve(lam_N, initial_guess=guess, state_shape=shape)
        self.last_backward = res
        if self.warm_start_adjoint:
            self._warm_adj = res.states
        N, lo = self.n_layers, res.lo
        n_local = len(self.steps)
        # lambda_{k+1} for local layers k = first..first+n_local-1 is reversed point N-k-1
        rows = [N - (self.first + j) - 1 - lo for j in range(n_local)]
        lam_next = res.states[torch.as_tensor(rows, device=res.states.device)]
        batched = self.bwd_opts.batched and self.bwd_opts.max_levels > 1
        pgrads = chain.parameter_gradients(lam_next, batched)
        gx0 = res.states[N - lo].clone() if self.is_first else None
        return gx0, pgrads

    def _apply(self, fn, *args, **kwargs):
        """Keep the solvers' dtype/device in step with ``.to()``, ``.double()``, ``.cuda()``."""
        super()._apply(fn, *args, **kwargs)
        if self._params:
            self.dtype, self.device = self._params[0].dtype, self._params[0].device
            for solver in (self._fsolver, self._bsolver):
                solver.dtype, solver.device = self.dtype, self.device
        self._warm = self._warm_adj = None
        return self

    # -- utilities ----------------------------------------------------------------------
    def to_serial(self) -> nn.Sequential:
        """An equivalent plain ``nn.Sequential`` of all ``N`` residual layers with copies of
        the current weights, on every rank (collective; usable without MPI afterwards)."""
        pieces = self.comm.allgather([(self.first + j, s) for j, s in enumerate(self.steps)])
        layers = sorted((k, s) for piece in pieces for k, s in piece)
        import copy
        return nn.Sequential(*[ResidualStep(copy.deepcopy(s), self.h) for _, s in layers])

    def gather_state_dict(self, root: int = 0) -> dict | None:
        """All layers' weights under global keys ``"{k}.{name}"`` on ``root`` (collective)."""
        local = {f"{self.first + j}.{n}": t.detach().cpu().clone()
                 for j, s in enumerate(self.steps) for n, t in s.state_dict().items()}
        parts = self.comm.gather(local, root=root)
        return None if parts is None else {k: v for p in parts for k, v in p.items()}

    def load_global_state_dict(self, state: dict | None, root: int = 0) -> None:
        """Inverse of :meth:`gather_state_dict`: ``state`` on ``root`` is scattered and each
        rank loads its layers (collective). Raises KeyError naming a missing layer."""
        state = self.comm.bcast(state, root=root)
        for j, s in enumerate(self.steps):
            k = self.first + j
            mine = {n: state[f"{k}.{n}"] for n in s.state_dict()}
            s.load_state_dict(mine)
