"""The GRU hidden-state recurrence as a time chain for MGRIT, forward and adjoint.

A GRU over a sequence ``x_0 .. x_{N-1}`` is the chain ``h_{t+1} = Phi_t(h_t)``, ``t = 0..N-1``,
with PyTorch's ``nn.GRUCell`` (gates ordered r, z, n in the stacked weights)::

    r = sigmoid(W_ir x_t + b_ir + W_hr h + b_hr)
    z = sigmoid(W_iz x_t + b_iz + W_hz h + b_hz)
    n = tanh(W_in x_t + b_in + r * (W_hn h + b_hn))
    h' = (1 - z) * n + z * h  =  n + w * (h - n),   w = z.

This is forward Euler with step 1 of ``dh/dt = (1 - z)(n - h)`` (Moon & Cyr, "Parallel training
of GRU networks with a multi-grid solver for long sequences", ICLR 2022, write the GRU as this
ODE). The input projections ``W_i x_t + b_i`` do not depend on ``h``: they are computed for a
rank's whole time slice in one matmul (as ``nn.GRU`` does on CPU) and passed in as ``gi``.

**Coarse propagator.** An interval of level ``l`` spans ``dt = stop - start`` fine steps and is
evaluated with the gates of its first step (the C-point's input ``x_start`` and state), in the
form ``h' = n + w(z, dt) (h - n)`` -- a convex combination of ``h`` and ``n`` for every ``dt``,
so no coarse step can blow up. Two choices of the weight on ``h``:

* ``"power"`` (default): ``w = z ** dt``, the exact result of ``dt`` fine steps with the gates
  and ``n`` frozen (``h_{k+1} - n = z (h_k - n)``). Equals the fine step at ``dt = 1``.
* ``"implicit"``: ``w = 1 / (1 + dt (1 - z))``, the linearly implicit Euler step of the ODE,
  ``h' = (h + dt (1 - z) n) / (1 + dt (1 - z))`` -- the "implicit GRU" of Moon & Cyr, used
  there on every level (TorchBraid's GRU example). Here only on coarse levels, so that the fine
  level stays ``nn.GRUCell`` exactly; at ``dt = 1`` it would differ from ``nn.GRUCell``.

"power" is the default because it is consistent with the fine step for every ``dt`` (the
frozen-coefficient solution of the fine recurrence, where "implicit" only approximates
``1 - z^dt`` by ``dt(1-z)/(1+dt(1-z))``, an O(dt^2 (1-z)^2) error); the measured convergence
factors are in ``ParallelGRU``'s docstring. The exact solution (the MGRIT fixed point) does not
depend on the coarse propagator.

**Adjoint.** With ``lam_t = dL/dh_t`` and the direct loss gradient ``s_t`` of the output
``out_t = h_{t+1}`` (zero when only the final state is used), ``nu_t = J_t^T (nu_{t+1} + s_t)``
with ``nu_N = dL/dh_N`` and ``J_t = dPhi_t/dh (h_t)``, solved over the reversed index
``i = N - t`` by the same MGRIT; every step is one closed-form vector-Jacobian product of the
cell (no autograd graph), the coarse adjoint step the VJP of the coarse forward step of the
layer adjacent to that point (the reversed chain's own rediscretization, as in
:mod:`mgrit.nn.chains`).

Concurrent relaxation: the hidden projection has the same weight at every ``t``, so the steps
of ``B`` intervals are one matmul over ``(B * batch, hidden)`` and one pass of elementwise ops.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.nn import functional as F

from ...propagator import Propagator

__all__ = ["GRUChain", "GRUAdjointChain", "COARSE_PROPAGATORS", "gru_gates", "gru_vjp"]

COARSE_PROPAGATORS = ("power", "implicit")


def gru_gates(gi: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor | None):
    """Gates of the GRU cell in ``nn.GRUCell``'s operation order (bitwise the same values).

    Args:
        gi: input projections ``W_ih x + b_ih``, ``(..., 3H)``.
        h: hidden states ``(..., H)`` (same leading dims as ``gi``).
        w_hh: ``(3H, H)``; b_hh: ``(3H,)`` or ``None``.

    Returns:
        ``(r, z, n, hn)``, each ``(..., H)``; ``hn = W_hn h + b_hn`` (needed by the VJP).
    """
    gh = F.linear(h, w_hh, b_hh)
    i_r, i_z, i_n = gi.chunk(3, -1)
    h_r, h_z, h_n = gh.chunk(3, -1)
    r = torch.sigmoid(h_r + i_r)
    z = torch.sigmoid(h_z + i_z)
    n = torch.tanh(i_n + h_n * r)
    return r, z, n, h_n


def _weight(z: torch.Tensor, dt, coarse: str):
    """``w(z, dt)`` (weight on ``h``) and ``dw/dz``; ``dt`` an int or a broadcastable tensor."""
    if isinstance(dt, int) and dt == 1:
        return z, None  # the fine step: w = z, dw/dz = 1
    if coarse == "power":  # z^1 = z: consistent with the fine step for any dt
        return z.pow(dt), dt * z.pow(dt - 1)
    w = 1.0 / (1.0 + dt * (1.0 - z))
    dw = dt * w * w
    if isinstance(dt, torch.Tensor):  # mixed spans: the fine step wherever dt == 1
        fine = dt == 1
        w, dw = torch.where(fine, z, w), torch.where(fine, torch.ones_like(dw), dw)
    return w, dw


def _combine(h, n, w):
    """``n + w (h - n)`` in ``nn.GRUCell``'s order ``(h - n) * w + n``."""
    return (h - n) * w + n


def gru_vjp(v: torch.Tensor, h: torch.Tensor, gates, w_hh: torch.Tensor, dt=1,
            coarse: str = "power", need_gates: bool = False):
    """Closed-form VJP of ``h' = n + w(z, dt) (h - n)`` at ``h`` with cotangent ``v``.

    Args:
        v: ``dL/dh'``, ``(..., H)``.
        h: the state the step started from, ``(..., H)``.
        gates: ``(r, z, n, hn)`` of :func:`gru_gates` at ``h``.
        w_hh: ``(3H, H)``.
        dt: fine steps spanned (1 = the GRU cell itself).
        coarse: the coarse weight (see module doc).
        need_gates: also return the cotangents of the hidden and input projections.

    Returns:
        ``dL/dh`` ``(..., H)``; with ``need_gates`` also ``(dgh, dgi)``, each ``(..., 3H)``
        (``dgh`` w.r.t. ``W_hh h + b_hh``, ``dgi`` w.r.t. ``W_ih x + b_ih``).
    """
    r, z, n, hn = gates
    w, dw = _weight(z, dt, coarse)
    dz = v * (h - n)
    if dw is not None:
        dz = dz * dw
    da_z = dz * z * (1 - z)
    da_n = v * (1 - w) * (1 - n * n)
    da_r = da_n * hn * r * (1 - r)
    dgh = torch.cat((da_r, da_z, da_n * r), -1)
    dh = torch.addmm((v * w).reshape(-1, h.shape[-1]), dgh.reshape(-1, dgh.shape[-1]),
                     w_hh).reshape(h.shape)
    if need_gates:
        return dh, dgh, torch.cat((da_r, da_z, da_n), -1)
    return dh


def _dt(starts, stops, like: torch.Tensor):
    """Step spans of a batched call: an int when all are equal (the solver's calls), else a
    tensor broadcastable against ``(B, batch, H)``."""
    if isinstance(starts, range) and isinstance(stops, range) and starts.step == stops.step:
        return stops.start - starts.start
    spans = [int(b) - int(a) for a, b in zip(starts, stops)]
    if len(set(spans)) == 1:
        return spans[0]
    return torch.as_tensor(spans, dtype=like.dtype, device=like.device).view(-1, 1, 1)


class GRUChain(Propagator):
    """Forward GRU chain over the time steps ``first .. first + len(gi) - 1`` of this rank.

    Args:
        gi: input projections ``W_ih x_t + b_ih`` of the local steps, ``(n_local, batch, 3H)``;
            row ``j`` belongs to step ``first + j``.
        w_hh: hidden weight ``(3H, H)``; b_hh: ``(3H,)`` or ``None`` -- detached tensors.
        first: global index of the first local step.
        coarse: ``"power"`` or ``"implicit"`` (module doc).

    States are ``(batch, H)``; ``step`` on a fine interval is ``nn.GRUCell`` bit for bit (given
    the same ``gi``). Raises ValueError for an unknown ``coarse``.
    """

    def __init__(self, gi: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor | None,
                 first: int, coarse: str = "power"):
        if coarse not in COARSE_PROPAGATORS:
            raise ValueError(f"coarse={coarse!r} is not allowed: use one of {COARSE_PROPAGATORS}")
        self.gi, self.w_hh, self.b_hh = gi, w_hh, b_hh
        self.first, self.coarse = int(first), coarse

    def _rows(self, starts):
        if isinstance(starts, range) and starts.step > 0:
            return self.gi[starts.start - self.first:starts.stop - self.first:starts.step]
        idx = torch.as_tensor([int(s) - self.first for s in starts], device=self.gi.device)
        return self.gi.index_select(0, idx)

    def step(self, u, start, stop, level):
        _, z, n, _ = gru_gates(self.gi[start - self.first], u, self.w_hh, self.b_hh)
        w, _ = _weight(z, stop - start, self.coarse)
        return _combine(u, n, w)

    def step_batch(self, u, starts: Sequence[int], stops: Sequence[int], level):
        _, z, n, _ = gru_gates(self._rows(starts), u, self.w_hh, self.b_hh)
        w, _ = _weight(z, _dt(starts, stops, u), self.coarse)
        return _combine(u, n, w)

    def sweep(self, states: torch.Tensor) -> torch.Tensor:
        """``Phi_t(h_t)`` for all local steps at once; ``states`` ``(n_local, batch, H)``."""
        return self.step_batch(states, range(self.first, self.first + len(states)),
                               range(self.first + 1, self.first + len(states) + 1), 0)


class GRUAdjointChain(Propagator):
    """Adjoint of :class:`GRUChain` over the reversed index ``i = N - t``, linearized at the
    forward states of this rank: the step from reversed point ``i`` is
    ``nu -> J_k^T (nu + s_k)`` for the layer ``k = N - 1 - i`` (on coarse levels the VJP of the
    coarse forward step of layer ``k`` with ``dt = stop - start``).

    Args:
        forward: the forward chain (its ``gi``, weights, ``first`` and ``coarse``).
        n_steps: ``N``, the sequence length.
        states: forward states ``h_t`` of the local steps, ``(n_local, batch, H)``.
        sources: direct gradients ``s_k = dL/d out_k`` of the local outputs, same shape, or
            ``None`` (only the final state enters the loss).
    """

    def __init__(self, forward: GRUChain, n_steps: int, states: torch.Tensor,
                 sources: torch.Tensor | None = None):
        self.fwd, self.n = forward, int(n_steps)
        gates = gru_gates(forward.gi[:len(states)], states, forward.w_hh, forward.b_hh)
        # everything in reversed order (row q = reversed point q + off), computed once per
        # adjoint solve: the solver's strided ranges of reversed points are then plain slices
        self.off = self.n - forward.first - len(states)
        self.states = states.flip(0)
        self.sources = None if sources is None else sources.flip(0)
        self.gates = tuple(g.flip(0) for g in gates)

    def _rows(self, starts):
        if isinstance(starts, range) and starts.step > 0:
            return slice(starts.start - self.off, starts.stop - self.off, starts.step)
        return torch.as_tensor([int(s) - self.off for s in starts], device=self.states.device)

    def step(self, mu, start, stop, level):
        q = start - self.off
        cot = mu if self.sources is None else mu + self.sources[q]
        return gru_vjp(cot, self.states[q], tuple(g[q] for g in self.gates), self.fwd.w_hh,
                       stop - start, self.fwd.coarse)

    def step_batch(self, mu, starts, stops, level):
        q = self._rows(starts)
        take = (lambda t: t[q]) if isinstance(q, slice) else (lambda t: t.index_select(0, q))
        cot = mu if self.sources is None else mu + take(self.sources)
        return gru_vjp(cot, take(self.states), tuple(take(g) for g in self.gates),
                       self.fwd.w_hh, _dt(starts, stops, mu), self.fwd.coarse)

    def gate_gradients(self, nu_next: torch.Tensor):
        """Cotangents of the projections of every local step, one batched call.

        Args:
            nu_next: ``(n_local, batch, H)``, row ``j`` is ``nu_{first + j + 1}``.

        Returns:
            ``(dgh, dgi)``, each ``(n_local, batch, 3H)`` in forward order (row ``j`` = step
            ``first + j``): gradients w.r.t. ``W_hh h_t + b_hh`` and ``W_ih x_t + b_ih``
            (parameter and input gradients follow by one matmul each).
        """
        nu = nu_next.flip(0)
        cot = nu if self.sources is None else nu + self.sources
        _, dgh, dgi = gru_vjp(cot, self.states, self.gates, self.fwd.w_hh, need_gates=True)
        return dgh.flip(0), dgi.flip(0)
