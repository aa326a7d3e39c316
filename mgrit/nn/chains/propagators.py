"""Propagators that adapt residual step modules to the MGRIT solver.

Forward chain (layer ``k`` = fine interval ``k``): ``Phi(u) = u + (stop - start) h F_start(u)``:
the coarse propagator on level ``l`` reuses the C-point layer's parameters with the step
``m^l h`` (Guenther et al. 2020; Kirby et al. 2020; TorchBraid).

Adjoint chain, solved over the reversed index ``i = N - k`` (``mu_i = lambda_{N-i}``): ``lambda_k =
(dPhi_k/dx (x_k))^T lambda_{k+1} = lambda_{k+1} + J_{F_k}(x_k)^T (h lambda_{k+1})``, each step one
vector-Jacobian product. The coarse adjoint step from reversed point ``i`` linearizes the layer
adjacent to that point, ``k = N - 1 - i``, with the step ``(stop-start) h`` -- the reversed chain's
own rediscretization; it lives on the rank that owns ``lambda_{k+1}``, so no parameters ever cross
ranks. The fixed point (the exact adjoint) does not depend on it.

Concurrent relaxation: ``step_batch`` stacks the parameters of the layers involved and applies them
in one call: the module's own ``forward_batched`` (``bmm`` for dense steps, one grouped convolution
for conv steps), else ``torch.func.vmap`` over ``torch.func.functional_call``, else (modules
``vmap`` cannot batch) a loop. Batched adjoint steps and parameter gradients use the module's
closed-form ``vjp_batched`` when it has one (dense steps with built-in activations), else one
autograd call through that batched forward.

Hot paths (no Python work or temporary per layer where it can be avoided; each equal to the general
path, ``tests/nn/test_fastpaths.py``): ``step_batch_into`` writes a batched step straight into the
solver's strided state rows (:mod:`mgrit.levelops`); single forward steps of a batched chain use
the module's ``forward_layer(p, j, x)`` on the stacked snapshot when it has one (no module call:
MGRIT's coarse sweeps); closed-form adjoint steps slice a reversed copy of the snapshot and of
``act'(z)`` (made once per adjoint solve) instead of gathering rows, and in multilevel adjoint
solves (``closed_single``) the single adjoint steps are closed-form too.

Batching never changes a result: a rank's layers are stacked only when
:func:`~mgrit.nn.chains.stacking.batching_obstacle` proves, when the chain is built and again
whenever the owner's per-call fingerprint (:mod:`mgrit.nn.chains.contract`) sees the modules
change, that they differ in nothing but parameter and buffer values (private attributes, tensor
attributes, closures and hooks included; the full contract is in :mod:`mgrit.nn.chains.stacking`);
otherwise every layer is evaluated with its own module. A native kernel (``forward_batched``,
``forward_layer``, ``vjp_batched``) runs only where :func:`mgrit.nn.chains.contract.kernel` allows
it: never one inherited from a class whose ``forward`` is not the one the module calls. A module
contributed by a user may provide ``forward_batched(p, x)``: ``p`` maps each of its parameter and
buffer names to the values of ``B`` layers stacked along dim 0, ``x`` is ``(B, batch,
*state_shape)``, the result has the shape of ``x`` and row ``b`` must equal ``module_b(x[b])``.
Optional, for speed: ``forward_layer(p, j, x)`` (row ``j`` of ``p`` applied to ``x``, equal to
``module_j(x)``) and ``stack_extras(p)`` (derived constants added to each snapshot, see
:meth:`~mgrit.nn.chains.stacking.Stacked.refresh`).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ...propagator import Propagator
from .compiled import plain_module
from .coarse import SpatialAdjoint
from .contract import global_hooks_registered, kernel
from .stacking import Stacked, StaleStack, probe_shapes

__all__ = ["ForwardChain", "AdjointChain"]

_Stacked = Stacked  # the name older scripts and tests import from here


class ForwardChain(Propagator):
    """``u + (stop - start) * h * F_start(u)`` over the layers ``first .. first + len(steps) - 1``
    held by this rank.

    Args:
        steps: this rank's step modules, layer ``first + j`` is ``steps[j]``.
        first: global index of ``steps[0]``.
        h: fine step size ``T / N`` (float).
        batched: stack the layers for :meth:`step_batch` when that is provably exact.

    Attributes:
        batching_obstacle: why the layers are evaluated one by one (a message), or ``None``
            when they are batched.
        coarse_shapes: per-sample shapes of spatially coarsened levels; those where the
            batched kernel fails :func:`~mgrit.nn.chains.stacking.probe_shapes` at a
            :meth:`rebuild` are ``plain_shapes``, stepped module by module.
    """

    def __init__(self, steps: Sequence[nn.Module], first: int, h: float, batched: bool = True,
                 coarse_shapes=()):
        self.steps, self.first, self.h = list(steps), int(first), float(h)
        self._want_batched = bool(batched)
        self._hooked = False
        self.coarse_shapes, self.plain_shapes = [tuple(s) for s in coarse_shapes], set()
        self.rebuild()

    def rebuild(self, steps: Sequence[nn.Module] | None = None) -> None:
        """Re-run the batching proof and re-collect the stacked tensors (after a module's
        structure or non-parameter state changed, or ``.to()`` replaced its buffers; the
        owner's per-call fingerprint, :mod:`mgrit.nn.chains.contract`, calls it). ``steps``: the
        rank's step modules now (default: the same modules as before)."""
        if steps is not None:
            self.steps = list(steps)
        self._stack, self.batching_obstacle = None, "batched=False"
        if self._want_batched:
            stack = Stacked(self.steps) if len(self.steps) > 1 else None
            self.batching_obstacle = "fewer than two layers" if stack is None else stack.obstacle
            self._stack = stack if stack is not None and stack.ok else None
        self._layer_fn = None  # the template's forward_layer where its contract allows it
        if self._stack is not None and self._stack._native:
            self._layer_fn = kernel(self._stack.template, "forward_layer")
        self.plain_shapes = set(probe_shapes(self._stack, self.steps, self.coarse_shapes))

    def refresh(self, grad: bool = False) -> dict:
        """Snapshot the current parameters for batched steps (every forward solve calls it
        first). Returns the snapshot ``{name: (n_local, *shape)}`` (empty when not batched);
        later refreshes never modify it. O(1) Python work besides the stacking. ``grad``: the
        stacked parameters are recorded by autograd (``torch.stack`` of the layers'
        parameters: one node whose backward hands each layer its row of a stacked gradient)."""
        self._hooked = global_hooks_registered()  # registered after build: evaluate per layer
        if self._stack is None or self._hooked:
            return {}
        try:
            return self._stack.refresh(grad)
        except StaleStack:  # a dtype or device changed since the proof: prove again
            self.rebuild()
            return {} if self._stack is None else self._stack.refresh(grad)

    @property
    def batched(self) -> bool:
        return self._stack is not None and not self._hooked

    def step(self, u, start, stop, level):
        j = start - self.first
        plain = self.plain_shapes and tuple(u.shape[1:]) in self.plain_shapes
        stack = None if plain else self._stack
        if stack is not None and stack.tensors and not self._hooked and self._layer_fn:
            # the snapshot's layer j without a module call (same values as the module)
            return u + ((stop - start) * self.h) * self._layer_fn(stack.tensors, j, u)
        return u + ((stop - start) * self.h) * self.steps[j](u)

    def _dt(self, starts, stops, like):
        """Step sizes of a batched call: a float for equal spans (the solver's), else a tensor."""
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

    def _F_batched(self, u, starts):
        """``F_b(u[b])`` of the layers at ``starts`` in one stacked call, or ``None`` when the
        module turns out not to be batchable by vmap (then remembered: per layer from now)."""
        stack = self._stack
        if not stack.tensors:
            stack.refresh()
        try:
            return stack.apply(stack.take(self._rows(starts, u.device)), u)
        except Exception:  # nothing is swallowed: a native kernel re-raises; a genuine error
            if stack._native:  # in a user module re-raises from the per-layer loop
                raise
            self._stack = None  # a module vmap cannot batch: remember and loop from now on
            self.batching_obstacle = "torch.func.vmap cannot batch the module"
            return None

    def _batchable(self, u) -> bool:
        return self.batched and not (self.plain_shapes and tuple(u.shape[2:]) in self.plain_shapes)
    def step_batch(self, u, starts, stops, level):
        z = self._F_batched(u, starts) if self._batchable(u) else None
        if z is None:
            return super().step_batch(u, starts, stops, level)
        dt = self._dt(starts, stops, u)
        if isinstance(dt, float):
            return torch.add(u, z, alpha=dt)  # one pass instead of two (~20% of a step)
        return u + dt * z

    def step_batch_into(self, u, starts, stops, level, out) -> None:
        """:meth:`step_batch` written into ``out`` (a view of the solver's states that shares
        no element with ``u``): the last operation writes the strided target directly."""
        z = self._F_batched(u, starts) if self._batchable(u) else None
        if z is None:
            out.copy_(super().step_batch(u, starts, stops, level))
            return
        dt = self._dt(starts, stops, u)
        _ = torch.add(u, z, alpha=dt, out=out) if isinstance(dt, float) else torch.add(
            u, dt * z, out=out)


class AdjointChain(SpatialAdjoint, Propagator):
    """Adjoint of :class:`ForwardChain` over the reversed index, linearized at the forward
    states of this rank.

    Args:
        forward: the forward chain (its steps, ``first`` and ``h`` are used).
        n_layers: ``N``, the global number of layers.
        states: forward states ``x_k`` for ``k = first .. first + len(steps) - 1`` (at least),
            shape ``(>= len(steps), *state_shape)``; row ``j`` is ``x_{first + j}``.
        tensors: the stacked parameters the forward solve used (the snapshot
            :meth:`ForwardChain.refresh` returned); default: the chain's latest snapshot.
            Batched adjoint steps are used when this is non-empty and the chain is batched.
        closed_single: single steps by the closed-form VJP when the module has one (default
            False: autograd through the layer's module, so that a one-level adjoint solve is
            backpropagation bit for bit; multilevel solves pass True).
        spatial: the forward's :class:`mgrit.spatial.SpatialCoarsening` (default ``None``;
            coarse-grid steps: :mod:`mgrit.nn.chains.coarse`).
    """

    def __init__(self, forward: ForwardChain, n_layers: int, states: torch.Tensor,
                 tensors: dict | None = None, closed_single: bool = False, spatial=None):
        self.fwd, self.n, self.states, self.spatial, self._coarse = (forward, int(n_layers),
                                                                     states, spatial, {})
        stack = forward._stack if forward.batched else None
        if stack is not None and tensors is None:
            tensors = stack.tensors or stack.refresh()
        self._stack = stack if tensors else None
        self.tensors = tensors or {}
        self.closed_single = bool(closed_single)
        self._vjp = {}
        self._dact = None  # closed form: act'(z_k) of every local layer, computed once
        self._rev = None  # ... and the stacked tensors and act'(z) in reversed layer order

    def _closed_form(self):
        """The stacked layers and ``act'(z)`` of all local layers at the forward states (one
        batched call, cached for the whole adjoint solve: ``(n_local, *state_shape)``), or
        ``None`` when the step has no closed-form VJP."""
        stack = self._stack
        if stack is None or not stack.closed_form_vjp:
            return None
        if self._dact is None:
            n = len(self.fwd.steps)
            self._dact = stack.template.linearize_batched(self.tensors, self.states[:n])
        return stack

    def _reversed(self):
        """``(tensors, act'(z))`` of the local layers in reversed order (copies, once per
        solve): the layers of a strided range of reversed points are then a slice, no gather."""
        if self._rev is None:
            self._rev = ({k: t.flip(0) for k, t in self.tensors.items()}, self._dact.flip(0))
        return self._rev

    @property
    def batched(self) -> bool:
        return self._stack is not None

    def _layer(self, start: int) -> int:
        return self.n - 1 - start - self.fwd.first  # local index of the layer linearized

    def step(self, mu, start, stop, level):
        j = self._layer(start)
        dt = (stop - start) * self.fwd.h
        coarse = self._coarse_states(level)
        if coarse is not None:
            return self._coarse_step(mu, j, dt, *coarse)
        if self.closed_single and self._closed_form() is not None:  # no autograd graph
            p = {k: t[j:j + 1] for k, t in self.tensors.items()}
            z = self._stack.template.vjp_batched(p, None, mu.unsqueeze(0),
                                                 dact=self._dact[j:j + 1])
            return torch.add(mu, z[0], alpha=dt)
        # otherwise autograd through the layer's module: a one-level adjoint solve (Kirby's
        # serial adjoint) is then backprop bit for bit
        graph = self._vjp.get(j)
        if graph is None:  # the layer's graph is reused by every MGRIT iteration of this solve
            x = self.states[j].detach().requires_grad_(True)
            with torch.enable_grad():  # eager module: the graph is reused (retain_graph),
                # which a torch.compile'd backward with donated buffers refuses
                graph = (x, plain_module(self.fwd.steps[j])(x))
            self._vjp[j] = graph
        x, y = graph
        with torch.enable_grad():
            (g,) = torch.autograd.grad(y, x, dt * mu, retain_graph=True)
        return mu + g

    def _vjp_closed(self, mu, starts):
        """``(dact_b * mu_b) W_b`` of the layers at reversed points ``starts`` (a range), or
        ``None`` when the closed form does not apply."""
        if not isinstance(starts, range) or starts.step < 1 or self._closed_form() is None:
            return None
        p, dact = self._reversed()
        a = starts.start + self.fwd.first + len(self.fwd.steps) - self.n  # reversed local row
        rows = slice(a, a + len(starts) * starts.step, starts.step)
        return self._stack.template.vjp_batched({k: t[rows] for k, t in p.items()}, None, mu,
                                                dact=dact[rows])

    def step_batch(self, mu, starts, stops, level):
        coarse = self._coarse_states(level)
        if coarse is not None:
            return self._coarse_batch(mu, starts, stops, coarse)
        if not self.batched:
            return super().step_batch(mu, starts, stops, level)
        z = self._vjp_closed(mu, starts)
        if z is not None:
            dt = self.fwd._dt(starts, stops, mu)
            return torch.add(mu, z, alpha=dt) if isinstance(dt, float) else mu + dt * z
        stack = self._stack
        if isinstance(starts, range):
            first = self._layer(starts[0])
            idx = torch.arange(first, first - len(starts) * starts.step, -starts.step,
                               device=mu.device)
        else:
            idx = torch.as_tensor([self._layer(s) for s in starts], device=mu.device)
        v = self.fwd._dt(starts, stops, mu) * mu
        p = stack.take(idx, self.tensors)
        if self._closed_form() is not None:
            return mu + stack.template.vjp_batched(p, None, v, dact=self._dact.index_select(0, idx))
        x = self.states.index_select(0, idx).requires_grad_(True)
        with torch.enable_grad():
            y = stack.apply(p, x)
            (g,) = torch.autograd.grad(y, x, v)
        return mu + g

    def step_batch_into(self, mu, starts, stops, level, out) -> None:
        """:meth:`step_batch` written into ``out`` (shares no element with ``mu``)."""
        fine = self._coarse_states(level) is None
        z = self._vjp_closed(mu, starts) if self.batched and fine else None
        dt = self.fwd._dt(starts, stops, mu)
        if z is None or not isinstance(dt, float):
            out.copy_(self.step_batch(mu, starts, stops, level))
            return
        torch.add(mu, z, alpha=dt, out=out)

    def stacked_gradients(self, lam_next: torch.Tensor, batched: bool = True) -> list:
        """The parameter gradients of :meth:`parameter_gradients`, stacked over the local
        layers: one entry per stacked parameter name (``Stacked.names``), ``(n_local, *shape)``,
        or ``None`` where the parameter does not reach the step's output. Batched when the
        chain is (else per layer, stacked; an unused parameter of a layer then gives zeros)."""
        n = len(self.fwd.steps)
        if batched and self.batched:  # h applied to the (small) gradients, not to lam_next
            grads = self._batched_gradients(lam_next, n, split=False)
            return [None if g is None else g.mul_(self.fwd.h) for g in grads]
        flat = self.parameter_gradients(lam_next, False)
        k = len(flat) // n
        out = []
        for i in range(k):
            col = flat[i::k]
            if all(g is None for g in col):
                out.append(None)
                continue
            like = next(g for g in col if g is not None)
            out.append(torch.stack([torch.zeros_like(like) if g is None else g for g in col]))
        return out

    def parameter_gradients(self, lam_next: torch.Tensor, batched: bool,
                            need: Sequence[bool] | None = None) -> list:
        """``dL/dtheta_k = h * (dF_k/dtheta_k (x_k))^T lambda_{k+1}`` for every local layer.

        Args:
            lam_next: ``(n_local_layers, *state_shape)``, row ``j`` is ``lambda_{first+j+1}``.
            batched: one batched call over all local layers instead of a loop.
            need: one flag per entry of the result (default: all); entries not needed are
                ``None`` and a layer none of whose parameters is needed is not evaluated.

        Returns:
            one entry per ``[p for s in steps for p in s.parameters()]``: the gradient, or
            ``None`` where the parameter does not reach the step's output (as serial autograd
            leaves ``.grad`` of an unused parameter ``None``) or is not needed.
        """
        steps, h = self.fwd.steps, self.fwd.h
        cot = h * lam_next
        n = len(steps)
        if batched and self.batched:
            out = self._batched_gradients(cot, n)
            return out if need is None else [g if w else None for g, w in zip(out, need)]
        out = []
        with torch.enable_grad():
            for j, s in enumerate(steps):
                ps = list(s.parameters())
                wanted = [need is None or need[len(out) + k] for k in range(len(ps))]
                grads = {}
                if any(wanted):
                    want = [p for p, w in zip(ps, wanted) if w]
                    # frozen after the forward, still in its graph (serial autograd computes
                    # its gradient then): required for this recomputation only
                    thawed = [p for p in want if not p.requires_grad]
                    try:
                        for p in thawed:
                            p.requires_grad_(True)
                        y = s(self.states[j].detach())
                        if y.requires_grad:  # else no parameter reaches the output: all None
                            grads = dict(zip(map(id, want), torch.autograd.grad(
                                y, want, cot[j], allow_unused=True)))
                    finally:
                        for p in thawed:
                            p.requires_grad_(False)
                out.extend(grads.get(id(p)) for p in ps)
        return out

    def _batched_gradients(self, cot, n, split: bool = True) -> list:
        stack = self._stack
        if self._closed_form() is not None:
            g = stack.template.vjp_batched(self.tensors, self.states[:n].detach(), cot,
                                           params=True, dact=self._dact)
        else:
            p = {k: (t.clone().requires_grad_(True) if k in stack.names else t)
                 for k, t in self.tensors.items()}
            with torch.enable_grad():
                y = stack.apply(p, self.states[:n].detach())
                gs = torch.autograd.grad(y, [p[k] for k in stack.names], cot, allow_unused=True)
            g = dict(zip(stack.names, gs))  # None: the parameter does not reach the output
        cols = [g[k] for k in stack.names]  # (indexing is 2x faster than unbind here)
        if not split:
            return cols
        return [None if t is None else t[j] for j in range(n) for t in cols]
