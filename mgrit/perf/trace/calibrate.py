"""Costs for the replay of a layer-parallel ResNet's trace, measured on one dedicated core (one
process, ``MPI.COMM_SELF``), and the cost model's training-step costs built from them.

:func:`calibrate` measures, per batch size, for the dense ResNet of
:func:`~mgrit.perf.trace.resnet.trace_resnet`:

* the step costs of the forward and adjoint solves (:func:`~mgrit.perf.trace.step_costs`,
  fitted to the recorded steps of a one-rank run after its warm-up step);
* the solver's host work per single step, batched call, batched interval and solve
  (:func:`mgrit.perf.overhead.solver_overhead_fit`: solves with a free propagator, apart from
  the run; forward and adjoint options separately) -- the replay's ``host``/``per_solve``;
* the part of a training step the trace does not itemize (the autograd bridge's forward, the
  parameter-gradient sweep after the adjoint solve, the loss), ``step wall - solves wall`` of
  the same run at ``N`` and ``N // 2`` layers: per layer (slope) and per step (intercept);
* the lean serial loop (:func:`mgrit.perf.netcal.lean_costs`, the strongest serial kernel;
  the per-layer costs of the serial, data-parallel and GPipe strategies).

:func:`train_costs` turns one batch size's entry into :class:`~mgrit.perf.TrainCosts` (what
:func:`mgrit.perf.strategies.mgrit_step` and :func:`mgrit.perf.steptime.resnet_times` take);
:func:`net_costs` gives the :class:`~mgrit.perf.strategies.NetCosts` of every strategy, MGRIT
costs interpolated linearly in the batch size between the calibrated ones.
:func:`gradient_error` measures the configuration's inexact gradient against the exact one.
Entries are plain JSON (``calibrate(...)`` -> ``json.dumps``).
"""
from __future__ import annotations

import bisect
import statistics
import time
from dataclasses import replace
from typing import Sequence

import torch
from mpi4py import MPI

from ...nn import DenseStep, LayerParallelResNet
from ...options import MGRITOptions
from ..lean import LeanResNet
from ..model import StepCost
from ..netcal import lean_costs
from ..overhead import solver_overhead_fit
from ..steptime import TrainCosts
from .. import strategies as st
from ..model import CommCost
from ..strategies import NetCosts, netcosts_from_json, netcosts_to_json
from .costs import step_costs
from .resnet import CLOCKS, trace_resnet
from .trace import Trace

__all__ = ["calibrate", "train_costs", "net_costs", "add_costs", "as_stepcost",
           "gradient_error", "strategy_times", "STRATEGIES"]

#: The strategies of :func:`strategy_times`, in its order.
STRATEGIES = ("serial", "data parallel", "GPipe", "MGRIT", "GPipe x DP", "MGRIT x DP")

_SC = ("single", "call", "item")


def add_costs(a: StepCost, b: StepCost) -> StepCost:
    """Field-wise sum: the step cost with the solver's host work added."""
    return StepCost(a.single + b.single, a.call + b.call, a.item + b.item)


def as_stepcost(d) -> StepCost:
    """The :class:`StepCost` of a calibration entry's ``{"single", "call", "item"}``."""
    return StepCost(*(float(d[k]) for k in _SC))


def _js(c: StepCost) -> dict:
    return {k: getattr(c, k) for k in _SC}


def _timer(clock):
    def timed(fn) -> float:
        t0 = clock()
        fn()
        return clock() - t0
    return timed


def _both(a: Trace, b: Trace) -> Trace:
    """One one-rank trace holding the solves of ``a`` and then those of ``b``."""
    return Trace([{"rank": 0, "size": 1,
                   "solves": a.ranks[0]["solves"] + b.ranks[0]["solves"]}], a.meta)


def _untraced(trace) -> list:
    """Per training step after the warm-up: step wall - its two solves' wall (seconds)."""
    walls = trace.meta["step_walls"]
    return [walls[k] - trace.subset(2 * k, 2 * k + 2).wall(0) for k in range(1, len(walls))]


def calibrate(n_layers: int, width: int, batches: Sequence[int], forward: MGRITOptions,
              backward: MGRITOptions, steps: int = 4, repeats: int = 3, act: str = "tanh",
              dtype: torch.dtype = torch.float64, traces: dict | None = None,
              clock=time.perf_counter) -> dict:
    """One calibration (module docstring) on this process's core, as JSON-able numbers.

    Args:
        n_layers: ``N`` (also traced at ``N // 2`` for the untraced part's intercept).
        batches: batch sizes to calibrate (the traced network's state ``(batch, width)``).
        forward, backward: the solver options of the traced run.
        steps: training steps per traced run (the first, a warm-up, is dropped; >= 2).
        repeats: timings per point of the overhead fit and the lean loop.
        traces: when given, filled with ``{batch: Trace}`` of the one-rank runs at ``N``
            (a P = 1 run of the real code, e.g. to validate another calibration against).
        clock: of every timing (default ``time.perf_counter``; ``time.process_time``: CPU
            time of this one-thread process, less perturbed by a loaded machine).

    The step costs are fitted to the recorded steps of both runs (``N`` and ``N // 2``
    layers): their batched calls span two interval counts (``N / m`` and ``N / (2 m)`` at
    level 0), so the fit separates the cost per call from the cost per interval. From one
    count alone the whole call was priced per interval, and a run on more ranks (fewer
    intervals per call, as many calls) was predicted too cheap (issue 34, item 5: the
    systematic miss at P = 2 of narrow, call-bound layers).

    Returns:
        ``{"batches": {str(b): entry}, "lean": NetCosts JSON}``; entry: ``tau_f``, ``tau_a``,
        ``host_f``, ``host_a`` (StepCost fields, seconds), ``fixed_f``, ``fixed_a`` (per
        solve), ``untraced_layer``, ``untraced_step`` (seconds), ``untraced_share`` (of the
        one-rank step at ``N``, measured).

    Raises:
        ValueError: ``steps < 2`` or ``n_layers < 4``.
    """
    if steps < 2 or n_layers < 4:
        raise ValueError(f"steps={steps}, n_layers={n_layers}: use steps >= 2 (the first is a "
                         f"warm-up) and n_layers >= 4")
    out = {}
    for b in batches:
        tr = trace_resnet(MPI.COMM_SELF, n_layers, width, b, forward, backward, steps,
                          dtype=dtype, act=act, clock=clock)[0]
        half = trace_resnet(MPI.COMM_SELF, n_layers // 2, width, b, forward, backward, steps,
                            dtype=dtype, act=act, clock=clock)[0]
        warm = _both(tr.subset(2), half.subset(2))
        if traces is not None:
            traces[b] = tr
        timed = _timer(clock)
        hf, ff = solver_overhead_fit(n_layers, (b, width), forward, timed, repeats, dtype)
        ha, fa = solver_overhead_fit(n_layers, (b, width), backward, timed, repeats, dtype)
        u_n, u_h = statistics.median(_untraced(tr)), statistics.median(_untraced(half))
        slope = max((u_n - u_h) / (n_layers - n_layers // 2), 0.0)
        step = statistics.median(tr.meta["step_walls"][1:])
        out[str(b)] = {"tau_f": _js(step_costs(warm, 0, "forward")),
                       "tau_a": _js(step_costs(warm, 0, "adjoint")),
                       "host_f": _js(hf), "host_a": _js(ha), "fixed_f": ff, "fixed_a": fa,
                       "untraced_layer": slope, "untraced_step": max(u_n - slope * n_layers, 0.0),
                       "untraced_share": u_n / step}
    W = torch.randn(n_layers, width, width, dtype=dtype) / width ** 0.5
    lean = LeanResNet(W, torch.zeros(n_layers, width, dtype=dtype), 1.0 / n_layers, act)
    return {"batches": out,
            "lean": netcosts_to_json(lean_costs(lean, sorted(batches), repeats, clock))}


def train_costs(entry: dict, host: bool = True) -> TrainCosts:
    """:class:`TrainCosts` of one calibrated batch size: step costs (plus the host work when
    ``host``), the solver's fixed cost per forward / adjoint solve, the untraced part per layer
    (``pgrad_item``) and per step (in ``fixed_bwd``). ``nbytes`` is left 0 (set by the
    caller, e.g. :func:`mgrit.perf.strategies.mgrit_step`)."""
    tf, ta = as_stepcost(entry["tau_f"]), as_stepcost(entry["tau_a"])
    if host:
        tf, ta = add_costs(tf, as_stepcost(entry["host_f"])), add_costs(ta, as_stepcost(entry["host_a"]))
    return TrainCosts(tf, ta, 0.0, 0.0, pgrad_item=entry["untraced_layer"],
                      fixed_fwd=entry["fixed_f"] if host else 0.0,
                      fixed_bwd=(entry["fixed_a"] if host else 0.0) + entry["untraced_step"])


def _lerp(a: TrainCosts, b: TrainCosts, w: float) -> TrainCosts:
    def mix(x, y):
        if isinstance(x, StepCost):
            return StepCost(*(max(mix(getattr(x, k), getattr(y, k)), 0.0) for k in _SC))
        return max(x + w * (y - x), 0.0)
    return TrainCosts(**{k: (getattr(a, k) if k == "nbytes" else mix(getattr(a, k), getattr(b, k)))
                         for k in a.__dataclass_fields__})


def net_costs(cal: dict, opt_layer: float | None = None) -> NetCosts:
    """:class:`NetCosts` of every strategy from one :func:`calibrate` result: the lean loop's
    curves, MGRIT's :func:`train_costs` at a batch (shard) size interpolated linearly between
    the calibrated sizes (the nearest outside them), the optimizer per layer the lean loop's
    SGD unless ``opt_layer`` is given."""
    sizes = sorted(int(b) for b in cal["batches"])
    tc = [train_costs(cal["batches"][str(b)]) for b in sizes]
    lean = netcosts_from_json(cal["lean"])
    opt = lean.opt_layer if opt_layer is None else opt_layer
    tc = [replace(c, per_layer=opt) for c in tc]

    def mg(b: int) -> TrainCosts:
        if b <= sizes[0] or len(sizes) == 1:
            return tc[0]
        if b >= sizes[-1]:
            return tc[-1]
        i = bisect.bisect_left(sizes, b)
        return _lerp(tc[i - 1], tc[i], (b - sizes[i - 1]) / (sizes[i] - sizes[i - 1]))
    return NetCosts(**{k: getattr(lean, k) for k in lean.__dataclass_fields__ if k != "mgrit"},
                    mgrit=mg)


def strategy_times(cal: dict, comm: CommCost, batch: int, depths: Sequence[int],
                   Ps: Sequence[int], forward: MGRITOptions, backward: MGRITOptions,
                   K_f: int, K_b: int = 1) -> dict:
    """Modeled training-step seconds of every strategy of :data:`STRATEGIES` with the costs of
    one :func:`calibrate` result (:func:`net_costs`) and ``comm``, at ``P = Ps[i]`` workers for
    a network of ``depths[i]`` layers and the whole batch ``batch``: serial (one worker), data
    parallel (``P <= batch``), GPipe (best M, ``P <= N``), MGRIT (``P_L = P <= N``, ``K_f``
    forward / ``K_b`` adjoint cycles), GPipe x DP and MGRIT x DP (the best grid with both
    factors >= 2); NaN where a strategy cannot use ``P``. Returns ``{strategy: [seconds per
    P]}`` (:mod:`mgrit.perf.strategies`' formulas)."""
    nan, base = float("nan"), net_costs(cal)
    out = {m: [] for m in STRATEGIES}
    for N, P in zip(depths, Ps):
        c = replace(base, n_layers=N)
        b = batch

        def mg(pl, pd):
            return st.mgrit_step(c, b, pl, forward, backward, K_f, K_b, comm, pd)["train"]
        hy = [g for g in st.grids(P, N, b) if g[0] >= 2 and g[1] >= 2]
        out["serial"].append(st.serial_step(c, b))
        out["data parallel"].append(st.data_parallel_step(c, b, P, comm) if P <= b else nan)
        out["GPipe"].append(st.best_gpipe(c, b, P, comm)[0] if P <= N else nan)
        out["MGRIT"].append(mg(P, 1) if P <= N else nan)
        out["GPipe x DP"].append(min((st.best_gpipe(c, b, pl, comm, pd)[0] for pl, pd in hy),
                                     default=nan))
        out["MGRIT x DP"].append(min((mg(pl, pd) for pl, pd in hy), default=nan))
    return out


def gradient_error(n_layers: int, width: int, batch: int, forward: MGRITOptions,
                   backward: MGRITOptions, seed: int = 0, act: str = "tanh",
                   dtype: torch.dtype = torch.float64) -> float:
    """Relative 2-norm error of the parameter gradient of the loss ``sum(y**2) / batch`` of
    :func:`~mgrit.perf.trace.resnet.trace_resnet`'s network with these MGRIT options against
    the exact gradient (the same network, seed and input with one level in both directions:
    the exact path), ``||g - g_exact|| / ||g_exact||`` over all parameters; one rank
    (``MPI.COMM_SELF``), fresh weights (measured)."""
    x = torch.randn(batch, width, dtype=dtype, generator=torch.Generator().manual_seed(seed + 1))
    exact = MGRITOptions(max_levels=1)
    grads = []
    for f, b in ((forward, backward), (exact, exact)):
        m = LayerParallelResNet.build(lambda k: DenseStep(width, act).to(dtype), n_layers,
                                      (width,), comm=MPI.COMM_SELF, seed=seed, forward=f,
                                      backward=b)
        (m(x, batch_size=batch).square().sum() / batch).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    return float((grads[0] - grads[1]).norm() / grads[1].norm())


def main(argv=None) -> int:
    """Command line: one calibration (and the gradient errors) to a JSON file."""
    import argparse
    import json
    ap = argparse.ArgumentParser(prog="python -m mgrit.perf.trace.calibrate",
                                 description="Calibrate the replay's costs of a layer-parallel "
                                             "dense ResNet on this process's core (one rank).")
    ap.add_argument("--layers", type=int, default=32, help="N (default 32)")
    ap.add_argument("--width", type=int, default=4, help="state width (default 4)")
    ap.add_argument("--batches", type=int, nargs="+", default=[8], help="batch sizes (default 8)")
    ap.add_argument("--cfactor", type=int, default=4, help="coarsening factor (default 4)")
    ap.add_argument("--iters", type=int, default=2, help="forward cycles (default 2; adjoint 1)")
    ap.add_argument("--steps", type=int, default=4, help="traced steps, first dropped (default 4)")
    ap.add_argument("--repeats", type=int, default=3, help="timings per fitted point (default 3)")
    ap.add_argument("--grad-layers", type=int, nargs="*", default=[],
                    help="also measure the gradient error at these depths (batch: the largest)")
    ap.add_argument("--out", required=True, help="JSON file")
    ap.add_argument("--trace-out", default=None,
                    help="also write the one-rank trace at N and the largest batch (JSON)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall (time.perf_counter) or cpu (time.process_time); default wall")
    a = ap.parse_args(argv)
    fwd = MGRITOptions(max_levels=2, cfactor=a.cfactor, max_iter=a.iters, tol=0.0)
    bwd = MGRITOptions(max_levels=2, cfactor=a.cfactor, max_iter=1, tol=0.0)
    traces = {}
    cal = calibrate(a.layers, a.width, a.batches, fwd, bwd, a.steps, a.repeats, traces=traces,
                    clock=CLOCKS[a.clock])
    if a.trace_out:
        traces[max(a.batches)].to_json(a.trace_out)
    cal["grad_error"] = {str(n): gradient_error(n, a.width, max(a.batches), fwd, bwd)
                         for n in a.grad_layers}
    with open(a.out, "w") as fh:
        json.dump(cal, fh)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
