"""Predicted training-step times of every way to use ``P`` workers on one network.

A network is ``head -> N residual layers -> tail (+ loss)``; :class:`NetCosts` holds its
calibrated costs, each per-layer or per-part cost a :class:`Curve` of the batch size (on this
machine a narrow layer costs nearly the same at batch 8 as at batch 64: the kernels are
call-bound; a wide one scales with the batch -- which decides between data parallelism,
pipelining and MGRIT). Strategies on a ``P_L x P_D`` grid (``P_L`` layer ranks, ``P_D``
replicas, each replica a shard ``ceil(b / P_D)`` of the batch):

* serial: ``head + N layer + tail + optimizer`` (one worker; the rest idle);
* data parallel (``P_L = 1``): the same at the shard size, plus an Allreduce of all gradients;
* GPipe (Huang et al. 2019) with ``M`` micro-batches over ``P_L`` stages (``M = 1``: the blocking
  chain of layer-wise model parallelism): per direction, a permutation flow shop of ``M``
  identical jobs over the stages, ``sum_r t_r + (M - 1) max_r t_r + (P_L - 1) beta`` (stage
  ``r`` holds ``Partition.even`` layers, the head on the first and the tail on the last; messages
  are non-blocking: a stage does not wait for its own sends); plus the Allreduce of a stage's
  gradients over the replicas;
* MGRIT (``P_L >= 2``): head + forward solve + tail forward/backward + adjoint solve +
  parameter-gradient sweep + head backward (:func:`mgrit.perf.steptime.resnet_times`: the
  replay's critical paths with the step costs at the shard size; the one-level exact path's
  pipelined chain when both solves have one level), plus the replicas' Allreduce.

Allreduce of ``n`` bytes over ``p`` ranks: ``2 ceil(log2 p) alpha + 2 (p - 1) / p * n / B``
(latency of recursive doubling, bandwidth of a ring; Thakur et al. 2005). Pure functions of the
costs: the tests feed synthetic costs (``tests/perf/test_planner.py``).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from ..grid import Partition
from ..options import MGRITOptions
from .model import CommCost
from .steptime import TrainCosts, resnet_times

__all__ = ["Curve", "NetCosts", "allreduce_time", "flow_shop", "serial_step", "data_parallel_step",
           "gpipe_step", "best_gpipe", "mgrit_step", "grids", "netcosts_to_json",
           "netcosts_from_json", "reduce_netcosts"]


@dataclass(frozen=True)
class Curve:
    """A cost (seconds) as a function of the batch size: measured at ``sizes`` (increasing),
    linear in between, the nearest segment's line outside (clipped at 0); one size: constant."""
    sizes: tuple
    times: tuple

    def __post_init__(self):
        s, t = tuple(int(x) for x in self.sizes), tuple(float(x) for x in self.times)
        if not s or len(s) != len(t) or any(b <= a for a, b in zip(s, s[1:])) or s[0] < 1:
            raise ValueError(f"Curve sizes {self.sizes!r} / times {self.times!r}: use increasing "
                             f"batch sizes >= 1, one time each")
        if any(not (math.isfinite(x) and x >= 0) for x in t):
            raise ValueError(f"Curve times {self.times!r}: use finite numbers >= 0")
        object.__setattr__(self, "sizes", s)
        object.__setattr__(self, "times", t)

    @classmethod
    def const(cls, t: float) -> "Curve":
        return cls((1,), (t,))

    def __call__(self, b: float) -> float:
        s, t = self.sizes, self.times
        if len(s) == 1:
            return t[0]
        i = min(max(bisect.bisect_left(s, b), 1), len(s) - 1)
        slope = (t[i] - t[i - 1]) / (s[i] - s[i - 1])
        return max(t[i - 1] + slope * (b - s[i - 1]), 0.0)


ZERO = Curve.const(0.0)


@dataclass(frozen=True)
class NetCosts:
    """Calibrated costs of one network (seconds; curves of the batch size).

    Attributes:
        n_layers: ``N`` residual layers.
        layer_fwd, layer_fb: one residual layer's forward (no autograd) and forward-with-storing
            + backward, of the serial kernel (lean loop or autograd modules).
        head_fwd, head_fb, tail_fwd, tail_fb: the layers before / after the residual layers
            (tail: with the loss), forward and forward + backward.
        opt_layer, opt_other: optimizer step per residual layer and for head + tail.
        step_fixed: per training step, outside the layers (zero_grad, loss, autograd start).
        layer_bytes, other_bytes: parameter (= gradient) bytes per residual layer, head + tail.
        state_bytes: bytes of one sample's state (a pipeline / MGRIT message per sample).
        mgrit: ``batch -> TrainCosts`` of the MGRIT chains at that batch (shard) size, or None.
        unreliable: notes on fits the calibration could not resolve (clamped to a measured
            floor, :mod:`mgrit.perf.fits`); empty when every fit was resolved.

    Raises:
        ValueError: a residual layer's ``layer_fwd``/``layer_fb`` time <= 0 at a measured size
            (a layer always costs something; calibrations clamp unresolved fits and say so).
    """
    n_layers: int
    layer_fwd: Curve
    layer_fb: Curve
    head_fwd: Curve = ZERO
    head_fb: Curve = ZERO
    tail_fwd: Curve = ZERO
    tail_fb: Curve = ZERO
    opt_layer: float = 0.0
    opt_other: float = 0.0
    step_fixed: float = 0.0
    layer_bytes: int = 0
    other_bytes: int = 0
    state_bytes: int = 0
    mgrit: Callable[[int], TrainCosts] | None = field(default=None, compare=False)
    unreliable: tuple = ()

    def __post_init__(self):
        for name in ("layer_fwd", "layer_fb"):
            t = getattr(self, name).times
            if not all(v > 0 for v in t):
                raise ValueError(f"NetCosts.{name} times {t!r}: a residual layer costs > 0 at every "
                                 f"measured batch size (clamp an unresolved fit with "
                                 f"mgrit.perf.fits.at_least_floor)")
        object.__setattr__(self, "unreliable", tuple(str(n) for n in self.unreliable))


def allreduce_time(nbytes: int, p: int, comm: CommCost) -> float:
    """Allreduce of ``nbytes`` over ``p`` ranks (0 for ``p = 1``)."""
    if p <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * comm.latency + 2 * (p - 1) / p * nbytes / comm.bandwidth


def flow_shop(stage_times: Sequence[float], M: int, beta: float) -> float:
    """Makespan of ``M`` identical jobs through stages in order (job ``j`` enters stage ``r``
    when stage ``r`` finished job ``j - 1`` and job ``j`` arrived from stage ``r - 1``, a
    message ``beta`` later): ``sum t_r + (M - 1) max t_r + (P - 1) beta``."""
    return sum(stage_times) + (M - 1) * max(stage_times) + (len(stage_times) - 1) * beta


def _shard(b: int, p: int) -> int:
    return -(-b // p)


def serial_step(c: NetCosts, b: int) -> float:
    """One worker, the whole batch."""
    return (c.head_fb(b) + c.n_layers * c.layer_fb(b) + c.tail_fb(b) + c.step_fixed
            + c.n_layers * c.opt_layer + c.opt_other)


def data_parallel_step(c: NetCosts, b: int, p: int, comm: CommCost) -> float:
    """``p`` replicas, each the serial step on its shard, plus one Allreduce of all gradients."""
    return serial_step(c, _shard(b, p)) + allreduce_time(
        c.n_layers * c.layer_bytes + c.other_bytes, p, comm)


def _stages(c: NetCosts, P: int, mb: int, fwd: bool) -> list:
    part = Partition.even(c.n_layers, P)
    t = []
    for r in range(P):
        a, e = part.block(r)
        n = min(e, c.n_layers) - a
        if fwd:
            s = n * c.layer_fwd(mb) + (c.head_fwd(mb) if r == 0 else 0) + (c.tail_fwd(mb) if r == P - 1 else 0)
        else:  # backward share = (forward + backward) - forward
            s = n * (c.layer_fb(mb) - c.layer_fwd(mb)) + \
                (c.head_fb(mb) - c.head_fwd(mb) if r == 0 else 0) + \
                (c.tail_fb(mb) - c.tail_fwd(mb) if r == P - 1 else 0)
        t.append(max(s, 0.0))
    return t


def gpipe_step(c: NetCosts, b: int, P_L: int, M: int, comm: CommCost, P_D: int = 1) -> float:
    """GPipe over ``P_L`` stages with ``M`` micro-batches of each replica's shard, ``P_D``
    replicas. ValueError when a micro-batch would be empty or ``N < P_L``."""
    shard = _shard(b, P_D)
    if not 1 <= M <= shard or c.n_layers < P_L:
        raise ValueError(f"GPipe with M={M} micro-batches of a shard of {shard} over "
                         f"P_L={P_L} stages of N={c.n_layers} layers is not possible")
    mb = _shard(shard, M)
    beta = comm.message(mb * c.state_bytes)
    t = flow_shop(_stages(c, P_L, mb, True), M, beta) + flow_shop(_stages(c, P_L, mb, False), M, beta)
    n_stage = _shard(c.n_layers, P_L)
    return (t + c.step_fixed + n_stage * c.opt_layer + c.opt_other
            + allreduce_time(n_stage * c.layer_bytes + c.other_bytes, P_D, comm))


def best_gpipe(c: NetCosts, b: int, P_L: int, comm: CommCost, P_D: int = 1,
               Ms: Sequence[int] | None = None) -> tuple[float, int]:
    """``(time, M)`` of the fastest GPipe over ``Ms`` (default powers of two up to the shard)."""
    shard = _shard(b, P_D)
    Ms = [M for M in (Ms or [2 ** k for k in range(12)]) if M <= shard]
    return min((gpipe_step(c, b, P_L, M, comm, P_D), M) for M in Ms)


def mgrit_step(c: NetCosts, b: int, P_L: int, fwd: MGRITOptions, bwd: MGRITOptions, K_f: int,
               K_b: int, comm: CommCost, P_D: int = 1, level_cost=None) -> dict:
    """MGRIT over ``P_L`` layer ranks on each replica's shard; returns the parts
    (``forward``, ``backward``, ``train``) in seconds; ``level_cost``: spatial coarsening
    (:func:`mgrit.perf.model.spatial_level_cost`). ValueError without ``c.mgrit`` costs."""
    if c.mgrit is None:
        raise ValueError("NetCosts.mgrit is None: no MGRIT costs were calibrated")
    shard = _shard(b, P_D)
    tc = c.mgrit(shard)
    tc = replace(tc, nbytes=shard * c.state_bytes)
    n_loc = _shard(c.n_layers, P_L)
    f, bk = resnet_times(c.n_layers, P_L, tc, fwd, bwd, K_f, K_b, comm, level_cost=level_cost)
    f += c.head_fwd(shard) + c.tail_fwd(shard)
    bk += (c.head_fb(shard) - c.head_fwd(shard)) + (c.tail_fb(shard) - c.tail_fwd(shard))
    train = (f + bk + c.step_fixed + n_loc * tc.per_layer + c.opt_other
             + allreduce_time(n_loc * c.layer_bytes + c.other_bytes, P_D, comm))
    return {"forward": f, "backward": bk, "train": train}


def grids(P: int, N: int, b: int) -> list:
    """The ``(P_L, P_D)`` factorizations of ``P`` with ``P_L <= N`` and ``P_D <= b``."""
    return [(q, P // q) for q in range(1, P + 1) if P % q == 0 and q <= N and P // q <= b]


def netcosts_to_json(c: NetCosts) -> dict:
    """A JSON-able dict of ``c`` (curves as ``[sizes, times]``; the MGRIT costs are dropped)."""
    return {k: ([list(v.sizes), list(v.times)] if isinstance(v, Curve) else
                list(v) if k == "unreliable" else v)
            for k, v in ((k, getattr(c, k)) for k in c.__dataclass_fields__ if k != "mgrit")}


def netcosts_from_json(d: dict, mgrit: Callable[[int], TrainCosts] | None = None) -> NetCosts:
    return NetCosts(**{k: (Curve(*v) if isinstance(v, list) and k != "unreliable" else v)
                       for k, v in d.items()}, mgrit=mgrit)


def reduce_netcosts(cs: Sequence[NetCosts], reduce: Callable) -> NetCosts:
    """Field-wise ``reduce`` (median over repeats, max over ranks) of NetCosts with the same
    curve sizes; the first one's MGRIT costs."""
    out = {}
    for k in cs[0].__dataclass_fields__:
        v = getattr(cs[0], k)
        if isinstance(v, Curve):
            out[k] = Curve(v.sizes, tuple(reduce([getattr(c, k).times[i] for c in cs])
                                          for i in range(len(v.sizes))))
        elif k == "mgrit":
            out[k] = v
        elif k == "unreliable":  # every note of every reduced calibration, once
            out[k] = tuple(dict.fromkeys(n for c in cs for n in c.unreliable))
        elif k == "n_layers" or k.endswith("_bytes"):
            out[k] = v
        else:
            out[k] = reduce([getattr(c, k) for c in cs])
    return NetCosts(**out)
