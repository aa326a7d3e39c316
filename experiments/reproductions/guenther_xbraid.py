"""XBraid's adjoint solve as the authors' program runs it, emulated on layerpar's solver (the
reproduction's ``xbraid_adjoint`` option; ``docs/features/guenther_reference.rst`` explains it).

layerpar's forward MGRIT cycle already is XBraid's (F-relaxation inside the restriction, coarse
solve, C-point correction, a final F-relaxation; the residuals agree to the printed digits). Its
adjoint differs from the authors' program in two places, both emulated here for one segment:

1. **Coarse adjoint step.** layerpar's adjoint chain is coarsened like any chain: the coarse
   step leaving reversed point ``s`` (``m`` fine intervals, step ``m h``) is linearized at the
   layer leaving ``s``, primal layer ``N - 1 - s``, at its state. The authors' ``my_Step_Adj``
   linearizes at the primal point of the step's end, ``N - stop`` (``= N - 1 - s - (m - 1)``):
   the transpose of the forward coarse step, which uses the primal C-point's layer. That layer
   may belong to the rank on the primal left: one layer and its state are exchanged per solve.
2. **Gradient of the layers that end at a C-point.** The authors accumulate each layer's
   gradient inside the fine-level adjoint steps (reset, then accumulated, by every such step).
   The fine step into a C-point ``c`` runs only in the residual of the restriction, before the
   cycle's coarse correction; the final F-relaxation (``_braid_FAccess``) steps into F-points
   only. So the gradient of the layers ``N - c`` uses ``lambda`` at the F-point ``c - 1`` from
   before the last correction, while layerpar's gradient sweep uses the final adjoint states.
   Emulated by keeping the fine states before the last correction and returning those at the
   points ``c - 1`` (read only by these layers' gradients; the warm start's F-points are
   overwritten by the next solve's first F-relaxation).

Private solver hooks are used (``_cycle``, ``_ops``): a reproduction of another program's
arithmetic, not a library feature.
"""
from __future__ import annotations

import copy

import torch
from mpi4py import MPI

from mgrit.propagator import Propagator
from mgrit.solver import MGRIT

__all__ = ["XBraidAdjointMGRIT", "use_xbraid_adjoint"]


class _CoarseAtStop(Propagator):
    """The adjoint chain ``chain`` with coarse steps linearized at primal layer ``N - stop``."""

    def __init__(self, chain, halo):
        self.chain, self.halo = chain, halo  # halo: (module, state) of primal layer first-1
        self.n, self.first, self.h = chain.n, chain.fwd.first, chain.fwd.h
        self._graphs = {}

    @property
    def batched(self) -> bool:
        return self.chain.batched

    def step(self, mu, start, stop, level):
        if level == 0:
            return self.chain.step(mu, start, stop, level)
        k = self.n - stop - self.first  # local index of primal layer N - stop
        graph = self._graphs.get(k)
        if graph is None:
            if k >= 0:
                module, x = self.chain.fwd.steps[k], self.chain.states[k]
            elif k == -1 and self.halo is not None:
                module, x = self.halo
            else:
                raise NotImplementedError("xbraid_adjoint: a coarse step needs a layer two ranks "
                                          "away (more than two levels): not emulated")
            x = x.detach().requires_grad_(True)
            with torch.enable_grad():
                graph = (x, module(x))
            self._graphs[k] = graph
        x, y = graph
        with torch.enable_grad():
            (g,) = torch.autograd.grad(y, x, (stop - start) * self.h * mu, retain_graph=True)
        return mu + g

    def step_batch(self, u, starts, stops, level):
        if level == 0:
            return self.chain.step_batch(u, starts, stops, level)
        return torch.stack([self.step(u[b], int(starts[b]), int(stops[b]), level)
                            for b in range(u.shape[0])])

    def step_batch_into(self, u, starts, stops, level, out):
        into = getattr(self.chain, "step_batch_into", None)
        if level == 0 and into is not None:
            return into(u, starts, stops, level, out)
        out.copy_(self.step_batch(u, starts, stops, level))


class XBraidAdjointMGRIT(MGRIT):
    """The adjoint solver of one segment, run as the authors' XBraid run does (see the module
    docstring). Set on a segment with :func:`use_xbraid_adjoint`; the class attributes switch
    the two parts (to measure each one's effect)."""

    coarse_at_stop = True
    gradient_before_correction = True

    def _cycle(self, l, cycle, iteration, first_f, skip):
        ops = self._ops
        if l == 0 and not getattr(ops, "_xbraid", False):
            correct = ops.correct

            def keep_then_correct(st, coarse):
                if st.lv.index == 0:
                    self._before_correction = st.u.clone()
                correct(st, coarse)
            ops.correct, ops._xbraid = keep_then_correct, True
        super()._cycle(l, cycle, iteration, first_f, skip)

    def solve(self, u0, initial_guess=None, state_shape=None):
        chain, comm = self.propagator, self.comm
        rank, size = comm.Get_rank(), comm.Get_size()
        mine = (copy.deepcopy(chain.fwd.steps[-1]), chain.states[len(chain.fwd.steps) - 1].clone())
        halo = comm.sendrecv(mine, dest=rank + 1 if rank < size - 1 else MPI.PROC_NULL,
                             source=rank - 1 if rank > 0 else MPI.PROC_NULL)
        if self.coarse_at_stop:
            self.propagator = _CoarseAtStop(chain, halo)
        self._before_correction = None
        try:
            res = super().solve(u0, initial_guess, state_shape)
        finally:
            self.propagator = chain
        pre = self._before_correction
        if pre is not None and self.gradient_before_correction:  # the F-points c - 1 as the last restriction's residual read them
            lv = self.hierarchy.levels[0]
            m = lv.cfactor
            for c in range(-(-(lv.lo + 1) // m) * m, min(lv.hi, self.n_intervals) + 1, m):
                res.states[c - 1 - lv.lo] = pre[c - 1 - lv.lo]
        return res


class _CoarseOnly(XBraidAdjointMGRIT):
    gradient_before_correction = False


class _GradientOnly(XBraidAdjointMGRIT):
    coarse_at_stop = False


def use_xbraid_adjoint(resnet, parts="both") -> None:
    """Run the adjoint solves of ``resnet`` (a ``LayerParallelResNet`` with a multilevel
    backward) as the authors' XBraid run does: ``parts`` ``"both"`` (default), ``"coarse"``
    (only the coarse adjoint step) or ``"gradient"`` (only the gradients of the C-ending layers)."""
    cls = {"both": XBraidAdjointMGRIT, "coarse": _CoarseOnly, "gradient": _GradientOnly}.get(parts)
    if cls is None:
        raise ValueError(f"parts={parts!r} is not allowed: use 'both', 'coarse' or 'gradient'")
    resnet._bsolver.__class__ = cls
