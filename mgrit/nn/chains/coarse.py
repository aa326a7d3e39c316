"""The adjoint steps of :class:`~mgrit.nn.chains.AdjointChain` on spatially coarsened MGRIT
levels (:mod:`mgrit.spatial`): the layer's module linearized at its forward state restricted
to the level's grid (the forward restriction ``R``, once per coarsening depth and adjoint
solve), by autograd; batched through the stack's ``apply`` where the chain is batched and the
forward chain's probe did not send the shape to ``plain_shapes``."""
from __future__ import annotations

import torch

from .compiled import plain_module

__all__ = ["SpatialAdjoint"]


class SpatialAdjoint:
    """Mixin of :class:`~mgrit.nn.chains.AdjointChain` (uses its ``spatial``, ``states``,
    ``fwd``, ``_vjp``, ``_coarse``, ``_stack``, ``tensors`` and ``_layer``)."""

    def _coarse_states(self, level: int):
        """``(depth, forward states on level's grid)``, or ``None`` on a fine-grid level."""
        sp = self.spatial
        d = 0 if sp is None else sp.depth(level)
        if d == 0:
            return None
        if d not in self._coarse:
            x = self.states.detach()
            for k in sp.levels[:d]:
                x = sp.restrict(x, k, x.shape[2:])
            self._coarse[d] = x
        return d, self._coarse[d]

    def _coarse_step(self, mu, j, dt, d, xs):
        """The adjoint step of local layer ``j`` linearized at coarse forward state ``xs[j]``."""
        graph = self._vjp.get((d, j))
        if graph is None:
            x = xs[j].clone().requires_grad_(True)
            with torch.enable_grad():
                graph = (x, plain_module(self.fwd.steps[j])(x))
            self._vjp[(d, j)] = graph
        x, y = graph
        with torch.enable_grad():
            (g,) = torch.autograd.grad(y, x, dt * mu, retain_graph=True)
        return mu + g

    def _coarse_batch(self, mu, starts, stops, coarse):
        """Batched adjoint steps on a coarse-grid level (autograd through ``stack.apply``)."""
        d, xs = coarse
        if not self.batched or tuple(mu.shape[2:]) in self.fwd.plain_shapes:
            return torch.stack([self._coarse_step(mu[b], self._layer(int(starts[b])),
                                                  (stops[b] - starts[b]) * self.fwd.h, d, xs)
                                for b in range(mu.shape[0])])
        idx = torch.as_tensor([self._layer(int(s)) for s in starts], device=mu.device)
        x = xs.index_select(0, idx).requires_grad_(True)
        with torch.enable_grad():
            y = self._stack.apply(self._stack.take(idx, self.tensors), x)
            (g,) = torch.autograd.grad(y, x, self.fwd._dt(starts, stops, mu) * mu)
        return mu + g
