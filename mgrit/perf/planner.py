"""What should I run? Data parallelism, layer-parallel MGRIT, pipelining or a hybrid grid.

:func:`recommend` answers "for this network, batch, ``P`` workers and machine, what is fastest
per training step?" from

1. calibrated costs of the network on this machine (:mod:`mgrit.perf.netcal`: autograd per
   layer, head and tail at every batch size the options need; MGRIT's batched/single steps,
   adjoint, parameter-gradient sweep and solver bookkeeping at each shard size), or costs the
   caller passes;
2. the measured convergence of the user's network (:func:`probe`): for each MGRIT configuration
   (coarsening factor ``m``, levels ``L``, F- or FCF-relaxation) a short solve on the sample
   batch gives the forward convergence factor and the relative error of the parameter gradient
   after ``K_f`` forward cycles (exact adjoint) and after ``K_b`` adjoint cycles (exact forward);
   the cheapest ``(K_f, K_b)`` whose errors add up to at most ``grad_tol`` is then checked with a
   real ``(K_f, K_b)`` solve. Cold start: training warm-starts from the previous batch's states
   and usually needs fewer cycles, so the probe errs on the safe side.
3. :mod:`mgrit.perf.strategies`: the predicted step time of every option on every
   ``P_L x P_D`` grid -- serial, data parallelism, GPipe (best ``M``; ``M = 1`` is the blocking
   chain), MGRIT (best probed configuration), and their hybrids with data parallelism; for a
   dense ResNet also serial and data parallelism on the lean loop (:mod:`mgrit.perf.lean`,
   ``settings["kernel"] = "lean"``: the strongest serial PyTorch, issue 34).

The answer is the simplest option among those predicted within ``margin`` (default 10%, about
the model's validated error, ``experiments/results/benchmarks/bench_layerparallel.md`` part d) of the
fastest -- serial, then data parallelism, GPipe, MGRIT: a more complex option must win by more
than the model can resolve -- "use data parallelism" when that is it, with every option's
predicted time and the reasons (:meth:`Recommendation.report`). CLI: ``experiments/benchmarks/plan.py``.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from . import netcal
from .model import CommCost
from .probe import (MGRITConfig, Network, Probe, exact_gradient, grad_error, mgrit_configs,
                    probe, probe_net)
from .strategies import (NetCosts, best_gpipe, data_parallel_step, grids, mgrit_step,
                         serial_step)

__all__ = ["Network", "MGRITConfig", "Probe", "Option", "Recommendation", "probe",
           "mgrit_configs", "choose", "simplest", "recommend", "lean_netcosts", "SIMPLICITY"]

#: kinds from the simplest (fewest workers, least communication, exact) to the most complex
SIMPLICITY = {"serial": 0, "data parallel": 1, "GPipe": 2, "MGRIT": 3}


@dataclass
class Option:
    """One way to run the step: ``kind`` in serial / data parallel / GPipe / MGRIT; ``P_L`` layer
    ranks x ``P_D`` replicas; ``settings``; predicted ``time`` (s); ``note``."""
    kind: str
    P_L: int
    P_D: int
    time: float
    settings: dict = field(default_factory=dict)
    note: str = ""

    @property
    def label(self) -> str:
        grid = f"{self.P_L} x {self.P_D}"
        s = ", ".join(f"{k} {v}" for k, v in self.settings.items())
        return f"{self.kind} ({grid}{', ' + s if s else ''})"


@dataclass
class Recommendation:
    """The recommended option (``best``: :func:`simplest` within ``margin``), every option
    considered, the probes, the inputs."""
    best: Option
    options: list
    probes: list
    P: int
    batch: int
    grad_tol: float
    costs: NetCosts | None = None
    comm: CommCost | None = None
    margin: float = 0.0

    def report(self) -> str:
        """Markdown: the recommendation, why, and every option's predicted step time."""
        b = self.best
        ser = next(o for o in self.options if o.kind == "serial")
        L = [f"**Recommendation for P = {self.P}, batch {self.batch}: {b.label}** -- predicted "
             f"{b.time * 1e3:.2f} ms per training step, {_times(ser.time, b.time)} the serial step.", ""]
        if self.costs is not None and self.costs.unreliable:
            L += ["**Calibration unreliable** (the prediction may be off): "
                  + "; ".join(self.costs.unreliable), ""]
        L += ["Why: " + " ".join(_reasons(self)), "",
              "| option | grid P_L x P_D | settings | predicted step [ms] | vs serial | note |",
              "|---|---|---|---|---|---|"]
        for o in sorted(self.options, key=lambda o: o.time):
            s = ", ".join(f"{k} {v}" for k, v in o.settings.items())
            L.append(f"| {'**' + o.kind + '**' if o is b else o.kind} | {o.P_L} x {o.P_D} | {s} | "
                     f"{o.time * 1e3:.2f} | {_times(ser.time, o.time)} | {o.note} |")
        if self.probes:
            L += ["", f"Convergence probe (cold start, sample batch; gradient error target "
                  f"{self.grad_tol:g}, relative to exact backpropagation):", "",
                  "| MGRIT config | forward conv. factor | grad. error K_f = 1..n (exact adjoint) | "
                  "grad. error K_b = 1..n (exact forward) | chosen K_f / K_b | measured error |",
                  "|---|---|---|---|---|---|"]
            for p in self.probes:
                fmt = lambda v: ", ".join(f"{e:.1e}" for e in v)  # noqa: E731
                ch = f"{p.K_f} / {p.K_b}" if p.K_f else "none within the probe"
                L.append(f"| {p.config} | {p.factor:.3f} | {fmt(p.fwd_err)} | {fmt(p.bwd_err)} | "
                         f"{ch} | {'-' if p.err is None else f'{p.err:.1e}'} |")
        return "\n".join(L)


def _times(a: float, b: float) -> str:
    """``a / b`` as ``"1.23x"``; ``"n/a"`` when ``b`` is not > 0 (never divides by it)."""
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def _reasons(rec: Recommendation) -> list:
    best = {}
    for o in rec.options:
        if o.kind not in best or o.time < best[o.kind].time:
            best[o.kind] = o
    b, out = rec.best, []
    others = sorted((o for k, o in best.items() if k != b.kind), key=lambda o: o.time)
    fastest = min(rec.options, key=lambda o: o.time)
    if fastest.time < b.time:
        out.append(f"The fastest prediction, {fastest.label} ({fastest.time * 1e3:.2f} ms), is "
                   f"within {rec.margin:.0%} of {b.kind} (the planner's margin, about the "
                   f"model's error): the simpler option is recommended.")
    elif others:
        out.append(f"{b.kind} is {_times(others[0].time, b.time)} faster than the next kind, "
                   f"{others[0].label} ({others[0].time * 1e3:.2f} ms).")
    c = rec.costs
    if c is not None and rec.P > 1:
        shard = -(-rec.batch // rec.P)
        num, den = c.layer_fb(shard), c.layer_fb(rec.batch)
        if den > 0:  # > 0 by NetCosts' contract; the guard keeps a report from dividing by 0
            r = num / den
            out.append(f"A layer costs {r:.2f}x as much at the shard size {shard} as at batch "
                       f"{rec.batch} ({'call-bound: splitting the batch gains little' if r > 0.7 else 'it scales with the batch: data parallelism gains'}).")
    if "MGRIT" in best:
        o = best["MGRIT"]
        out.append(f"MGRIT needs K_f = {o.settings['K_f']} / K_b = {o.settings['K_b']} cycles for "
                   f"gradient error <= {rec.grad_tol:g} ({o.settings['config']}).")
    elif rec.P > 1:
        out.append("No MGRIT configuration reached the gradient error target within the probe.")
    return out


def _pairs(p: Probe, grad_tol: float) -> list:
    """``(K_f, K_b)`` with ``fwd_err[K_f - 1] + bwd_err[K_b - 1] <= grad_tol``."""
    return [(kf, kb) for kf in range(1, len(p.fwd_err) + 1) for kb in range(1, len(p.bwd_err) + 1)
            if p.fwd_err[kf - 1] + p.bwd_err[kb - 1] <= grad_tol]


def simplest(options: Sequence[Option], margin: float) -> Option:
    """The simplest kind (:data:`SIMPLICITY`) among ``options`` predicted within ``margin``
    (a fraction, >= 0) of the fastest; ties by predicted time. ``margin=0``: the fastest."""
    if not options:
        raise ValueError("options is empty: simplest() needs at least one Option")
    fastest = min(o.time for o in options)
    near = [o for o in options if o.time <= (1 + margin) * fastest]
    return min(near, key=lambda o: (SIMPLICITY[o.kind], o.time))


def choose(costs: NetCosts, batch: int, P: int, comm: CommCost, probes: Sequence[Probe] = (),
           grad_tol: float = 0.05, lean: NetCosts | None = None) -> tuple[list, list]:
    """Every option on every grid (see module doc) from ``costs`` and measured ``probes``
    (their ``K_f``/``K_b``, where unset and not yet checked (``err`` None), are set here: the
    cheapest pair on the most layer-parallel grid with ``fwd_err[K_f - 1] + bwd_err[K_b - 1]
    <= grad_tol``; a probe whose checked pairs all failed keeps None: no MGRIT option).
    ``lean``: the same network's costs with the lean loop's residual layers
    (:func:`lean_netcosts`); adds the serial and data-parallel options on that kernel
    (``settings["kernel"] = "lean"``), the strongest serial PyTorch a user can write for a
    dense ResNet (issue 34, item 6). Returns ``(options, probes)``; pure: no timing, no
    solve."""
    N = costs.n_layers
    gs = grids(P, N, batch)
    top = max(q for q, _ in gs)  # the most layer-parallel grid sets the iteration counts
    for p in probes:
        ks = _pairs(p, grad_tol)
        if p.K_f is None and p.err is None and ks and top > 1:
            p.K_f, p.K_b = min(ks, key=lambda k: mgrit_step(
                costs, batch, top, p.config.options(k[0]), p.config.options(k[1]), k[0], k[1],
                comm, P // top)["train"])
    opts = [Option("serial", 1, 1, serial_step(costs, batch), note="one worker")]
    if lean is not None:
        opts.append(Option("serial", 1, 1, serial_step(lean, batch), {"kernel": "lean"},
                           "one worker, lean loop"))
    for P_L, P_D in gs:
        if P_L == 1 and P_D > 1:
            opts.append(Option("data parallel", 1, P_D, data_parallel_step(costs, batch, P_D, comm)))
            if lean is not None:
                opts.append(Option("data parallel", 1, P_D,
                                   data_parallel_step(lean, batch, P_D, comm), {"kernel": "lean"},
                                   "lean loop replicas"))
        if P_L > 1:
            t, M = best_gpipe(costs, batch, P_L, comm, P_D)
            opts.append(Option("GPipe", P_L, P_D, t, {"M": M},
                               "M = 1: blocking chain" if M == 1 else ""))
            for p in probes:
                if p.K_f is None:
                    continue
                t = mgrit_step(costs, batch, P_L, p.config.options(p.K_f),
                               p.config.options(p.K_b), p.K_f, p.K_b, comm, P_D)["train"]
                opts.append(Option("MGRIT", P_L, P_D, t, {"config": str(p.config), "K_f": p.K_f,
                                                           "K_b": p.K_b}))
    # keep the fastest MGRIT per grid (the table lists one row per kind and grid)
    seen, out = {}, []
    for o in sorted(opts, key=lambda o: o.time):
        key = (o.kind, o.P_L, o.P_D, o.settings.get("kernel"))
        if key not in seen:
            seen[key] = o
            out.append(o)
    return out, list(probes)


def recommend(network: Network, x: torch.Tensor, P: int, target=None, comm: CommCost = CommCost(),
              costs: NetCosts | None = None, grad_tol: float = 0.05, max_iters: int = 4,
              configs: Sequence[MGRITConfig] | None = None, repeats: int = 3,
              clock: Callable[[], float] = time.perf_counter, max_probes: int = 6,
              margin: float = 0.10, lean: bool | NetCosts | None = None) -> Recommendation:
    """Recommend how to train ``network`` with batches like ``x`` (the sample batch; its size is
    the global batch) on ``P`` workers.

    Args:
        network: a :class:`Network` (``Network.from_sequential(model, state_shape, loss)`` or
            ``Network.from_factory(make_step, N, state_shape, ...)``).
        x, target: a real sample batch and its targets (``loss_fn``'s second argument).
        P: workers (ranks), ``>= 1``.
        comm: message cost (:func:`mgrit.perf.pingpong` measures it; default a nominal
            interconnect, 5 us + bytes / 5 GB/s).
        costs: calibrated :class:`NetCosts` (with MGRIT costs) to skip the calibration.
        grad_tol: relative parameter-gradient error MGRIT may leave (default 0.05).
        max_iters: cycles probed per direction (default 4).
        configs: MGRIT configurations to consider (default :func:`mgrit_configs`).
        repeats, clock: of the calibration's timings.
        max_probes: probe at most this many configurations, cheapest predicted first (probing
            stops early once a configuration's one-cycle prediction cannot win).
        margin: recommend the simplest option predicted within this fraction of the fastest
            (default 0.10: about the cost model's validated error on this machine; 0: always
            the fastest prediction). See :func:`simplest`.
        lean: the lean-loop candidates (serial and data parallel on
            :class:`~mgrit.perf.lean.LeanResNet` kernels): ``None`` (default) calibrates them
            with the network's costs (not when ``costs`` is given) where every step is a
            :class:`~mgrit.nn.DenseStep` of one activation (tanh/relu); ``True`` calibrates
            them also with given ``costs``; ``False`` leaves them out; a :class:`NetCosts`
            (:func:`lean_netcosts`) uses those costs.

    Raises:
        ValueError: ``P < 1``, an empty batch, ``grad_tol <= 0``, ``max_iters < 1``,
            ``margin`` not in [0, 1].

    Warns:
        RuntimeWarning: the calibration could not resolve some costs (``costs.unreliable``:
            fits clamped to the clock's resolution; the report repeats the notes).
    """
    if isinstance(P, bool) or not isinstance(P, int) or P < 1:
        raise ValueError(f"P={P!r} is not allowed: use an int >= 1")
    if x.shape[0] < 1:
        raise ValueError("the sample batch x is empty")
    if not grad_tol > 0 or max_iters < 1:
        raise ValueError(f"grad_tol={grad_tol!r} / max_iters={max_iters!r}: use > 0 / >= 1")
    if not (isinstance(margin, (int, float)) and 0 <= margin <= 1):
        raise ValueError(f"margin={margin!r} is not allowed: use a fraction in [0, 1]")
    b, N = x.shape[0], network.n_layers
    cfgs = list(configs) if configs is not None else mgrit_configs(N)
    calibrated = costs is None
    if calibrated:
        costs = calibrate(network, x, target, P, cfgs, repeats, clock)
    if lean is True or (lean is None and calibrated):
        lean = lean_netcosts(network, costs, P, x.shape[0], repeats, clock)
    elif not isinstance(lean, NetCosts):
        lean = None
    if costs.unreliable:
        warnings.warn("planner: calibration unreliable, predictions may be off: "
                      + "; ".join(costs.unreliable), RuntimeWarning, stacklevel=2)
    probes = []
    if P > 1 and cfgs and costs.mgrit is not None and P <= N:
        z0 = network.residual_input(x)
        exact = exact_gradient(network, z0, target)
        layer_grids = [(q, d) for q, d in grids(P, N, b) if q > 1]

        def fastest(c, kf, kb):  # the best grid's predicted step of c with kf / kb cycles
            return min(mgrit_step(costs, b, q, c.options(kf), c.options(kb), kf, kb, comm, d)["train"]
                       for q, d in layer_grids)
        # cheapest first by the one-cycle prediction (a lower bound of every iteration count)
        bound = {c: fastest(c, 1, 1) for c in cfgs}
        others = min(o.time for o in choose(costs, b, P, comm, (), grad_tol, lean)[0])
        best_t = math.inf
        for c in sorted(cfgs, key=bound.get)[:max_probes]:
            if probes and bound[c] >= min(best_t, others):
                break
            p = probe(network, x, target, c, max_iters, exact)
            # the cheapest pairs whose one-sided errors add up to <= grad_tol, each checked
            # with a real (K_f, K_b) solve (the sum is an estimate, not a bound)
            for kf, kb in sorted(_pairs(p, grad_tol), key=lambda k: fastest(c, *k))[:3]:
                p.err = grad_error(network, probe_net(network, c.options(kf), c.options(kb)),
                                   z0, target, exact)
                if p.err <= grad_tol:
                    p.K_f, p.K_b = kf, kb
                    best_t = min(best_t, fastest(c, kf, kb))
                    break
            probes.append(p)
    options, probes = choose(costs, b, P, comm, probes, grad_tol, lean)
    return Recommendation(simplest(options, margin), options, probes, P, b, grad_tol, costs,
                          comm, margin)


def lean_netcosts(network: Network, costs: NetCosts, P: int, batch: int, repeats: int = 3,
                  clock=time.perf_counter) -> NetCosts | None:
    """``costs`` with the residual layers' forward, forward + backward and optimizer step of
    the lean loop (:func:`mgrit.perf.netcal.lean_costs` of the network's own weights, at the
    batch sizes of ``costs``); head, tail, loss and fixed costs stay the module calibration's.
    ``None`` when a step is not a :class:`~mgrit.nn.DenseStep` (the lean loop's only kernel)."""
    from torch import nn

    from ..nn.steps import DenseStep, ResidualStep
    from .lean import LeanResNet
    if not all(isinstance(f, DenseStep) for f in network.steps):
        return None
    try:
        lean = LeanResNet.from_sequential(nn.Sequential(*(ResidualStep(f, network.h)
                                                          for f in network.steps)))
    except ValueError:  # mixed activations or widths: no lean kernel
        return None
    lc = netcal.lean_costs(lean, costs.layer_fb.sizes, repeats, clock)
    return replace(costs, layer_fwd=lc.layer_fwd, layer_fb=lc.layer_fb, opt_layer=lc.opt_layer,
                   mgrit=None, unreliable=costs.unreliable + lc.unreliable)


def calibrate(network: Network, x: torch.Tensor, target, P: int, configs: Sequence[MGRITConfig],
              repeats: int = 3, clock=time.perf_counter) -> NetCosts:
    """NetCosts of ``network`` at every batch size the options for ``P`` workers need, with
    MGRIT costs (timed lazily per shard size, with the first of ``configs``)."""
    b = x.shape[0]
    extra = [-(-b // d) for d in range(1, P + 1) if P % d == 0]
    sizes = netcal.batch_sizes(b, extra)
    costs = netcal.module_costs(network.head, network.steps, network.h, network.tail,
                                network.loss_fn, x, target, sizes, repeats, clock)
    if not configs:
        return costs
    cfg = min(configs, key=lambda c: abs(math.log(c.cfactor) - 0.5 * math.log(network.n_layers)))

    def mg(shard):
        z = netcal._rows(network.residual_input(x), shard)
        return netcal.mgrit_costs(network.steps, network.state_shape, network.T, z,
                                  cfg.options(2), repeats, 10, clock, costs.opt_layer)
    return netcal.with_mgrit(costs, mg)
