"""Calibration of the cost model (:mod:`mgrit.perf`) for a layer-parallel ResNet: each input of
:class:`mgrit.perf.TrainCosts` timed on its own, on the machine at hand (:func:`chain_costs`:
MGRIT's steps, adjoint, parameter-gradient sweep, solver bookkeeping; :func:`calibrate`: plus
serial autograd slopes). ``experiments/bench_layerparallel.py`` calls it once per repeat,
interleaved with the runs the model is validated against; :mod:`mgrit.perf.netcal` for the
planner."""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import warnings

import numpy as np
import torch
from mpi4py import MPI

from . import model as perf
from mgrit.nn.chains import AdjointChain
from mgrit.propagator import Propagator
from mgrit.solver import MGRIT

__all__ = ["calibrate", "chain_costs", "solver_overhead", "solver_overhead_fit", "median_costs",
           "p2_costs", "costs_to_json", "costs_from_json"]

med = statistics.median


class _Bridge(torch.autograd.Function):
    """The autograd bridge's own cost: a Function with every parameter as an input whose
    backward returns ready gradients (what the engine does around the adjoint solve)."""

    @staticmethod
    def forward(ctx, x, grads, *params):
        ctx.grads = grads
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return (g, None, *ctx.grads)


class _Null(Propagator):
    """A free step (a copy): solving with it times the solver's own bookkeeping."""

    def step(self, u, start, stop, level):
        return u.clone()

    def step_batch(self, u, starts, stops, level):
        return u.clone()


def _nonneg_lstsq(rows, y):
    """Least squares ``rows @ c ~ y`` with ``c >= 0``: the best of the unconstrained fits over
    every subset of free variables whose solution is non-negative (exact for a handful of
    unknowns)."""
    A, y = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    k, best = A.shape[1], None
    for mask in itertools.product((True, False), repeat=k):
        idx = [i for i in range(k) if mask[i]]
        c = np.zeros(k)
        if idx:
            c[idx] = np.linalg.lstsq(A[:, idx], y, rcond=None)[0]
        if (c >= -1e-12 * max(1.0, float(np.abs(c).max()))).all():
            c = np.clip(c, 0.0, None)
            r = float(np.sum((A @ c - y) ** 2))
            if best is None or r < best[0] * (1 - 1e-12):
                best = (r, c)
    return best[1]


def solver_overhead_fit(n, shape, options, timed, repeats=3, dtype=torch.float32):
    """MGRIT bookkeeping (level operations, state updates, residuals, set-up) from 1-rank
    solves with a free propagator: ``(StepCost(single, call, item), fixed)`` -- per single
    step, per batched call, per batched interval, and per solve -- the non-negative
    least-squares fit of the times of one-level solves over ``n`` and ``n // 2`` intervals and
    ``options`` solves over ``n``, ``n // 2`` and ``n // 4`` intervals against their
    ``SolverStats`` counters. ``timed(fn)``: seconds of ``fn()`` (it returns the MGRITResult)."""
    u0 = torch.zeros(shape, dtype=dtype)
    rows, ys = [], []

    def run(nn, **changes):
        opts = dataclasses.replace(options, **changes)
        with warnings.catch_warnings():  # the one-level solve warns that it is sequential
            warnings.simplefilter("ignore")
            s = MGRIT(_Null(), nn, shape, dtype=dtype, options=opts, comm=MPI.COMM_SELF)
        st = s.solve(u0).stats
        rows.append([1.0, st.steps_single, st.steps_batched_calls, st.steps_batched_items])
        ys.append(med([timed(lambda: s.solve(u0)) for _ in range(repeats)]))
    for nn in (n, n // 2):
        run(nn, max_levels=1, max_iter=1)
    for nn in (n, n // 2, n // 4):
        if nn >= 2:
            run(nn)
    fixed, single, call, item = _nonneg_lstsq(rows, ys)
    return perf.StepCost(single, call, item), float(fixed)


def solver_overhead(n, shape, options, timed, repeats=3, dtype=torch.float32):
    """MGRIT bookkeeping (level operations, state updates, residuals) in the form of a
    :class:`mgrit.perf.StepCost` to add to the step costs, from 1-rank solves with a free
    propagator: per single step from a one-level solve over ``n`` intervals (the sequential
    sweep that coarse solves and one-interval F-relaxations run), per batched call and per
    interval from ``options`` solves over ``n`` and ``n // 2`` intervals (a least-squares fit
    after the singles' share). Without a per-solve term: :func:`solver_overhead_fit` has one."""
    u0 = torch.zeros(shape, dtype=dtype)

    def run(nn, **changes):
        opts = dataclasses.replace(options, **changes)
        with warnings.catch_warnings():  # the one-level solve warns that it is sequential
            warnings.simplefilter("ignore")
            s = MGRIT(_Null(), nn, shape, dtype=dtype, options=opts, comm=MPI.COMM_SELF)
        st = s.solve(u0).stats
        return med([timed(lambda: s.solve(u0)) for _ in range(repeats)]), st
    t1, st1 = run(n, max_levels=1, max_iter=1)
    single = t1 / st1.steps_single
    rows = []
    for nn in (n, n // 2):
        t, st = run(nn)
        rows.append((st.steps_batched_calls, st.steps_batched_items,
                     max(t - single * st.steps_single, 0.0)))
    (c1, i1, y1), (c2, i2, y2) = rows
    det = c1 * i2 - c2 * i1
    if det == 0:  # same shape of work: no per-interval term
        return perf.StepCost(single, y1 / max(c1, 1), 0.0)
    call, item = (y1 * i2 - y2 * i1) / det, (c1 * y2 - c2 * y1) / det
    if call < 0 or item < 0:  # noise: keep one non-negative term
        call, item = (0.0, y1 / max(i1, 1)) if call < 0 else (y1 / max(c1, 1), 0.0)
    return perf.StepCost(single, call, item)


def _slope(times: dict) -> float:
    """Per-layer cost: least-squares slope of time against depth (drops fixed overheads)."""
    return perf.fit_step_cost(0.0, list(times), list(times.values())).item


def _timer(clock):
    def timed(fn):
        t0 = clock()
        fn()
        return clock() - t0
    return timed


def chain_costs(lp, x, m, clock, repeats=3, inner=20, solver_options=None, per_layer_opt=0.0,
                refresh=0.0, pgrad_batched=True) -> perf.TrainCosts:
    """The MGRIT part of :class:`mgrit.perf.TrainCosts` for this rank's layers of ``lp`` (a
    :class:`~mgrit.nn.LayerParallelResNet` after one forward, whose states are used) at the
    batch of ``x`` (``(batch, *state_shape)``): batched and single forward / adjoint steps over
    intervals strided by ``m`` as the solver calls them (inputs allocated outside the timed
    calls), the parameter-gradient sweep (incl. the adjoint's linearization) and the autograd
    bridge per layer; with ``solver_options`` (the forward solve's MGRITOptions) the solver's
    bookkeeping (:func:`solver_overhead_fit` on this rank's layers) is added to the step costs
    and gives ``solve_fixed``. ``pgrad_batched``: time the batched parameter-gradient sweep
    (multi-level adjoints) or the per-layer one (one-level adjoints, the exact path). Serial
    fields are 0 (:func:`calibrate` adds them)."""
    timed = _timer(clock)
    ch, N, first, n = lp._chain, lp.n_layers, lp.first, len(lp.steps)
    sizes = [B for B in (2, 8, 32, 64) if B < n - 1]
    sizes = sizes if len(sizes) >= 2 else [1, 2]  # a short block: the fit needs two sizes
    # intervals strided by m as the solver's calls; a smaller stride where B * m does not fit
    sd = {B: (m if B * m < n else max(1, (n - 2) // B)) for B in sizes}
    U = {B: torch.randn(B, *x.shape, dtype=x.dtype) for B in sizes}
    u1 = torch.randn(*x.shape, dtype=x.dtype)
    i0 = N - first - n + 1  # reversed index of this rank's last layer + 1
    kw = dict(sizes=sizes, repeats=repeats, inner=inner, clock=clock)
    with torch.no_grad():
        # single steps as sequential sweeps apply them (one-interval F-relaxations, coarse
        # sweeps): consecutive layers; the adjoint builds each layer's graph once per solve (a
        # fresh chain per step)
        cs = itertools.cycle(range(n))
        fwd = perf.calibrate_step(
            lambda: ch.step(u1, *(lambda j: (first + j, first + j + 1))(next(cs)), 0),
            lambda B: ch.step_batch(U[B], range(first + 1, first + 1 + B * sd[B], sd[B]),
                                    range(first + 2, first + 2 + B * sd[B], sd[B]), 0), **kw)
        adj = AdjointChain(ch, N, lp._states)
        adj_cost = perf.calibrate_step(
            lambda: AdjointChain(ch, N, lp._states).step(
                u1, *(lambda i: (i, i + 1))(N - 1 - first - next(cs)), 0),
            lambda B: adj.step_batch(U[B], range(i0, i0 + B * sd[B], sd[B]),
                                     range(i0 + 1, i0 + 1 + B * sd[B], sd[B]), 0), **kw)
    lam = torch.randn(n, *x.shape, dtype=x.dtype)
    pg = med([timed(lambda: AdjointChain(ch, N, lp._states).parameter_gradients(lam, pgrad_batched))
              for _ in range(repeats)])
    params = list(lp.parameters())
    grads = [torch.zeros_like(q) for q in params]

    def bridge():
        for q in params:
            q.grad = None
        _Bridge.apply(x, grads, *params).sum().backward()
    bridge()
    br = med([timed(bridge) for _ in range(repeats)])
    for q in params:
        q.grad = None
    fixed = 0.0
    if solver_options is not None:
        o, fixed = solver_overhead_fit(n, tuple(x.shape), solver_options,
                                       lambda fn: timed(fn), repeats, x.dtype)
        fwd, adj_cost = (perf.StepCost(c.single + o.single, c.call + o.call, c.item + o.item)
                         for c in (fwd, adj_cost))
    return perf.TrainCosts(fwd=fwd, adj=adj_cost, serial_fwd=0.0, serial_bwd=0.0,
                           pgrad_item=(pg + br) / n, per_layer=per_layer_opt, refresh=refresh,
                           nbytes=x.numel() * x.element_size(), solve_fixed=fixed)


def calibrate(serial_layers, lp, x, m, per_layer_opt, refresh, loss_fn, clock, repeats=3,
              inner=20, solver_options=None, one_at_a_time=None) -> perf.TrainCosts:
    """Costs of the model (mgrit.perf.TrainCosts) of this rank's layers, each piece timed on
    its own: :func:`chain_costs` (MGRIT's steps, parameter-gradient sweep, bridge, and with
    ``solver_options`` the solver's bookkeeping) and the serial per-layer costs as slopes over
    depths 64..512 of ``serial_layers`` (the two largest of ``n/4, n/2, n`` when fewer than two
    fit). ``per_layer_opt``/``refresh``: optimizer step and parameter stacking per layer, timed
    separately by the caller. Called once per repeat, interleaved with the measured runs (and,
    for P = 2, on both ranks at once), so that costs and measurements see the same machine
    state. ``loss_fn(output)``: the scalar loss of the serial layers' output; ``clock``:
    ``time.perf_counter`` or ``time.process_time``. ``one_at_a_time(fn)``: runs ``fn`` on each
    rank in turn while the others wait (the serial slopes are then timed as a blocking chain
    runs: one rank computing at a time); default: call ``fn`` directly."""
    timed = _timer(clock)
    c = chain_costs(lp, x, m, clock, repeats, inner, solver_options, per_layer_opt, refresh)
    fwd_t, train_t = {}, {}
    L = len(serial_layers)
    depths = [d for d in (64, 128, 256, 512) if d <= L]
    if len(depths) < 2:
        depths = sorted({max(1, L // 4), max(1, L // 2), L})[-2:]

    def serial_slopes():
        for d in depths:
            short = serial_layers[:d]
            with torch.no_grad():
                fwd_t[d] = med([timed(lambda: short(x)) for _ in range(repeats)])
            train_t[d] = med([timed(lambda: loss_fn(short(x)).backward())
                              for _ in range(repeats)])
    (one_at_a_time or (lambda fn: fn()))(serial_slopes)
    sf = _slope(fwd_t)
    return dataclasses.replace(c, serial_fwd=sf, serial_bwd=_slope(train_t) - sf)


def median_costs(cs, reduce=med):
    """Field-wise median (or ``reduce``, e.g. ``max``) of several TrainCosts: the median over
    repeats; over ranks, ``max`` (the critical path waits for the slower rank)."""
    step = lambda name: perf.StepCost(*(reduce([getattr(getattr(c, name), f) for c in cs])  # noqa: E731
                                        for f in ("single", "call", "item")))
    return perf.TrainCosts(fwd=step("fwd"), adj=step("adj"),
                           **{f: reduce([getattr(c, f) for c in cs])
                              for f in ("serial_fwd", "serial_bwd", "pgrad_item", "per_layer",
                                        "refresh", "solve_fixed")}, nbytes=cs[0].nbytes)


def costs_to_json(c):
    return dataclasses.asdict(c)


def costs_from_json(d):
    return perf.TrainCosts(**{k: (perf.StepCost(**v) if isinstance(v, dict) else v)
                              for k, v in d.items()})


def p2_costs(per_rank):
    """Costs for the P = 2 model from both ranks' calibrations: MGRIT's (ranks work at once,
    the critical path waits for the slower one) field-wise max; the serial costs (the blocking
    chain's ranks work in turn, so their times add up) the mean."""
    slow, mean = median_costs(per_rank, max), median_costs(per_rank)
    return dataclasses.replace(slow, serial_fwd=mean.serial_fwd, serial_bwd=mean.serial_bwd)
