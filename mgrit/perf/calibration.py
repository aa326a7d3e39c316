"""Calibration of the cost model (:mod:`mgrit.perf`) for a layer-parallel ResNet: each input of
:class:`mgrit.perf.TrainCosts` timed on its own, on the machine at hand, through the code path
a training step of the model runs (its options and :attr:`LayerParallelResNet.n_levels` decide):

* **multilevel MGRIT** (both solves >= 2 levels): forward single steps from the stacked
  snapshot (``ForwardChain.step``: coarse sweeps, one-interval F-relaxations) and batched steps
  written in place into strided state rows (``step_batch_into``: F-relaxation); the adjoint's
  steps of ``AdjointChain(closed_single=True)`` (closed-form single and batched VJPs); per
  backward the adjoint's linearization (``act'(z)`` of every layer and its reversed copies),
  the stacked parameter-gradient sweep (``stacked_gradients``) and the bridge's backward (the
  engine's fan-out of the stacked gradients through ``torch.stack`` to each layer's
  parameters); per forward ``ForwardChain.refresh(grad=True)`` (the stack recorded by
  autograd) and the version snapshot of the layers' tensors;
* **MGRIT forward, one-level adjoint** (``adjoint="serial"``, Kirby et al. 2020): the adjoint's
  single steps through each layer's module with autograd (one graph per layer and solve), the
  per-layer parameter-gradient loop, and a bridge with one autograd input per parameter;
* **the one-level exact path** (:mod:`mgrit.nn.resnet.pipelined`; both solves one level): no solver at
  all -- the rank's layers recorded by autograd, pipelined across ranks. Its per-layer forward
  and backward costs and fixed costs are the slope and intercept of the real path, run on one
  process over two depths of this rank's layers (:func:`pipelined_costs`).

The solver's bookkeeping comes from solves with a free propagator (:func:`solver_overhead_fit`).
``experiments/benchmarks/bench_layerparallel.py`` calls :func:`chain_costs` once per repeat, interleaved
with the runs the model is validated against; :mod:`mgrit.perf.netcal` for the planner.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import statistics

import torch

from mgrit import perf
from .overhead import solver_overhead, solver_overhead_fit
from mgrit.grid import Hierarchy
from mgrit.nn import LayerParallelResNet
from mgrit.nn.chains import AdjointChain
from mgrit.options import MGRITOptions

__all__ = ["calibrate", "chain_costs", "path_residual", "pipelined_costs", "timer", "solver_overhead",
           "solver_overhead_fit", "median_costs", "p2_costs", "costs_to_json", "costs_from_json"]

med = statistics.median
_version = operator.attrgetter("_version")
ONE = MGRITOptions(max_levels=1)


class _Bridge(torch.autograd.Function):
    """The autograd bridge's own cost: a Function whose inputs are the parameters (per-parameter
    bridge) or the stacked parameters (stacked bridge) and whose backward returns ready
    gradients -- what the engine does around the adjoint solve."""

    @staticmethod
    def forward(ctx, x, grads, *params):
        ctx.grads = grads
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return (g, None, *ctx.grads)


def _slope(times: dict) -> float:
    """Per-layer cost: least-squares slope of time against depth (drops fixed overheads)."""
    return perf.fit_step_cost(0.0, list(times), list(times.values())).item


def _clear_grads(params) -> None:
    for q in params:
        q.grad = None


def timer(clock):
    """``timed(fn)``: the ``clock`` time of one call of ``fn`` (``time.perf_counter`` or
    ``time.process_time``)."""
    def timed(fn):
        t0 = clock()
        fn()
        return clock() - t0
    return timed


def _levels(lp, options: MGRITOptions, reverse: bool) -> int:
    part = lp.partition.reversed() if reverse else lp.partition
    return Hierarchy(part, lp.comm.Get_rank(), options.cfactor, options.max_levels,
                     options.min_coarse).n_levels


def _strided(B: int, like: torch.Tensor):
    """Disjoint strided row sets ``(sources, targets)`` of ``B`` rows of one state array, as
    F-relaxation reads and writes them (every other row here)."""
    S = torch.randn(2 * B + 1, *like.shape, dtype=like.dtype, device=like.device)
    return S[0:2 * B:2], S[1:2 * B + 1:2]


def chain_costs(lp, x, m, clock, repeats=3, inner=20, solver_options=None, per_layer_opt=0.0,
                backward: MGRITOptions | None = None) -> perf.TrainCosts:
    """The layer-parallel part of :class:`mgrit.perf.TrainCosts` for this rank's layers of ``lp``
    (a :class:`~mgrit.nn.LayerParallelResNet` after one training forward, whose states are
    used) at the batch of ``x`` (``(batch, *state_shape)``), each timed through the path a
    training step of ``lp`` runs (see the module docstring): ``lp``'s forward options, and its
    backward options or ``backward`` (e.g. ``MGRITOptions(max_levels=1)``: Kirby's serial
    adjoint after the same forward). Batched calls over intervals strided by ``m`` as the
    solver makes them (inputs allocated outside the timed calls). With ``solver_options``
    (the forward solve's MGRITOptions) the solver's bookkeeping (:func:`solver_overhead_fit` on
    this rank's layers) is added to the step costs and gives ``solve_fixed``. When both solves
    have one level only the exact path's fields (``pipe_*``, :func:`pipelined_costs`) are
    timed. Serial fields are 0 (:func:`calibrate` adds them). Collective-free: ranks may
    calibrate at once or one at a time. ``per_layer_opt``: the optimizer step per layer."""
    bwd = lp.bwd_opts if backward is None else backward
    nbytes = x.numel() * x.element_size()
    zero = perf.StepCost(0.0, 0.0, 0.0)
    if _levels(lp, lp.fwd_opts, False) == 1 and _levels(lp, bwd, True) == 1:
        pf, pb, ff, fb = pipelined_costs(lp, x, clock, repeats)
        return perf.TrainCosts(fwd=zero, adj=zero, serial_fwd=0.0, serial_bwd=0.0,
                               per_layer=per_layer_opt, nbytes=nbytes, pipe_fwd=pf, pipe_bwd=pb,
                               pipe_fwd_fixed=ff, pipe_bwd_fixed=fb)
    timed = timer(clock)
    ch, N, first, n = lp.chain, lp.n_layers, lp.first, len(lp.steps)
    sizes = [B for B in (2, 8, 32, 64) if B < n - 1]
    sizes = sizes if len(sizes) >= 2 else [1, 2]  # a short block: the fit needs two sizes
    # intervals strided by m as the solver's calls; a smaller stride where B * m does not fit
    sd = {B: (m if B * m < n else max(1, (n - 2) // B)) for B in sizes}
    rows = {B: _strided(B, x) for B in sizes}
    u1 = torch.randn(*x.shape, dtype=x.dtype)
    i0 = N - first - n + 1  # reversed index of this rank's last layer + 1
    kw = dict(sizes=sizes, repeats=repeats, inner=inner, clock=clock)
    # the bridge's inputs: the stacked parameters (multilevel batched adjoint) or each one
    multi = _levels(lp, bwd, True) > 1
    stacked = ch.batched and bwd.batched and bwd.max_levels > 1
    names = [k for k, _ in lp.steps[0].named_parameters()] if stacked else []
    checked = [*lp.steps.parameters(), *lp.steps.buffers()]

    def snapshot():  # the forward's side of the bridge (MGRITFunction.apply and its solve)
        tuple(map(_version, checked))
        return ch.refresh(grad=True) if stacked else ch.refresh()
    refresh = med([timed(snapshot) for _ in range(repeats)]) / n
    snap = snapshot()  # as the solve and the adjoint see it
    tensors = {k: t.detach() for k, t in snap.items()}
    states = lp.last_states

    def adjoint():
        return AdjointChain(ch, N, states, tensors, closed_single=multi)
    fresh = itertools.cycle(range(n))
    with torch.no_grad():
        # forward: single steps as sequential sweeps apply them (consecutive layers), batched
        # steps written into strided rows of the state array (F-relaxation)
        fwd = perf.calibrate_step(
            lambda: ch.step(u1, *(lambda j: (first + j, first + j + 1))(next(fresh)), 0),
            lambda B: ch.step_batch_into(rows[B][0], range(first + 1, first + 1 + B * sd[B], sd[B]),
                                         range(first + 2, first + 2 + B * sd[B], sd[B]), 0,
                                         rows[B][1]), **kw)
        adj = adjoint()
        if multi:  # closed-form single steps on one chain per solve
            single = lambda i: adj.step(u1, i, i + 1, 0)  # noqa: E731
        else:  # autograd through the layer's module: its graph is built once per solve
            single = lambda i: adjoint().step(u1, i, i + 1, 0)  # noqa: E731
        adj_cost = perf.calibrate_step(
            lambda: single(N - 1 - first - next(fresh)),
            lambda B: adj.step_batch_into(rows[B][0], range(i0, i0 + B * sd[B], sd[B]),
                                          range(i0 + 1, i0 + 1 + B * sd[B], sd[B]), 0,
                                          rows[B][1]), **kw)
        # once per adjoint solve: linearization (act'(z) of every layer) and reversed copies,
        # made by the first batched step of a fresh chain
        B0 = sizes[0]
        first_call = lambda: adjoint().step_batch_into(  # noqa: E731
            rows[B0][0], range(i0, i0 + B0 * sd[B0], sd[B0]),
            range(i0 + 1, i0 + 1 + B0 * sd[B0], sd[B0]), 0, rows[B0][1])
        setup = max(med([timed(first_call) for _ in range(repeats)]) - adj_cost.batched(B0), 0.0)
    lam = torch.randn(n, *x.shape, dtype=x.dtype)
    if stacked:
        sweep = lambda: adj.stacked_gradients(lam)  # noqa: E731
    else:
        sweep = lambda: adjoint().parameter_gradients(lam, bwd.batched and multi)  # noqa: E731
    pg = med([timed(sweep) for _ in range(repeats)])
    br = _bridge_backward(lp, x, names, timed, repeats)
    fixed = 0.0
    if solver_options is not None:
        o, fixed = solver_overhead_fit(n, tuple(x.shape), solver_options,
                                       lambda fn: timed(fn), repeats, x.dtype)
        fwd, adj_cost = (perf.StepCost(c.single + o.single, c.call + o.call, c.item + o.item)
                         for c in (fwd, adj_cost))
    costs = perf.TrainCosts(fwd=fwd, adj=adj_cost, serial_fwd=0.0, serial_bwd=0.0,
                            pgrad_item=(pg + br + (setup if multi else 0.0)) / n,
                            per_layer=per_layer_opt, refresh=refresh, nbytes=nbytes,
                            solve_fixed=fixed)
    return path_residual(lp, x, costs, bwd, clock, repeats) if solver_options is not None else costs


def path_residual(lp, x, costs: perf.TrainCosts, backward: MGRITOptions, clock,
                  repeats: int = 3) -> perf.TrainCosts:
    """``costs`` with the residual terms ``path_fwd``/``path_bwd`` (per layer) and
    ``fixed_fwd``/``fixed_bwd`` (per forward / backward), and ``path_eval``/``fixed_eval`` of
    an evaluation forward (``torch.no_grad``: no autograd node, a snapshot without autograd;
    the residual of the replay alone, slope unclamped): what the pieces timed on their own miss
    of the real path -- the autograd bridge and the engine, input checks, allocations, the
    caches a whole solve runs through. The real path (a ``LayerParallelResNet`` on
    ``COMM_SELF`` sharing ``lp``'s step modules, ``lp``'s forward options and ``backward``, a
    fixed number of cycles) is timed in steady state (an untimed step first) at ``n // 4`` and
    ``n // 2`` of this rank's ``n`` layers, at least twice the coarsening factor (one depth when
    they coincide: intercept only), never at ``n`` itself: the prediction at ``n`` and at other
    rank counts remains a prediction. Residual = time - :func:`mgrit.perf.resnet_times` of the
    same sub-network (1 rank, free messages); slope and intercept of the residual over the two
    depths, the slope kept >= -(the per-layer term it corrects) and the intercept >= 0.
    Leaves ``.grad`` of ``lp``'s parameters ``None``."""
    timed = timer(clock)
    n, steps, params = len(lp.steps), list(lp.steps), list(lp.steps.parameters())
    fo = dataclasses.replace(lp.fwd_opts, tol=0.0, rtol=0.0)
    bo = dataclasses.replace(backward, tol=0.0, rtol=0.0)
    m = fo.cfactor if isinstance(fo.cfactor, int) else fo.cfactor[0]
    depths = sorted({d for d in (max(n // 4, 2 * m), max(n // 2, 2 * m)) if d <= n})
    if not depths:
        return costs
    g, free = torch.randn_like(x), perf.CommCost(0.0, 1e30)
    rf, rb, re = {}, {}, {}
    for d in depths:
        net = LayerParallelResNet(steps[:d], d, lp.state_shape, T=d * lp.h, forward=fo,
                                  backward=bo, warm_start=False, adjoint=lp.adjoint)
        net(x).backward(g)  # warm-up
        fs, bs, es = [], [], []
        for _ in range(repeats):
            _clear_grads(params)
            net(x).backward(g)  # steady state: the previous step ran just before
            _clear_grads(params)
            box = []
            fs.append(timed(lambda: box.append(net(x))))
            bs.append(timed(lambda: box[0].backward(g)))
            with torch.no_grad():
                net(x)
                es.append(timed(lambda: net(x)))
        pf, pb = perf.resnet_times(d, 1, costs, fo, bo, fo.max_iter, bo.max_iter, free)
        pe, _ = perf.resnet_times(d, 1, costs, fo, bo, fo.max_iter, bo.max_iter, free, grad=False)
        rf[d], rb[d], re[d] = med(fs) - pf, med(bs) - pb, med(es) - pe
    _clear_grads(params)

    def fit(r, per_layer):
        if len(r) == 1:
            (d, v), = r.items()
            return 0.0, max(v, 0.0)
        (a, ra), (b, rb_) = sorted(r.items())
        s = max((rb_ - ra) / (b - a), -per_layer)
        return s, max(rb_ - s * b, 0.0)
    sf, cf = fit(rf, costs.refresh)
    sb, cb = fit(rb, costs.pgrad_item)
    se, ce = fit(re, math.inf)
    return dataclasses.replace(costs, path_fwd=sf, path_bwd=sb, fixed_fwd=cf, fixed_bwd=cb,
                               path_eval=se, fixed_eval=ce)


def _bridge_backward(lp, x, names, timed, repeats) -> float:
    """Seconds of the bridge's backward: the engine hands ready gradients from one node to the
    leaves -- through ``torch.stack``'s node to each layer's parameters (``names``: the stacked
    parameter names) or, with ``names`` empty, one input per parameter -- plus the version
    check of the layers' tensors. The graph is built outside the timing."""
    ch = lp.chain
    checked = [*lp.steps.parameters(), *lp.steps.buffers()]
    params = list(lp.steps.parameters())

    def build():
        _clear_grads(params)
        if names:
            snap = ch.refresh(grad=True)
            ins = [snap[k] for k in names]
        else:
            ins = params
        grads = [torch.zeros_like(t) if t.requires_grad else None for t in ins]
        return _Bridge.apply(x, grads, *ins).sum()

    def run(out):
        tuple(map(_version, checked))
        out.backward()
    run(build())  # warm-up
    ts = []
    for _ in range(repeats):
        out = build()
        ts.append(timed(lambda: run(out)))
    _clear_grads(params)
    return med(ts)


def pipelined_costs(lp, x, clock, repeats=3) -> tuple[float, float, float, float]:
    """``(per-layer forward, per-layer backward, fixed forward, fixed backward)`` seconds of the
    one-level exact path (:mod:`mgrit.nn.resnet.pipelined`) over this rank's layers of ``lp`` at the
    batch of ``x``: the real path run on one process (a ``LayerParallelResNet`` on
    ``COMM_SELF`` sharing ``lp``'s step modules, both solves one level) at ``n // 4`` and ``n``
    layers, training forward (autograd records the layers) and its backward from a fixed
    output gradient; per layer the slope, fixed the intercept (clipped at 0). Messages between
    ranks are the model's (``CommCost``), not in these costs. Leaves ``.grad`` of ``lp``'s
    parameters ``None``."""
    timed = timer(clock)
    n, steps = len(lp.steps), list(lp.steps)
    depths = sorted({max(1, n // 4), n})
    g = torch.randn_like(x)
    params = list(lp.steps.parameters())
    tf, tb = {}, {}
    for d in depths:
        net = LayerParallelResNet(steps[:d], d, lp.state_shape, T=d * lp.h, forward=ONE,
                                  backward=ONE, warm_start=False)
        out = net(x)
        out.backward(g)  # warm-up
        fs, bs = [], []
        for _ in range(repeats):
            _clear_grads(params)
            box = []
            fs.append(timed(lambda: box.append(net(x))))
            bs.append(timed(lambda: box[0].backward(g)))
        tf[d], tb[d] = med(fs), med(bs)
    _clear_grads(params)
    if len(depths) == 1:
        d = depths[0]
        return tf[d] / d, tb[d] / d, 0.0, 0.0
    a, b = depths
    sf, sb = (tf[b] - tf[a]) / (b - a), (tb[b] - tb[a]) / (b - a)
    sf, sb = max(sf, 0.0), max(sb, 0.0)
    return sf, sb, max(tf[b] - b * sf, 0.0), max(tb[b] - b * sb, 0.0)


def calibrate(serial_layers, lp, x, m, per_layer_opt, loss_fn, clock, repeats=3,
              inner=20, solver_options=None, one_at_a_time=None) -> perf.TrainCosts:
    """Costs of the model (mgrit.perf.TrainCosts) of this rank's layers, each piece timed on
    its own: :func:`chain_costs` (the path ``lp`` runs: MGRIT's steps, parameter-gradient
    sweep, snapshot and bridge, with ``solver_options`` the solver's bookkeeping; or the exact
    path) and the serial per-layer costs as slopes over depths 64..512 of ``serial_layers``
    (the two largest of ``n/4, n/2, n`` when fewer than two fit). ``per_layer_opt``: the
    optimizer step per layer, timed by the caller. Called once per repeat, interleaved with the
    measured runs (and, for P = 2, on both ranks at once), so that costs and measurements see
    the same machine state. ``loss_fn(output)``: the scalar loss of the serial layers' output;
    ``clock``: ``time.perf_counter`` or ``time.process_time``. ``one_at_a_time(fn)``: runs
    ``fn`` on each rank in turn while the others wait (the serial slopes are then timed as a
    blocking chain runs: one rank computing at a time); default: call ``fn`` directly."""
    timed = timer(clock)
    c = chain_costs(lp, x, m, clock, repeats, inner, solver_options, per_layer_opt)
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
    out = {}
    for f in dataclasses.fields(perf.TrainCosts):
        v = getattr(cs[0], f.name)
        if isinstance(v, perf.StepCost):
            out[f.name] = perf.StepCost(*(reduce([getattr(getattr(c, f.name), k) for c in cs])
                                          for k in ("single", "call", "item")))
        elif f.name == "nbytes":
            out[f.name] = v
        else:
            out[f.name] = reduce([getattr(c, f.name) for c in cs])
    return perf.TrainCosts(**out)


def costs_to_json(c):
    return dataclasses.asdict(c)


def costs_from_json(d):
    return perf.TrainCosts(**{k: (perf.StepCost(**v) if isinstance(v, dict) else v)
                              for k, v in d.items()})


def p2_costs(per_rank):
    """Costs for the P = 2 model from both ranks' calibrations: MGRIT's (ranks work at once,
    the critical path waits for the slower one) field-wise max; the costs of chains whose
    ranks work in turn (serial autograd, the exact path's layers), so that their times add up,
    the mean."""
    slow, mean = median_costs(per_rank, max), median_costs(per_rank)
    return dataclasses.replace(slow, **{f: getattr(mean, f) for f in (
        "serial_fwd", "serial_bwd", "pipe_fwd", "pipe_bwd")})
