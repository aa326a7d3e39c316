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
them in one call: the module's own ``forward_batched`` (``bmm`` for dense steps, one grouped
convolution for conv steps), else ``torch.func.vmap`` over ``torch.func.functional_call``, else
(modules ``vmap`` cannot batch) a loop. Batched adjoint steps and parameter gradients use the
module's closed-form ``vjp_batched`` when it has one (dense steps with built-in activations),
else one autograd call through that batched forward.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.func import functional_call, vmap

from ..propagator import Propagator

__all__ = ["ForwardChain", "AdjointChain"]


def _config(module: nn.Module) -> tuple:
    """Types and plain settings (public int/float/str/bool/tuple attributes: widths, kernel
    sizes, SmoothReLU's eps, ...) of a module and its submodules. Steps whose configurations
    differ (e.g. tanh and relu layers) are not stacked: a batched call applies one module's
    settings to every layer."""
    plain = (int, float, str, bool, tuple, type(None))
    return tuple((type(m), tuple(sorted((k, v) for k, v in vars(m).items()
                                        if not k.startswith("_") and k != "training"
                                        and isinstance(v, plain))))
                 for m in module.modules())


class _Stacked:
    """Parameters and buffers of structurally identical modules, stacked along a new dim 0,
    and the batched application of the modules (``forward_batched`` when the module has one --
    :class:`~mgrit.nn.steps.DenseStep` uses ``baddbmm``, the conv steps one grouped
    convolution -- else ``vmap`` over ``functional_call``)."""

    def __init__(self, steps: Sequence[nn.Module]):
        self.template = steps[0]
        self.names = [n for n, _ in steps[0].named_parameters()]
        self.bnames = [n for n, _ in steps[0].named_buffers()]
        config = _config(steps[0])  # batched calls apply the first module's settings
        self.ok = all([n for n, _ in s.named_parameters()] == self.names and
                      [n for n, _ in s.named_buffers()] == self.bnames and
                      all(p.shape == q.shape for p, q in zip(s.parameters(), steps[0].parameters()))
                      and _config(s) == config
                      for s in steps)
        self._lists = {}
        if self.ok:
            self._lists = {n: [s.get_parameter(n) for s in steps] for n in self.names}
            self._lists.update({n: [s.get_buffer(n) for s in steps] for n in self.bnames})
        self.tensors = {}
        self._native = hasattr(self.template, "forward_batched")

    @property
    def closed_form_vjp(self) -> bool:
        """The module has a closed-form batched VJP (DenseStep with a built-in activation):
        no autograd graph. Read at every use (an activation may be replaced after build)."""
        return bool(self._native and getattr(self.template, "closed_form_vjp", False))

    def refresh(self) -> None:
        """Re-stack the current values (after an optimizer step)."""
        with torch.no_grad():  # no graph: no per-tensor detach needed
            self.tensors = {n: torch.stack(lst) for n, lst in self._lists.items()}

    def take(self, idx) -> dict:
        """Rows ``idx`` of every stacked tensor: a ``slice`` gives views, a tensor copies."""
        if isinstance(idx, slice):
            return {n: t[idx] for n, t in self.tensors.items()}
        return {n: t.index_select(0, idx) for n, t in self.tensors.items()}

    def apply(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """``out[b] = F_b(x[b])`` for the stacked parameters ``p`` (``(B, ...)`` each)."""
        if self._native:
            return self.template.forward_batched(p, x)
        return vmap(lambda pp, xx: functional_call(self.template, pp, (xx,)))(p, x)


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
        self._stack = _Stacked(self.steps) if batched and len(self.steps) > 1 else None
        if self._stack is not None and not self._stack.ok:
            self._stack = None

    def refresh(self) -> None:
        """Snapshot the current parameters for batched steps (call after every optimizer step)."""
        if self._stack is not None:
            self._stack.refresh()

    @property
    def batched(self) -> bool:
        return self._stack is not None

    def step(self, u, start, stop, level):
        return u + ((stop - start) * self.h) * self.steps[start - self.first](u)

    def _dt(self, starts, stops, like):
        """Step sizes of a batched call: a float when all intervals have the same length
        (always the case for the solver's calls), else a broadcastable tensor."""
        if isinstance(starts, range) and isinstance(stops, range) and starts.step == stops.step:
            return (stops.start - starts.start) * self.h  # the solver's calls: O(1)
        spans = {b - a for a, b in zip(starts, stops)}
        if len(spans) == 1:
            return spans.pop() * self.h
        return torch.as_tensor([(b - a) * self.h for a, b in zip(starts, stops)], dtype=like.dtype,
                               device=like.device).view(-1, *([1] * (like.dim() - 1)))

    def _rows(self, starts, device):
        """Local layer rows for interval starts: a slice for a range, else an index tensor."""
        if isinstance(starts, range) and starts.step > 0:
            return slice(starts.start - self.first, starts.stop - self.first, starts.step)
        return torch.as_tensor([s - self.first for s in starts], device=device)

    def step_batch(self, u, starts, stops, level):
        if not self.batched:
            return super().step_batch(u, starts, stops, level)
        if not self._stack.tensors:
            self._stack.refresh()
        try:
            out = self._stack.apply(self._stack.take(self._rows(starts, u.device)), u)
        except Exception:  # nothing is swallowed: a native kernel re-raises; a genuine error
            if self._stack._native:  # in a user module re-raises from the loop below
                raise
            self._stack = None  # a module vmap cannot batch: remember and loop from now on
            return super().step_batch(u, starts, stops, level)
        dt = self._dt(starts, stops, u)
        if isinstance(dt, float):
            return torch.add(u, out, alpha=dt)  # one pass instead of two (~20% of a step)
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
        self._dact = None  # closed form: act'(z_k) of every local layer, computed once

    def _closed_form(self):
        """The stacked layers and ``act'(z)`` of all local layers at the forward states (one
        batched call, cached for the whole adjoint solve: ``(n_local, *state_shape)``), or
        ``None`` when the step has no closed-form VJP."""
        stack = self.fwd._stack
        if stack is None or not stack.closed_form_vjp:
            return None
        if not stack.tensors:
            stack.refresh()
        if self._dact is None:
            n = len(self.fwd.steps)
            self._dact = stack.template.linearize_batched(stack.tensors, self.states[:n])
        return stack

    @property
    def batched(self) -> bool:
        return self.fwd.batched

    def _layer(self, start: int) -> int:
        return self.n - 1 - start - self.fwd.first  # local index of the layer linearized

    def step(self, mu, start, stop, level):
        j = self._layer(start)  # single steps stay autograd: one level = backprop bit for bit
        graph = self._vjp.get(j)
        if graph is None:  # the layer's graph is reused by every MGRIT iteration of this solve
            x = self.states[j].detach().requires_grad_(True)
            with torch.enable_grad():
                graph = (x, self.fwd.steps[j](x))
            self._vjp[j] = graph
        x, y = graph
        with torch.enable_grad():
            (g,) = torch.autograd.grad(y, x, ((stop - start) * self.fwd.h) * mu, retain_graph=True)
        return mu + g

    def step_batch(self, mu, starts, stops, level):
        if not self.batched:
            return super().step_batch(mu, starts, stops, level)
        stack = self.fwd._stack
        if isinstance(starts, range):
            first = self._layer(starts[0])
            idx = torch.arange(first, first - len(starts) * starts.step, -starts.step,
                               device=mu.device)
        else:
            idx = torch.as_tensor([self._layer(s) for s in starts], device=mu.device)
        v = self.fwd._dt(starts, stops, mu) * mu
        if self._closed_form() is not None:
            return mu + stack.template.vjp_batched(stack.take(idx), None, v,
                                                   dact=self._dact.index_select(0, idx))
        x = self.states.index_select(0, idx).requires_grad_(True)
        with torch.enable_grad():
            y = stack.apply(stack.take(idx), x)
            (g,) = torch.autograd.grad(y, x, v)
        return mu + g

    def parameter_gradients(self, lam_next: torch.Tensor, batched: bool) -> list[torch.Tensor]:
        """``dL/dtheta_k = h * (dF_k/dtheta_k (x_k))^T lambda_{k+1}`` for every local layer.

        Args:
            lam_next: ``(n_local_layers, *state_shape)``, row ``j`` is ``lambda_{first+j+1}``.
            batched: one batched call over all local layers instead of a loop.

        Returns:
            gradients in the order of ``[p for s in steps for p in s.parameters()]``.
        """
        steps, h = self.fwd.steps, self.fwd.h
        cot = h * lam_next
        n = len(steps)
        if batched and self.fwd.batched:
            stack = self.fwd._stack
            if self._closed_form() is not None:
                g = stack.template.vjp_batched(stack.tensors, self.states[:n].detach(), cot,
                                               params=True, dact=self._dact)
            else:
                p = {k: (t.clone().requires_grad_(True) if k in stack.names else t)
                     for k, t in stack.tensors.items()}
                with torch.enable_grad():
                    y = stack.apply(p, self.states[:n].detach())
                    gs = torch.autograd.grad(y, [p[k] for k in stack.names], cot,
                                             allow_unused=True)
                g = {k: (gk if gk is not None else torch.zeros_like(p[k]))
                     for k, gk in zip(stack.names, gs)}
            cols = [g[k] for k in stack.names]  # (indexing is 2x faster than unbind here)
            return [t[j] for j in range(n) for t in cols]
        out = []
        with torch.enable_grad():
            for j, s in enumerate(steps):
                x = self.states[j].detach()
                ps = list(s.parameters())
                y = s(x)
                out.extend(torch.autograd.grad(y, ps, cot[j], allow_unused=True))
        return [g if g is not None else torch.zeros_like(p)
                for g, p in zip(out, [p for s in steps for p in s.parameters()])]
