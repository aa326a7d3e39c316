"""Calibration of the cost model (:mod:`mgrit.perf`) for a layer-parallel ResNet of dense steps:
each input of :class:`mgrit.perf.TrainCosts` timed on its own, on the machine at hand. Used by
``experiments/bench_layerparallel.py`` (part d), which calls it once per repeat, interleaved with
the runs the model is validated against."""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import warnings

import torch

from mpi4py import MPI

from . import model as perf
from mgrit.nn.chains import AdjointChain
from mgrit.propagator import Propagator
from mgrit.solver import MGRIT

__all__ = ["calibrate", "median_costs", "p2_costs", "costs_to_json", "costs_from_json",
           "model_section"]

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


def solver_overhead(n, shape, options, timed, repeats=3, dtype=torch.float32):
    """MGRIT bookkeeping (level operations, state updates, residuals) in the form of a
    :class:`mgrit.perf.StepCost` to add to the step costs, from 1-rank solves with a free
    propagator: per single step from a one-level solve over ``n`` intervals (the sequential
    sweep that coarse solves and one-interval F-relaxations run), per batched call and per
    interval from ``options`` solves over ``n`` and ``n // 2`` intervals (a least-squares fit
    after the singles' share)."""
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


def calibrate(serial_layers, lp, x, m, per_layer_opt, refresh, loss_fn, clock, repeats=3,
              inner=20, solver_options=None, one_at_a_time=None) -> perf.TrainCosts:
    """Costs of the model (mgrit.perf.TrainCosts) of this rank's layers, each piece timed on
    its own: batched and single forward / adjoint steps over intervals strided by ``m`` as
    the solver calls them (inputs allocated outside the timed calls); serial per-layer costs
    as slopes over depths 64..512 of ``serial_layers``; the parameter-gradient sweep (incl. the
    adjoint's linearization) and the autograd bridge per layer. ``per_layer_opt``/``refresh``:
    optimizer step and parameter stacking per layer, timed separately by the caller. Called
    once per repeat, interleaved with the measured runs (and, for P = 2, on both ranks at
    once), so that costs and measurements see the same machine state. ``loss_fn(output)``:
    the scalar loss of the serial layers' output; ``clock``: ``time.perf_counter`` or
    ``time.process_time``. ``solver_options``: the forward solve's MGRITOptions; when given,
    the solver's bookkeeping (:func:`solver_overhead`, on this rank's ``n`` layers) is added
    to the step costs (per single step, per batched call and per interval).
    ``one_at_a_time(fn)``: runs ``fn`` on each rank in turn while the others wait (the serial
    slopes are then timed as a blocking chain runs: one rank computing at a time); default:
    call ``fn`` directly."""
    def timed(fn):
        t0 = clock()
        fn()
        return clock() - t0

    ch, N, first, n = lp._chain, lp.n_layers, lp.first, len(lp.steps)
    sizes = [B for B in (2, 8, 32, 64) if B < n - 1]
    # intervals strided by m as the solver's calls; a smaller stride where B * m does not fit
    sd = {B: (m if B * m < n else max(1, (n - 2) // B)) for B in sizes}
    U = {B: torch.randn(B, *x.shape) for B in sizes}
    u1 = torch.randn(*x.shape)
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
    fwd_t, train_t = {}, {}

    def serial_slopes():
        for d in (64, 128, 256, 512):
            if d <= len(serial_layers):
                short = serial_layers[:d]
                with torch.no_grad():
                    fwd_t[d] = med([timed(lambda: short(x)) for _ in range(repeats)])
                train_t[d] = med([timed(lambda: loss_fn(short(x)).backward())
                                  for _ in range(repeats)])
    (one_at_a_time or (lambda fn: fn()))(serial_slopes)
    sf = _slope(fwd_t)
    lam = torch.randn(n, *x.shape)
    pg = med([timed(lambda: AdjointChain(ch, N, lp._states).parameter_gradients(lam, True))
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
    if solver_options is not None:
        o = solver_overhead(n, tuple(x.shape), solver_options, timed, repeats, x.dtype)
        fwd, adj_cost = (perf.StepCost(c.single + o.single, c.call + o.call, c.item + o.item)
                         for c in (fwd, adj_cost))
    return perf.TrainCosts(fwd=fwd, adj=adj_cost, serial_fwd=sf, serial_bwd=_slope(train_t) - sf,
                           pgrad_item=(pg + br) / n, per_layer=per_layer_opt, refresh=refresh,
                           nbytes=x.numel() * x.element_size())


def median_costs(cs, reduce=med):
    """Field-wise median (or ``reduce``, e.g. ``max``) of several TrainCosts: the median over
    repeats; over ranks, ``max`` (the critical path waits for the slower rank)."""
    step = lambda name: perf.StepCost(*(reduce([getattr(getattr(c, name), f) for c in cs])  # noqa: E731
                                        for f in ("single", "call", "item")))
    return perf.TrainCosts(fwd=step("fwd"), adj=step("adj"),
                           **{f: reduce([getattr(c, f) for c in cs])
                              for f in ("serial_fwd", "serial_bwd", "pgrad_item", "per_layer",
                                        "refresh")}, nbytes=cs[0].nbytes)


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


#: (row label, P, key of the measured runs, method and quantity of mgrit.perf.training_times)
_VALIDATED = [("P=1 serial fwd", 1, "serial_fwd", "serial", "forward"),
              ("P=1 MGRIT fwd", 1, "mgrit_fwd_cold", "mgrit", "forward"),
              ("P=1 serial train", 1, "serial", "serial", "train"),
              ("P=1 MGRIT train", 1, "mgrit", "mgrit", "train"),
              ("P=2 chain fwd", 2, "chain_fwd", "layerwise", "forward"),
              ("P=2 MGRIT fwd", 2, "mgrit_fwd", "mgrit", "forward"),
              ("P=2 chain train", 2, "chain_train", "layerwise", "train"),
              ("P=2 MGRIT train", 2, "mgrit_train", "mgrit", "train")]


def model_section(r1, r2, Ns, relax, opts) -> list:
    """Part d of ``experiments/bench_layerparallel.py``: the model's predictions from the
    calibrations of the 1-process (``r1``) and 2-rank (``r2``) parts vs the measured runs
    (per repeat and of the medians), the operation counts, the calibrated costs and Kirby's
    setting; returns markdown lines. ``opts(m, iterations, relax)`` builds MGRITOptions."""
    L = []
    big = max(Ns)
    L += ["## d. Cost model (mgrit.perf), calibrated on this machine", ""]
    errs = []
    rows = ["| N | quantity | measured [s] (median) | predicted [s] (median costs) | error of the medians | error, median over repeats |",
            "|---|---|---|---|---|---|"]
    for N in Ns:
        r, c = r1[N], r1[N]["costs"]
        c2 = p2_costs([costs_from_json(d) for d in r2[N]["costs"]])
        cc = perf.CommCost(*r2[N]["comm"])
        m = r["best_m"]
        fo, bo = opts(m, 2, relax), opts(m, 1, relax)
        t1, t2 = perf.training_times(N, 1, c, fo, bo, 2, 1, cc), perf.training_times(N, 2, c2, fo, bo, 2, 1, cc)
        # per repeat: the prediction from that repeat's calibration vs that repeat's runs
        per1 = [perf.training_times(N, 1, ci, fo, bo, 2, 1, cc) for ci in r["cal_raw"]]
        per2 = [perf.training_times(N, 2, p2_costs([costs_from_json(d[i]) for d in
                                                    r2[N]["costs_raw"]]), fo, bo, 2, 1, cc)
                for i in range(len(r2[N]["costs_raw"][0]))]
        src = {1: (r["tb"], r["tb_raw"], t1, per1), 2: (r2[N], r2[N]["raw"], t2, per2)}
        for name, P, key, method, what in _VALIDATED:
            meas_all, meas_raw, pred_all, pred_raw = src[P]
            meas, pred = meas_all[key], pred_all[method][what]
            e = (pred - meas) / meas
            ep = med([(q[method][what] - a) / a for a, q in zip(meas_raw[key], pred_raw)])
            errs.append((P, abs(ep)))
            rows.append(f"| {N} | {name} | {meas:.4f} | {pred:.4f} | {e * 100:+.0f}% | {ep * 100:+.0f}% |")
        sim = perf.simulate(N, 2, fo)
        got = [{k: s[k] for k in ("steps_single", "steps_batched_calls", "steps_batched_items", "messages")}
               for s in r2[N]["stats"]]
        want = [{k: v for k, v in sim.rank(q).items() if k != "allreduces"} for q in range(2)]
        rows.append(f"| {N} | P=2 op counts per rank (measured == model) | {got} | {want} | "
                    f"{'equal' if got == want else 'DIFFER'} | |")
    e1, e2 = (max(e for P, e in errs if P == q) for q in (1, 2))
    L += rows + ["", f"Max |error| (median over repeats of the per-repeat error): P = 1 {e1 * 100:.0f}%, "
                 f"P = 2 {e2 * 100:.0f}% (target 25%: "
                 f"**{'MET' if max(e1, e2) <= 0.25 else 'MISSED'}**). Calibration: every repeat "
                 f"re-measures the model's inputs right after its measured runs (P = 1 in the "
                 f"1-process part, with its clock; P = 2 on both ranks at once in the 2-rank job, "
                 f"wall clock: MGRIT's costs on both ranks at once, with the contention of two busy "
                 f"cores, the serial costs one rank at a time, as the chain runs) and "
                 f"the model uses the medians over repeats (P = 2: MGRIT's costs of the slower rank, "
                 f"the serial costs averaged over the ranks); the measured runs are never inputs. Message cost "
                 f"from the 2-rank ping-pong (wall clock).", ""]
    c, cc = r1[big]["costs"], perf.CommCost(*r2[big]["comm"])
    c2 = p2_costs([costs_from_json(d) for d in r2[big]["costs"]])
    L += ["Calibrated costs (N = %d; P = 1: one process; P = 2: MGRIT's of the slower rank, serial averaged over the ranks):" % big, "",
          "| P | fwd step single [us] | fwd batched [us/call + us/interval] | adjoint single [us] | "
          "adjoint batched [us/call + us/interval] | serial fwd / bwd per layer [us] | backward outside "
          "the adjoint solve per layer [us] | optimizer / stacking per layer [us] |",
          "|---|---|---|---|---|---|---|---|"]
    for P, k in ((1, c), (2, c2)):
        L.append(f"| {P} | {k.fwd.single * 1e6:.1f} | {k.fwd.call * 1e6:.1f} + {k.fwd.item * 1e6:.2f} | "
                 f"{k.adj.single * 1e6:.1f} | {k.adj.call * 1e6:.1f} + {k.adj.item * 1e6:.2f} | "
                 f"{k.serial_fwd * 1e6:.1f} / {k.serial_bwd * 1e6:.1f} | {k.pgrad_item * 1e6:.2f} | "
                 f"{k.per_layer * 1e6:.2f} / {k.refresh * 1e6:.2f} |")
    L += ["", "Backward outside the adjoint solve = the adjoint's linearization + the batched "
          "parameter-gradient sweep + the autograd bridge (the engine handing one gradient per "
          "parameter tensor to the optimizer).", ""]
    N64 = 4096
    ko = opts(64, 2, relax)
    L += [f"Kirby's setting (N = {N64}, P = 64, 2 levels, m = 64, 2 iterations), predicted speedup "
          f"over layer-wise model parallelism, with the per-rank costs calibrated here: `dedicated` "
          f"= the 1-process costs (a rank with a core to itself, as Kirby's one GPU per rank), "
          f"`shared` = the 2-rank costs (two ranks contending for this VM's memory system):", "",
          "| per-rank costs | message cost | forward solve | forward excl. parameter stacking | training step (adjoint MGRIT, 1 it) |",
          "|---|---|---|---|---|"]
    sks = {}
    for cname, ck in (("dedicated", c), ("shared", c2)):
        for name, cm in [(f"measured here ({cc.latency * 1e6:.0f} us latency)", cc),
                         ("nominal interconnect (10 us, 10 GB/s)", perf.CommCost(10e-6, 10e9))]:
            tk = perf.training_times(N64, 64, ck, ko, opts(64, 1, relax), 2, 1, cm)
            fx = tk["mgrit"]["forward"] - (N64 // 64) * ck.refresh
            sks[cname, name[:7]] = tk["layerwise"]["forward"] / tk["mgrit"]["forward"]
            L.append(f"| {cname} | {name} | {sks[cname, name[:7]]:.1f}x | "
                     f"{tk['layerwise']['forward'] / fx:.1f}x | "
                     f"{tk['layerwise']['train'] / tk['mgrit']['train']:.1f}x |")
    unit = perf.StepCost(1.0, 0.0, 1.0)  # Kirby's arithmetic: every step costs the same, free messages
    su = N64 / perf.simulate(N64, 64, ko, 2, tau=unit, comm=perf.CommCost(0.0, 1e30)).critical_path
    L.append(f"| unit step cost | free messages (operation count on the critical path) | {su:.1f}x | - | - |")
    kd, ks = sks["dedicated", "nominal"], sks["shared", "nominal"]
    L += ["", f"Target >= 10x (forward, Kirby's setting, nominal interconnect): "
          f"**{'MET' if kd >= 10 else 'MISSED'}** with dedicated per-rank costs ({kd:.1f}x); "
          f"{ks:.1f}x with shared ones.", ""]
    return L
