"""GRU parallel in time: the hidden-state recurrence solved by MGRIT over the sequence dimension.

Moon & Cyr, "Parallel training of GRU networks with a multi-grid solver for long sequences"
(ICLR 2022): the GRU over a long sequence is a time chain ``h_{t+1} = GRUCell(x_t, h_t)``;
its forward solve is nonlinear FAS-MGRIT over the time steps, distributed over the ranks of a
time communicator, and its gradient an adjoint MGRIT solve over the reversed chain followed by
one parallel sweep of local vector-Jacobian products (the chains: :mod:`mgrit.nn.gru.chains`).
Unlike their "implicit GRU", the fine level here is PyTorch's ``nn.GRUCell`` exactly, so exact
mode reproduces ``nn.GRU`` training; only the coarse levels use a rediscretized step.

Every rank holds the same parameters (those of ``nn.GRUCell``) and the time steps of its slice
(:meth:`ParallelGRU.time_slice`); each rank's parameter gradient is the sum over its steps,
summed over the time communicator by one ``Allreduce``, so every replica gets the full serial
gradient and stays identical under any optimizer. Each forward in grad mode is one autograd node
that owns everything its backward needs (:mod:`mgrit.nn.gru.bridge`, built as the layer-parallel
ResNet's :mod:`mgrit.nn.resnet.bridge`), and each backward is agreed over the ranks first
(:func:`mgrit.nn.chains.agreement.agree_backward`).

Measured (float64, batch 8, input 4, hidden 16, N = 512, default init, 1 rank): residual
convergence factors, coarse ``"power"`` vs ``"implicit"``: m = 4, 2 levels, FCF 0.023 vs 0.067;
F 0.29 vs 0.54; m = 8, 3 levels, FCF 0.004 vs 0.009. With weights 3x the default init,
F-relaxation diverges (factor > 1) for both and FCF converges (0.19-0.35): use FCF.
Trained weights can converge much more slowly: a GRU trained on the adding problem (T = 64,
hidden 16) reduced the residual only about 5x per FCF cycle (m = 4), and inexact training
(2 forward / 1 backward cycles) reached test MSE 0.034 where serial training reached 0.0013
(constant baseline 0.167). Evaluate inexact models with a tolerance, not 2 cycles.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence

from ...comm import raise_agreed
from ...grid import Partition
from ...options import MGRITOptions
from ...solver import MGRIT
from ..chains.transforms import compile_disabled, transform_error
from .bridge import GRUFunction
from .chains import COARSE_PROPAGATORS, GRUChain

__all__ = ["ParallelGRU"]

_DTYPES = (torch.float32, torch.float64)


class ParallelGRU(nn.Module):
    """A one-layer GRU (``nn.GRUCell`` recurrence, ``batch_first``) solved parallel in time.

    Args:
        input_size: features per time step ``I`` (int >= 1).
        hidden_size: hidden state size ``H`` (int >= 1).
        comm: time communicator (default ``COMM_SELF``); every rank of it calls every method.
        forward, backward: :class:`~mgrit.options.MGRITOptions` of the forward and adjoint
            solves. Default (both): 2 levels, cfactor 4, FCF, ``tol=1e-10``, ``max_iter=50`` --
            exact mode. Inexact (fast) training: ``tol=0`` with ``max_iter`` 2 / 1.
        warm_start: start each training forward from the previous training forward's states
            (same batch and sequence shape). Default ``None``: on when ``forward.tol ==
            forward.rtol == 0`` and nested iteration is off. Forwards under ``no_grad`` use but
            never replace them.
        bias: learnable ``bias_ih``/``bias_hh`` (default True), as ``nn.GRUCell``.
        coarse: coarse propagator, ``"power"`` (default) or ``"implicit"``
            (:mod:`mgrit.nn.gru.chains`).

    Parameters ``weight_ih (3H, I)``, ``weight_hh (3H, H)``, ``bias_ih (3H)``, ``bias_hh (3H)``
    have ``nn.GRUCell``'s names, shapes, gate order (r, z, n) and default initialization
    ``U(-1/sqrt(H), 1/sqrt(H))`` drawn in the same order; rank 0's values are broadcast at
    construction (as DDP does), so the replicas agree whatever each rank's RNG state.

    Raises:
        ValueError: bad sizes, options, ``warm_start`` together with nested iteration, or an
            unknown ``coarse`` -- on every rank (agreed before the parameter broadcast).

    Autograd: each forward in grad mode is one autograd node owning its forward states, so
    every pattern of serial autograd works: several forwards before one backward, gradient
    accumulation (F1 B1 F2 B2 or F1 F2 B1 B2), ``torch.autograd.grad``, ``retain_graph=True``,
    evaluation forwards under ``no_grad`` in between, ``torch.utils.checkpoint`` (both modes;
    the recomputed solve then starts from the latest warm start, so in inexact mode its
    states may differ from the first solve's by the solver's inexactness). Every rank must
    backpropagate the same forwards (each backward is a collective adjoint solve and one
    ``Allreduce``); the autograd engine runs them in the same order on every rank (ready nodes
    by descending creation order), and one small agreement per backward turns ranks
    backpropagating different forwards, or a failed check on one rank, into the same
    RuntimeError on every rank. In grad mode the outputs always require grad (also with every
    parameter frozen), so that every rank takes part. A tensor the backward needs changed in
    place between forward and backward (``weight_hh``; ``weight_ih`` when ``x`` requires grad;
    ``x`` when ``weight_ih`` does -- as serial ``nn.GRUCell``), and a second backward without
    ``retain_graph``, raise autograd's RuntimeError on every rank. Frozen parameters
    (``requires_grad=False``) get no gradient and cost no work (no VJP, not in the
    ``Allreduce``; no adjoint solve when nothing requires grad); which parameters require grad
    must be the same on every rank (ValueError at the forward otherwise). Double backward
    (``create_graph=True``) is refused with a RuntimeError on every rank.

    Attributes:
        last_forward, last_backward: :class:`~mgrit.solver.MGRITResult` of the latest solves.
    """

    #: its weights are replicas on every time rank (summed there in backward): the network
    #: protocol's ``replicated_parameters`` lists them (:mod:`mgrit.nn.protocol`)
    replicated_weights = True

    def __init__(self, input_size: int, hidden_size: int, comm: MPI.Comm | None = None,
                 forward: MGRITOptions | None = None, backward: MGRITOptions | None = None,
                 warm_start: bool | None = None, bias: bool = True, coarse: str = "power"):
        super().__init__()
        self.comm = MPI.COMM_SELF if comm is None else comm
        exact = dict(max_levels=2, cfactor=4, relax="FCF", tol=1e-10, max_iter=50)
        error = None
        for name, v in (("input_size", input_size), ("hidden_size", hidden_size)):
            if error is None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                error = f"{name}={v!r} is not allowed: use an int >= 1"
        for name, o in (("forward", forward), ("backward", backward)):
            if error is None and o is not None and not isinstance(o, MGRITOptions):
                error = f"{name}={o!r} is not allowed: use MGRITOptions or None"
        if error is None and not isinstance(bias, bool):
            error = f"bias={bias!r} is not allowed: use True or False"
        if error is None and warm_start is not None and not isinstance(warm_start, bool):
            error = f"warm_start={warm_start!r} is not allowed: use True, False or None"
        if error is None and coarse not in COARSE_PROPAGATORS:
            error = f"coarse={coarse!r} is not allowed: use one of {COARSE_PROPAGATORS}"
        fwd = forward if isinstance(forward, MGRITOptions) else MGRITOptions(**exact)
        bwd = backward if isinstance(backward, MGRITOptions) else MGRITOptions(**exact)
        inexact = fwd.tol == 0 and fwd.rtol == 0
        if error is None and warm_start and fwd.nested_iteration:
            error = ("warm_start=True cannot be combined with forward.nested_iteration=True "
                     "(an initial guess replaces nested iteration): turn one off")
        raise_agreed(self.comm, error, same=(input_size, hidden_size, bias, coarse),
                     what="GRU configuration")
        self.input_size, self.hidden_size, self.bias, self.coarse = (input_size, hidden_size,
                                                                     bias, coarse)
        self.fwd_opts, self.bwd_opts = fwd, bwd
        self.warm_start = ((inexact and not fwd.nested_iteration) if warm_start is None
                           else warm_start)
        H = hidden_size
        self.weight_ih = nn.Parameter(torch.empty(3 * H, input_size))
        self.weight_hh = nn.Parameter(torch.empty(3 * H, H))
        if bias:
            self.bias_ih = nn.Parameter(torch.empty(3 * H))
            self.bias_hh = nn.Parameter(torch.empty(3 * H))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()
        self._warm = None
        self.last_forward = self.last_backward = None
        self._forward_count = 0  # numbers the forwards (the same on every rank: collective)
        self._token = torch.zeros(0, requires_grad=True)  # see GRUFunction

    def reset_parameters(self) -> None:
        """``nn.GRUCell``'s initialization, then rank 0's values broadcast to all ranks."""
        std = 1.0 / math.sqrt(self.hidden_size)
        with torch.no_grad():
            for p in self.parameters():
                p.uniform_(-std, std)
            if self.comm.Get_size() > 1:
                for p in self.parameters():
                    host = p.detach().cpu().contiguous()
                    self.comm.Bcast([host.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE], root=0)
                    p.copy_(host)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, bias={self.bias}, coarse={self.coarse!r}, "
                f"ranks={self.comm.Get_size()}")

    # -- partition --------------------------------------------------------------------------
    def time_slice(self, seq_len: int) -> tuple[int, int]:
        """Time steps ``[a, e)`` of this rank for a sequence of ``seq_len`` steps (it consumes
        ``x[:, a:e]`` and its sequence output holds ``h_{a+1} .. h_e``). Raises ValueError when
        ``seq_len`` < number of ranks."""
        a, b = Partition.even(int(seq_len), self.comm.Get_size()).block(self.comm.Get_rank())
        return a, min(b, seq_len)

    @property
    def is_last(self) -> bool:
        """True on the rank that holds the final hidden state (the last time rank)."""
        return self.comm.Get_rank() == self.comm.Get_size() - 1

    # -- validation -------------------------------------------------------------------------
    def _check(self, x, h0, return_sequence):
        """Local check of the call; returns ``(error or None, x as a tensor, unbatched)``."""
        P = self.comm.Get_size()
        w = self.weight_ih
        if isinstance(x, PackedSequence):
            return ("x is a PackedSequence, which is not supported (the parallel-in-time solve "
                    "has no mask for sequences of different lengths): pass a padded tensor "
                    "(batch, seq, input) of equal-length sequences"), None, False
        if isinstance(x, (list, tuple)):
            if not x or not all(isinstance(t, torch.Tensor) for t in x):
                return "x as a list must hold one tensor (seq, input) per sequence", None, False
            lengths = [t.shape[0] if t.dim() else 0 for t in x]
            if len(set(lengths)) > 1 or any(t.dim() != 2 for t in x):
                return (f"x is a list of sequences of unequal lengths {lengths} (or not 2-D): "
                        f"a batch must hold sequences of one length (no masks are supported); "
                        f"pad or bucket them by length"), None, False
            x = torch.stack(list(x))
        if not isinstance(x, torch.Tensor):
            return f"x must be a torch.Tensor, got {type(x).__name__}", None, False
        unbatched = x.dim() == 2
        if x.dim() not in (2, 3):
            return (f"x has shape {tuple(x.shape)}: use (batch, seq, input) or an unbatched "
                    f"(seq, input)"), x, unbatched
        if x.shape[-1] != self.input_size:
            return (f"x has input size {x.shape[-1]} but ParallelGRU was built with "
                    f"input_size={self.input_size}"), x, unbatched
        if x.dtype != w.dtype or x.device != w.device:
            return (f"x has dtype {x.dtype} on {x.device} but the parameters are {w.dtype} on "
                    f"{w.device}: convert one of them (dtypes {_DTYPES})"), x, unbatched
        if w.dtype not in _DTYPES:
            return f"parameter dtype {w.dtype} is not supported: use one of {_DTYPES}", x, unbatched
        seq = x.shape[-2]
        if seq < P:
            return (f"sequence length {seq} cannot be split over {P} time ranks: need seq >= "
                    f"ranks"), x, unbatched
        if x.dim() == 3 and x.shape[0] < 1:
            return "x has an empty batch", x, unbatched
        if h0 is not None:
            want = (self.hidden_size,) if unbatched else (x.shape[0], self.hidden_size)
            if not isinstance(h0, torch.Tensor) or tuple(h0.shape) != want:
                got = tuple(h0.shape) if isinstance(h0, torch.Tensor) else type(h0).__name__
                return (f"h0 has shape {got}; expected {want} (batch, hidden_size="
                        f"{self.hidden_size})"), x, unbatched
            if h0.dtype != w.dtype or h0.device != w.device:
                return (f"h0 has dtype {h0.dtype} on {h0.device} but the parameters are "
                        f"{w.dtype} on {w.device}"), x, unbatched
        if not isinstance(return_sequence, bool):
            return (f"return_sequence={return_sequence!r} is not allowed: use True or False", x,
                    unbatched)
        return None, x, unbatched

    # -- forward ----------------------------------------------------------------------------
    @compile_disabled  # torch.compile: a graph break, the solves run eagerly
    def forward(self, x: torch.Tensor | Sequence[torch.Tensor], h0: torch.Tensor | None = None,
                return_sequence: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the GRU over the sequence, parallel in time (every rank of ``comm``).

        Args:
            x: ``(batch, seq, input_size)`` (or unbatched ``(seq, input_size)``, or a list of
                equal-length ``(seq, input_size)`` tensors), the same on every rank; each rank
                uses its steps ``x[:, a:e]`` (:meth:`time_slice`). dtype and device of the
                parameters (float32 or float64). ``seq`` >= number of ranks, not necessarily
                divisible by it.
            h0: initial hidden state ``(batch, hidden_size)``; default zeros. Used on rank 0.
            return_sequence: also return this rank's slice of all hidden states.

        Returns:
            ``h_N`` ``(batch, hidden_size)`` on the last time rank; elsewhere an empty
            placeholder connected to the parameters (every rank must take part in the
            backward: call ``.sum().backward()`` on it, or on anything built from it). In
            grad mode both always require grad (see the class doc, Autograd). With
            ``return_sequence``: ``(h_N, out)`` where ``out`` ``(batch, e - a, hidden_size)``
            holds ``h_{t+1}`` for this rank's steps ``t = a .. e-1`` (``nn.GRU``'s output
            rows ``a .. e-1``).

        Gradients: parameters get the full serial gradient on every rank; ``x.grad`` is
        filled in this rank's rows ``a .. e-1`` (zeros elsewhere: sum over ranks for the
        whole); ``h0.grad`` on rank 0 (zeros elsewhere).

        Raises:
            ValueError: a PackedSequence, a list of unequal-length sequences, a wrong input or
                hidden size, a dtype or device other than the parameters', ``seq`` < ranks,
                ranks disagreeing on the shape or (grad mode) on which parameters require
                grad, a functorch transform or forward-mode AD
                (:mod:`mgrit.nn.chains.transforms`) -- on every rank, before the solve.
        """
        params = self._param_list()
        error = transform_error("ParallelGRU", itertools.chain((x, h0), params))
        xt = unbatched = None
        if error is None:  # (inside vmap the checks themselves would fail)
            error, xt, unbatched = self._check(x, h0, return_sequence)
        grad = torch.is_grad_enabled()
        flags = tuple(p.requires_grad for p in params) if grad else None
        raise_agreed(self.comm, error,
                     same=(tuple(xt.shape), flags) if error is None else None,
                     what="input shape (batch, seq, input) and which parameters require grad")
        if unbatched:
            xt = xt.unsqueeze(0)
            h0 = None if h0 is None else h0.unsqueeze(0)
        self._forward_count += 1
        if grad:
            h_last, seq = GRUFunction.apply(self, return_sequence, self._token, xt, h0, *params)
        else:  # evaluation: no node; uses but keeps the training warm start
            h_last, seq = self._forward_solve(xt, h0, return_sequence, update_warm=False)[:2]
        if unbatched:
            h_last = h_last.squeeze(0) if h_last.numel() else h_last
            seq = seq.squeeze(0) if return_sequence else seq
        return (h_last, seq) if return_sequence else h_last

    def _param_list(self) -> list[nn.Parameter]:
        """``weight_ih, weight_hh`` and, with ``bias``, ``bias_ih, bias_hh`` (autograd inputs)."""
        return [p for p in (self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
                if p is not None]

    def _solver(self, n: int, options: MGRITOptions, chain, reverse: bool) -> MGRIT:
        part = Partition.even(n, self.comm.Get_size())
        w = self.weight_hh
        return MGRIT(chain, n, options=options, comm=self.comm, dtype=w.dtype, device=w.device,
                     partition=part.reversed() if reverse else part)

    def _forward_solve(self, x, h0, want_seq: bool, update_warm: bool):
        """One forward solve: ``(h_last, seq, states, gi)`` with this rank's forward states
        ``h_a .. h_{e-1}`` ``(e - a, batch, H)`` and input projections ``(e - a, batch, 3H)``
        (what a backward needs besides the weights)."""
        batch, n = x.shape[0], x.shape[1]
        a, e = self.time_slice(n)
        w_hh = self.weight_hh.detach()
        b_hh = None if self.bias_hh is None else self.bias_hh.detach()
        with torch.no_grad():  # one matmul for the slice, in nn.GRU's layout and with the
            # tensors themselves: matmul's kernel choice depends on requires_grad, and this is
            # how nn.GRU computes it (bitwise the same input projections)
            gi = F.linear(x[:, a:e].transpose(0, 1), self.weight_ih, self.bias_ih)
        chain = GRUChain(gi, w_hh, b_hh, a, self.coarse)
        shape = torch.Size((batch, self.hidden_size))
        first = self.comm.Get_rank() == 0
        u0 = None
        if first:
            u0 = (torch.zeros(shape, dtype=w_hh.dtype, device=w_hh.device) if h0 is None
                  else h0.detach())
        warm = self._warm
        guess = warm if (self.warm_start and warm is not None and warm.shape[1:] == shape
                         and warm.shape[0] == e - a + (1 if e == n else 0)
                         and warm.dtype == w_hh.dtype and warm.device == w_hh.device) else None
        res = self._solver(n, self.fwd_opts, chain, False).solve(u0, initial_guess=guess,
                                                                 state_shape=shape)
        self.last_forward = res
        if self.warm_start and update_warm:
            self._warm = res.states
        states = res.states  # rows: points a .. e-1 (and N on the last rank)
        last = e == n
        kw = dict(dtype=w_hh.dtype, device=w_hh.device)
        h_last = states[-1].clone() if last else torch.zeros(0, **kw)
        seq = torch.zeros(0, **kw)  # a distinct tensor: the two outputs must not alias
        if want_seq:
            with torch.no_grad():
                rows = states[1:] if last else torch.cat(
                    (states[1:], chain.step(states[-1], e - 1, e, 0).unsqueeze(0)))
            seq = rows.transpose(0, 1).contiguous()
        return h_last, seq, states[:e - a], gi

    def _apply(self, fn, *args, **kwargs):
        """``.double()``, ``.to()``: drop the warm start (other dtype/device); the token follows
        the parameters' device."""
        super()._apply(fn, *args, **kwargs)
        self._warm = None
        self._token = torch.zeros(0, device=self.weight_hh.device, requires_grad=True)
        return self

    def to_gru(self) -> nn.GRU:
        """A serial ``nn.GRU(batch_first=True)`` with copies of these weights (no MPI needed):
        the reference, and the strongest serial baseline."""
        g = nn.GRU(self.input_size, self.hidden_size, bias=self.bias, batch_first=True)
        g = g.to(dtype=self.weight_ih.dtype, device=self.weight_ih.device)
        with torch.no_grad():
            g.weight_ih_l0.copy_(self.weight_ih)
            g.weight_hh_l0.copy_(self.weight_hh)
            if self.bias:
                g.bias_ih_l0.copy_(self.bias_ih)
                g.bias_hh_l0.copy_(self.bias_hh)
        return g
