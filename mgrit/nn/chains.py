"""Propagators that adapt residual step modules to the MGRIT solver.

Forward chain (layer ``k`` = fine interval ``k``): ``Phi(u) = u + (stop - start) h F_start(u)``:
the coarse propagator on level ``l`` reuses the C-point layer's parameters with the step
``m^l h`` (Guenther et al. 2020; Kirby et al. 2020; TorchBraid).

Adjoint chain, solved over the reversed index ``i = N - k`` (``mu_i = lambda_{N-i}``):
``lambda_k = (dPhi_k/dx (x_k))^T lambda_{k+1} = lambda_{k+1} + J_{F_k}(x_k)^T (h lambda_{k+1})``,
each step one vector-Jacobian product. The coarse adjoint step from reversed point ``i``
linearizes the layer adjacent to that point, ``k = N - 1 - i``, with the step ``(stop-start) h``
-- the reversed chain's own rediscretization; it lives on the rank that owns ``lambda_{k+1}``,
so no parameters ever cross ranks. The fixed point (the exact adjoint) does not depend on it.

Concurrent relaxation: ``step_batch`` stacks the parameters of the layers involved and applies
the step module once with ``torch.func.vmap`` over ``torch.func.functional_call`` (falls back
to a loop for modules ``vmap`` cannot batch).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from ..propagator import Propagator

__all__ = ["ForwardChain", "AdjointChain"]


class _Stacked:
    """Parameters and buffers of structurally identical modules, stacked along a new dim 0."""

    def __init__(self, steps: Sequence[nn.Module]):
        self.template = steps[0]
        names = [n for n, _ in steps[0].named_parameters()]
        bnames = [n for n, _ in steps[0].named_buffers()]
        self.ok = all([n for n, _ in s.named_parameters()] == names and
                      [n for n, _ in s.named_buffers()] == bnames and
                      all(p.shape == q.shape for p, q in zip(s.parameters(), steps[0].parameters()))
                      for s in steps)
        self.tensors = {}
        if self.ok:
            for n in names:
                self.tensors[n] = torch.stack([s.get_parameter(n).detach() for s in steps])
            for n in bnames:
                self.tensors[n] = torch.stack([s.get_buffer(n) for s in steps])

    def take(self, idx: torch.Tensor) -> dict:
        return {n: t.index_select(0, idx) for n, t in self.tensors.items()}


class ForwardChain(Propagator):
    """``u + (stop - start) * h * F_start(u)`` over the layers ``first .. first + len(steps) - 1``
    held by this rank.

    Args:
        steps: this rank's step modules, layer ``first + j`` is ``steps[j]``.
        first: global index of ``steps[0]``.
        h: fine step size ``T / N`` (float).
        batched: try ``vmap`` for :meth:`step_batch`.
    """

    def __init__(self, steps: Sequence[nn.Module], first: int, h: float, batched: bool = True):
        self.steps, self.first, self.h = list(steps), int(first), float(h)
        self._want_batched = batched
        self._stack: _Stacked | None = None

    def refresh(self) -> None:
        """Snapshot the current parameters for batched steps (call after every optimizer step)."""
        self._stack = _Stacked(self.steps) if self._want_batched and len(self.steps) > 1 else None

    @property
    def batched(self) -> bool:
        return self._stack is not None and self._stack.ok

    def step(self, u, start, stop, level):
        return u + ((stop - start) * self.h) * self.steps[start - self.first](u)

    def step_batch(self, u, starts, stops, level):
        if not self.batched:
            return super().step_batch(u, starts, stops, level)
        idx = torch.as_tensor([s - self.first for s in starts], device=u.device)
        dt = torch.as_tensor([(b - a) * self.h for a, b in zip(starts, stops)], dtype=u.dtype,
                             device=u.device).view(-1, *([1] * (u.dim() - 1)))
        tmpl = self._stack.template
        try:
            out = vmap(lambda p, x: functional_call(tmpl, p, (x,)))(self._stack.take(idx), u)
        except Exception:  # a module vmap cannot batch: remember and loop from now on
            self._stack = None
            return super().step_batch(u, starts, stops, level)
        return u + dt * out


class AdjointChain(Propagator):
    """Adjoint of :class:`ForwardChain` over the reversed index, linearized at the forward
    states of this rank.

    Args:
        forward: the forward chain (its steps, ``first`` and ``h`` are used).
        n_layers: ``N``, the global number of layers.
        states: forward states ``x_k`` for ``k = first .. first + len(steps) - 1`` (at least),
            shape ``(>= len(steps), *state_shape)``; row ``j`` is ``x_{first + j}``.
    """

    def __init__(self, forward: ForwardChain, n_layers: int, states: torch.Tensor):
        self.fwd, self.n, self.states = forward, int(n_layers), states
        self._vjp = {}

    @property
    def batched(self) -> bool:
        return self.fwd.batched

    def _layer(self, start: int) -> int:
        return self.n - 1 - start - self.fwd.first  # local index of the layer linearized

    def step(self, mu, start, stop, level):
        j = self._layer(start)
        fn = self._vjp.get(j)
        if fn is None:  # the linearization is reused by every MGRIT iteration of this solve
            with torch.enable_grad():
                _, fn = vjp(self.fwd.steps[j], self.states[j])
            self._vjp[j] = fn
        return mu + fn(((stop - start) * self.fwd.h) * mu)[0]

    def step_batch(self, mu, starts, stops, level):
        if not self.batched:
            return super().step_batch(mu, starts, stops, level)
        idx = torch.as_tensor([self._layer(s) for s in starts], device=mu.device)
        dt = torch.as_tensor([(b - a) * self.fwd.h for a, b in zip(starts, stops)],
                             dtype=mu.dtype, device=mu.device).view(-1, *([1] * (mu.dim() - 1)))
        tmpl = self.fwd._stack.template

        def one(p, x, c):
            return vjp(lambda xx: functional_call(tmpl, p, (xx,)), x)[1](c)[0]

        with torch.enable_grad():
            out = vmap(one)(self.fwd._stack.take(idx), self.states.index_select(0, idx), dt * mu)
        return mu + out

    def parameter_gradients(self, lam_next: torch.Tensor, batched: bool) -> list[torch.Tensor]:
        """``dL/dtheta_k = h * (dF_k/dtheta_k (x_k))^T lambda_{k+1}`` for every local layer.

        Args:
            lam_next: ``(n_local_layers, *state_shape)``, row ``j`` is ``lambda_{first+j+1}``.
            batched: one ``vmap`` over all local layers instead of a loop.

        Returns:
            gradients in the order of ``[p for s in steps for p in s.parameters()]``.
        """
        steps, h = self.fwd.steps, self.fwd.h
        cot = h * lam_next
        if batched and self.fwd.batched:
            tmpl, stack = self.fwd._stack.template, self.fwd._stack.tensors
            names = [n for n, _ in tmpl.named_parameters()]
            params = {n: stack[n] for n in names}
            buffers = {n: t for n, t in stack.items() if n not in params}

            def one(p, b, x, c):
                return vjp(lambda pp: functional_call(tmpl, {**pp, **b}, (x,)), p)[1](c)[0]

            with torch.enable_grad():
                g = vmap(one)(params, buffers, self.states[:len(steps)], cot)
            return [g[n][j] for j in range(len(steps)) for n in names]
        out = []
        with torch.enable_grad():
            for j, s in enumerate(steps):
                x = self.states[j].detach()
                ps = list(s.parameters())
                y = s(x)
                out.extend(torch.autograd.grad(y, ps, cot[j], allow_unused=True))
        return [g if g is not None else torch.zeros_like(p)
                for g, p in zip(out, [p for s in steps for p in s.parameters()])]
