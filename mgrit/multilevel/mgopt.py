"""MG/Opt in depth: multilevel optimization of a residual network with coarser networks.

MG/Opt (Nash 2000, "A multigrid approach to discretized optimization problems", Optim. Methods
Softw. 14) combines optimization steps on the fine objective ``f_h`` with a correction computed
on a coarse model ``f_H`` -- here the same network with fewer layers and a larger step
(:mod:`mgrit.nn.depth`). One V-cycle on level ``l`` with objective ``F_l(x) = f_l(x) - <v_l, x>``
(``v_0 = 0``):

1. pre-smoothing: ``pre_smooth`` steps of the inner optimizer (any ``torch.optim`` optimizer) on
   ``F_l``;
2. ``g = grad F_l(x_l)``; restrict the weights ``x_{l+1} = R x_l``;
3. first-order coherence: ``v_{l+1} = grad f_{l+1}(x_{l+1}) - R_g g``, so that
   ``grad F_{l+1}(x_{l+1}) = R_g grad F_l(x_l)``;
4. recurse on level ``l+1`` (on the coarsest level: ``coarse_steps`` inner-optimizer steps on
   ``F_{l+1}``), giving ``y_{l+1}``;
5. correction ``e = P (y_{l+1} - x_{l+1})`` with Armijo backtracking on ``F_l``:
   ``F_l(x_l + a e) <= F_l(x_l) + c1 a <g, e>``, ``a = alpha0, alpha0*shrink, ...``; skipped when
   ``<g, e> >= 0`` (not a descent direction) or when no step is accepted;
6. post-smoothing: ``post_smooth`` inner-optimizer steps on ``F_l``.

Transfers: ``P`` = the prolongation in depth (``prolong``: ``"constant"`` default, or
``"linear"``), ``R`` = the restriction of weights (``restrict``: ``"average"`` default -- with
``"constant"`` ``P`` this is ``P``'s pseudo-inverse, ``R P = I`` -- or ``"injection"``), and
``R_g = P^T``, the adjoint of the prolongation. Why ``P^T``: it is the exact gradient of
``x_H -> f_h(P x_H)``, so the shifted coarse model agrees to first order with the fine objective
restricted to the range of ``P``; ``<grad f_h, P e_H> = <P^T grad f_h, e_H>``, so a coarse step
that decreases ``F_H`` to first order prolongs to a fine descent direction (Nash's condition);
and it has the right scale: a layer's gradient is proportional to its step, and ``P^T`` sums the
``f`` fine layers of step ``h`` into one of step ``f h``.

Parallel: every objective evaluation is the user's closure, i.e. the layer-parallel forward and
adjoint-MGRIT backward of a :class:`~mgrit.nn.LayerParallelNet` on the grid's layer
communicator; the driver averages values and gradients over the data communicator
(:class:`~mgrit.parallel.GradientBuckets`) and takes its inner products and line-search decisions
from sums over the layer communicator, identical on every rank. Data-parallel shards must have
equal sizes (values and gradients are plain means over the replicas). Transfers between levels
move only the layers each rank needs (:class:`~mgrit.nn.depth.DepthTransfer`); they act on
parameters only (buffers such as normalization statistics are not transferred).

Work: every evaluation is counted per level (``gradients``: forward + backward, ``values``:
forward only); :attr:`MGOpt.work` converts them to fine-gradient equivalents. A two-level cycle
costs ``pre_smooth + post_smooth + 1`` fine gradients (the ``+1`` is ``g`` in step 2), at least
one fine value (the line search), and on the coarse level ``pre/post`` or ``coarse_steps``
gradients plus one (``grad f_H(R x)``; the coarse level's first evaluation reuses it). Compared
with ``pre_smooth + post_smooth`` plain steps this pays only when the coarse correction gains
more than the extra fine gradient and the coarse work.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from mpi4py import MPI
from torch import nn

from ..comm import raise_agreed
from ..nn.depth import DepthTransfer, restrict, total_layers
from ..parallel import GradientBuckets, ProcessGrid
from .mgopt_options import CycleRecord, MGOptOptions

__all__ = ["MGOptOptions", "MGOpt", "CycleRecord"]


class MGOpt:
    """MG/Opt V-cycles over networks of decreasing depth (see the module doc).

    Args:
        models: ``[fine, coarse, coarser, ...]``: :class:`~mgrit.nn.LayerParallelNet`,
            :class:`~mgrit.nn.LayerParallelResNet` or ``nn.Sequential`` of ``ResidualStep``
            layers, each level's depth a multiple of the next one's (build coarse levels with
            :meth:`from_fine` or :func:`mgrit.nn.depth.restrict`, or yourself, e.g. with other
            MGRIT options). Level 0's parameters are the ones trained.
        make_optimizer: ``make_optimizer(params, level) -> torch.optim.Optimizer`` -- the
            inner optimizer (smoother) of each level, e.g.
            ``lambda ps, l: torch.optim.SGD(ps, lr=0.1)``; SGD, Adam, L-BFGS (closures are
            supported; under a layer communicator of more than one rank L-BFGS is refused, see
            Raises).
        options: :class:`MGOptOptions` (default ``MGOptOptions()``).
        grid: a :class:`~mgrit.parallel.ProcessGrid`; its ``layer_comm`` must be the networks'
            and gradients/values are averaged over its ``data_comm``. Default: the fine
            network's ``comm`` attribute (``COMM_SELF`` for serial networks), no data
            parallelism.

    Raises:
        ValueError: a level whose depth is not a multiple of the next, mismatched step classes,
            no models, or ``torch.optim.LBFGS`` with more than one layer rank (its dot products
            and stopping tests would use this rank's parameters only, so ranks would run
            different iterations); raised on every rank.
    """

    def __init__(self, models: Sequence[nn.Module],
                 make_optimizer: Callable[[list, int], torch.optim.Optimizer],
                 options: MGOptOptions | None = None, grid: ProcessGrid | None = None):
        models = list(models)
        if not models:
            raise ValueError("models=[] is not allowed: use a list of networks, fine first")
        for i, m in enumerate(models):
            if not isinstance(m, nn.Module):
                raise ValueError(f"models[{i}] is a {type(m).__name__}, which is not allowed: "
                                 f"use nn.Module networks")
        if options is not None and not isinstance(options, MGOptOptions):
            raise ValueError(f"options={options!r} is not allowed: use MGOptOptions or None")
        self.options = options or MGOptOptions()
        self.models = models
        comm = getattr(models[0], "comm", None)
        if grid is not None:
            self.layer_comm, self.data_comm = grid.layer_comm, grid.data_comm
            if comm is not None and MPI.Comm.Compare(comm, grid.layer_comm) not in (
                    MPI.IDENT, MPI.CONGRUENT):
                raise ValueError("the fine network's communicator is not the grid's layer_comm: "
                                 "build the networks on grid.layer_comm")
        else:
            self.layer_comm = MPI.COMM_SELF if comm is None else comm
            self.data_comm = MPI.COMM_SELF
        self.make_optimizer = make_optimizer
        self.params = [list(m.parameters()) for m in models]
        o = self.options
        self.P = [DepthTransfer(models[l + 1], models[l], o.prolong)
                  for l in range(len(models) - 1)]
        self.R = [DepthTransfer(models[l], models[l + 1], o.restrict)
                  for l in range(len(models) - 1)]
        self.Rg = [p.adjoint() for p in self.P]
        self._opts: list = [None] * len(models)
        self._opts[0] = self._new_optimizer(0)
        self._buckets: list = [None] * len(models)
        self._primed: dict = {}
        self.gradients = [0] * len(models)
        self.values = [0] * len(models)
        self.depths = [total_layers(m) for m in models]

    @classmethod
    def from_fine(cls, fine: nn.Module, levels: int, make_optimizer, options=None, grid=None,
                  factor: int = 2, **overrides) -> "MGOpt":
        """Build the coarse levels by restricting ``fine`` ``levels - 1`` times by ``factor``
        (:func:`mgrit.nn.depth.restrict`; ``overrides`` go to the coarse
        ``LayerParallelResNet`` constructors, e.g. other MGRIT options)."""
        if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
            raise ValueError(f"levels={levels!r} is not allowed: use an int >= 1")
        o = options or MGOptOptions()
        models = [fine]
        for _ in range(levels - 1):
            models.append(restrict(models[-1], factor, o.restrict, **overrides))
        return cls(models, make_optimizer, o, grid)

    # -- bookkeeping ------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The fine level's inner optimizer (persistent; e.g. for a learning-rate scheduler)."""
        return self._opts[0]

    @property
    def fine_gradient_evaluations(self) -> int:
        return self.gradients[0]

    @property
    def work(self) -> float:
        """Evaluations in fine-gradient equivalents: a gradient (forward + backward, about three
        forwards) counts 1, a value (forward only) 1/3, and a level with ``N_l`` layers costs
        ``N_l / N_0`` of the fine level (the opening/closing layers are ignored). A model of
        the work, not a measurement."""
        return sum((g + v / 3.0) * n / self.depths[0]
                   for g, v, n in zip(self.gradients, self.values, self.depths))

    def _new_optimizer(self, level: int) -> torch.optim.Optimizer:
        opt = self.make_optimizer(self.params[level], level)
        error = None
        if not isinstance(opt, torch.optim.Optimizer):
            error = (f"make_optimizer returned {type(opt).__name__} for level {level}: it must "
                     f"return a torch.optim.Optimizer")
        elif isinstance(opt, torch.optim.LBFGS) and self.layer_comm.Get_size() > 1:
            error = ("torch.optim.LBFGS is not allowed under a layer communicator of "
                     f"{self.layer_comm.Get_size()} ranks: its dot products and stopping tests "
                     "see only this rank's layers, so ranks would run different iterations; "
                     "use an elementwise optimizer (SGD, Adam) or one layer rank")
        raise_agreed(self.layer_comm, error)
        return opt

    # -- evaluations --------------------------------------------------------------------------
    def _dot(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
        """Global ``<a, b>`` over this replica's layer ranks, summed in rank order (the same
        float on every rank)."""
        local = sum(float(torch.sum(x.detach().double() * y.detach().double()))
                    for x, y in zip(a, b))
        if self.layer_comm.Get_size() == 1:
            return local
        return sum(self.layer_comm.allgather(local))

    def _average_value(self, value: float) -> float:
        if self.data_comm.Get_size() == 1:
            return value
        vals = self.data_comm.allgather(value)
        return sum(vals) / len(vals)

    def evaluate(self, level: int, closure, shift=None, backward: bool = True) -> float:
        """``F_level = f_level - <shift, x>`` at the current weights; with ``backward`` the
        parameters' ``.grad`` hold ``grad F_level`` afterwards (averaged over the data
        communicator). Counts one gradient (or value) evaluation of the level."""
        params = self.params[level]
        primed = self._primed.pop(level, None) if backward else None
        if primed is not None:  # the gradient at the restricted point, computed just before
            value, grads = primed
            for p, g in zip(params, grads):
                p.grad = g.clone()
        elif backward:
            buckets = self._bucket(level)
            if buckets is not None:
                buckets.zero_grad()
            else:
                for p in params:
                    p.grad = None
            value = self._call(closure, level, True)
            if buckets is not None:
                buckets.average()
            value = self._average_value(value)
            self.gradients[level] += 1
        else:
            with torch.no_grad():
                value = self._average_value(self._call(closure, level, False))
            self.values[level] += 1
        if shift is not None:
            value -= self._dot(shift, params)
            if backward:
                with torch.no_grad():
                    for p, v in zip(params, shift):
                        if p.grad is None:
                            p.grad = -v.to(p.dtype)
                        else:
                            p.grad.sub_(v)
        return value

    def _call(self, closure, level: int, backward: bool) -> float:
        """The closure's value, checked to be one float agreed by every layer rank (a rank that
        returned something else, or a different value, would take different line-search
        decisions and leave the others waiting)."""
        raw = closure(self.models[level], backward)
        try:
            value, error = float(raw), None
        except (TypeError, ValueError):
            value, error = float("nan"), (f"the closure returned {type(raw).__name__}: return "
                                          f"the loss as a float")
        raise_agreed(self.layer_comm, error, same=repr(value),
                     what="objective value returned by the closure (return the same float on "
                          "every layer rank, e.g. net.from_last(loss.item()))")
        return value

    def _bucket(self, level: int):
        if self.data_comm.Get_size() == 1:
            return None
        if self._buckets[level] is None:
            self._buckets[level] = GradientBuckets(self.params[level], self.data_comm)
        return self._buckets[level]

    def _grads(self, level: int) -> list[torch.Tensor]:
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for p in self.params[level]]

    def coarse_shift(self, level: int, closure, grads: Sequence[torch.Tensor],
                     reuse: bool = True) -> list:
        """Restrict level ``level``'s weights into level ``level+1`` and return
        ``v = grad f_{level+1}(R x) - R_g grads`` (aligned with level ``level+1``'s parameters;
        one coarse gradient evaluation, which the coarse level's next evaluation reuses when
        ``reuse``)."""
        with torch.no_grad():
            xc = self.R[level]([p.detach() for p in self.params[level]])
            for p, x in zip(self.params[level + 1], xc):
                p.copy_(x)
        value = self.evaluate(level + 1, closure)
        gc = self._grads(level + 1)
        if reuse:
            self._primed[level + 1] = (value, gc)
        return [a - b for a, b in zip(gc, self.Rg[level](grads))]

    # -- the cycle ----------------------------------------------------------------------------
    def step(self, closure: Callable[[nn.Module, bool], float]) -> CycleRecord:
        """One MG/Opt V-cycle from the current fine weights (collective over the grid).

        Args:
            closure: ``closure(model, backward) -> float`` evaluates the objective on ``model``
                (the network of some level, for the current batch) and, when ``backward``,
                calls ``.backward()`` (the driver has cleared the gradients; it calls the
                closure under ``torch.no_grad()`` otherwise). It returns the loss as a float
                that is the same on every rank of the layer communicator (for a
                :class:`~mgrit.nn.LayerParallelNet`: ``net.from_last(loss.item())``) -- with
                data parallelism this replica's shard loss; the driver averages values and
                gradients over the data communicator.

        Returns:
            :class:`CycleRecord`.
        """
        g0, v0 = list(self.gradients), list(self.values)
        rec = CycleRecord()
        if self.options.correction and len(self.models) > 1:
            rec.alphas = [None] * (len(self.models) - 1)
            rec.slopes = [None] * (len(self.models) - 1)
        self._record, self._primed = rec, {}
        self._cycle(0, closure, None)
        self._primed = {}
        rec.gradients = [a - b for a, b in zip(self.gradients, g0)]
        rec.values = [a - b for a, b in zip(self.values, v0)]
        return rec

    def _smooth(self, level: int, closure, shift, steps: int) -> None:
        opt = self._opts[level]
        for _ in range(steps):
            opt.step(lambda: torch.tensor(self._eval_rec(level, closure, shift),
                                          dtype=torch.float64))

    def _eval_rec(self, level, closure, shift, backward=True) -> float:
        value = self.evaluate(level, closure, shift, backward)
        if level == 0 and math.isnan(self._record.loss):  # the cycle's first fine evaluation
            self._record.loss = value
        return value

    def _cycle(self, level: int, closure, shift) -> None:
        o, last = self.options, len(self.models) - 1
        if level > 0 and (self._opts[level] is None or o.reset_coarse_optimizers):
            self._opts[level] = self._new_optimizer(level)
        if level > 0 and level == last:
            self._smooth(level, closure, shift, o.coarse_steps)
            return
        self._smooth(level, closure, shift, o.pre_smooth)
        if o.correction and level < last:
            self._correct(level, closure, shift)
        self._smooth(level, closure, shift, o.post_smooth)

    def _correct(self, level: int, closure, shift) -> None:
        o = self.options
        f0 = self._eval_rec(level, closure, shift)
        g = self._grads(level)
        x0 = [p.detach().clone() for p in self.params[level]]
        vc = self.coarse_shift(level, closure, g)
        xc0 = [p.detach().clone() for p in self.params[level + 1]]
        self._cycle(level + 1, closure, vc)
        e = self.P[level]([p.detach() - x for p, x in zip(self.params[level + 1], xc0)])
        slope = self._dot(g, e)
        self._record.slopes[level] = slope
        if not o.line_search:
            alpha = o.alpha0
            self._set(level, x0, e, alpha)
        elif slope >= 0:  # not a descent direction for F_level: keep x0 (Nash 2000)
            alpha = 0.0
        else:
            alpha, accepted = o.alpha0, False
            for _ in range(o.max_backtracks + 1):
                self._set(level, x0, e, alpha)
                f = self._eval_rec(level, closure, shift, backward=False)
                if f <= f0 + o.c1 * alpha * slope:  # False for NaN: backtrack
                    accepted = True
                    break
                alpha *= o.shrink
            if not accepted:
                alpha = 0.0
                self._set(level, x0, e, 0.0)
        self._record.alphas[level] = alpha

    def _set(self, level: int, x0, e, alpha: float) -> None:
        with torch.no_grad():
            for p, x, d in zip(self.params[level], x0, e):
                p.copy_(x if alpha == 0.0 else x + alpha * d)

