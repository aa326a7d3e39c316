"""Cost model of layer-parallel training: serial, layer-wise model parallelism, pipelining, MGRIT.

Below :mod:`mgrit.nn` in the layering (uses :mod:`mgrit.grid`/:mod:`mgrit.options` only).
Calibrated costs: :class:`StepCost` (one step for the whole batch: ``single``, and a batched call
over ``B`` intervals ``call + item * B``; :func:`calibrate_step` times callables) and
:class:`CommCost` (message ``latency + bytes / bandwidth``; :func:`pingpong`).
MGRIT: :func:`simulate` replays ``MGRIT.solve``/``LevelOps`` on every rank's grid in lockstep per
operation (messages flow left to right, a receive waits ``max(t_own, t_send + beta)``): exact
``SolverStats`` counts per rank (also of warm-started solves with a tolerance, whose initial
guess is F-relaxed and tested first) and a critical path; the coarsest sweep is pipelined,
``N_c tau_1 + (P - 1) beta``. Baselines per direction (tau = one layer, beta = one message):
serial ``N tau``; layer-wise blocking chain ``N tau + (P - 1) beta``; pipelined (GPipe), ``M``
micro-batches, ``(M + P - 1) ceil(N/P) tau(b/M) + (P - 1) beta`` with ``tau(b/M)`` the cost at
the micro-batch size (not ``tau(b) / M``: narrow layers are call-bound). Every strategy on a
grid of workers: :mod:`mgrit.perf.strategies`; MGRIT's m and L: :func:`mgrit.perf.configs.plan`;
a layer-parallel ResNet's training step from calibrated costs: :mod:`mgrit.perf.steptime`.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..grid import Hierarchy, Partition
from ..options import MGRITOptions

__all__ = ["StepCost", "CommCost", "fit_step_cost", "calibrate_step", "pingpong", "simulate",
           "Simulation", "layerwise_time", "pipelined_time", "spatial_level_cost"]


@dataclass(frozen=True)
class StepCost:
    """Time of one step applied to the whole batch: ``single`` for one interval, ``call +
    item * B`` for one batched call over ``B`` intervals."""
    single: float
    call: float
    item: float

    def __post_init__(self):
        for n, v in (("single", self.single), ("call", self.call), ("item", self.item)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"StepCost.{n}={v!r} is not allowed: use a finite number >= 0")

    def batched(self, B: int) -> float:
        return self.call + self.item * B


@dataclass(frozen=True)
class CommCost:
    """One point-to-point message: ``latency + nbytes / bandwidth`` seconds in flight, plus
    ``host`` seconds of work on each end (the library's posting, buffers and bookkeeping:
    the sender pays it before the message leaves, the receiver after it arrived); one small
    collective (an agreement, a residual norm): ``collective`` seconds per ``ceil(log2 P)``
    round (default ``None``: ``message(8) + 2 host``). The defaults (``host = 0``) are the raw
    MPI message of :func:`pingpong`; :func:`mgrit.perf.trace.resnet.library_costs` measures
    ``host`` and ``collective`` through the solver's own exchange (issue 34: the raw ping-pong
    priced the solver's messages several times too cheap)."""
    latency: float = 5e-6
    bandwidth: float = 5e9
    host: float = 0.0
    collective: float | None = None

    def __post_init__(self):
        if not (0 <= self.latency < math.inf and self.bandwidth > 0 and 0 <= self.host < math.inf
                and (self.collective is None or 0 <= self.collective < math.inf)):
            raise ValueError(f"{self!r}: latency, host and collective must be finite and >= 0, "
                             f"bandwidth > 0")

    def message(self, nbytes: int) -> float:
        """Seconds in flight (latency + bytes / bandwidth; ``host`` not included)."""
        return self.latency + nbytes / self.bandwidth

    def reduction(self, P: int) -> float:
        """Seconds of one small collective over ``P`` ranks (0 for ``P = 1``)."""
        if P <= 1:
            return 0.0
        one = self.message(8) + 2 * self.host if self.collective is None else self.collective
        return math.ceil(math.log2(P)) * one


def _posint(**kw) -> None:
    for name, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} is not allowed: use an int >= 1")


def _median_time(fn: Callable[[], object], repeats: int, clock=time.perf_counter) -> float:
    def once():
        t0 = clock()
        fn()
        return clock() - t0
    return statistics.median(once() for _ in range(repeats))


def fit_step_cost(single: float, sizes: Sequence[int], times: Sequence[float]) -> StepCost:
    """Least-squares fit of ``times[i] = call + item * sizes[i]`` (both clipped at >= 0);
    ValueError for fewer than two distinct sizes or mismatched lengths."""
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise ValueError("fit_step_cost needs >= 2 distinct batch sizes with one time each")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    item = max(sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx, 0.0)
    return StepCost(float(single), max(my - item * mx, 0.0), item)


def calibrate_step(single_fn: Callable[[], object], batch_fn: Callable[[int], object],
                   sizes: Sequence[int] = (2, 8, 32, 64), repeats: int = 5,
                   inner: int = 10, clock: Callable[[], float] = time.perf_counter) -> StepCost:
    """Measure ``single_fn()`` (one step) and ``batch_fn(B)`` (one batched call over ``B``
    intervals) and fit a :class:`StepCost` (medians of ``repeats`` runs of ``inner`` calls).
    ``clock``: wall clock by default; ``time.process_time`` (CPU time of a one-thread process)
    is robust on a shared, oversubscribed machine."""
    single_fn(), [batch_fn(B) for B in sizes]  # warm-up
    single = _median_time(lambda: [single_fn() for _ in range(inner)], repeats, clock) / inner
    times = [_median_time(lambda B=B: [batch_fn(B) for _ in range(inner)], repeats, clock) / inner
             for B in sizes]
    return fit_step_cost(single, sizes, times)


def pingpong(comm, nbytes: Sequence[int] = (8, 1 << 16), repeats: int = 50,
             clock: Callable[[], float] = time.perf_counter) -> CommCost | None:
    """Ping-pong between ranks 0 and 1 of ``comm`` (collective over ``comm``); returns the fitted
    :class:`CommCost` on every rank (``None`` when ``comm`` has fewer than 2 ranks)."""
    if comm.Get_size() < 2:
        return None
    rank, half = comm.Get_rank(), []
    for n in nbytes:
        buf = np.zeros(max(n, 1), dtype=np.uint8)
        comm.Barrier()
        t0 = clock()
        for _ in range(repeats):
            if rank < 2:  # rank 0 sends first, rank 1 answers
                (comm.Send if rank == 0 else comm.Recv)(buf, 1 - rank, 7)
                (comm.Recv if rank == 0 else comm.Send)(buf, 1 - rank, 7)
        half.append((clock() - t0) / (2 * repeats))
    half = comm.bcast(half, root=0)
    bw = (nbytes[-1] - nbytes[0]) / max(half[-1] - half[0], 1e-12)
    return CommCost(max(half[0] - nbytes[0] / bw, 0.0), bw)


_COUNTS = ("steps_single", "steps_batched_calls", "steps_batched_items", "messages",
           "bytes_sent", "allreduces")


class Simulation:
    """Per-rank outcome of :func:`simulate`: lists (one entry per rank) of the counters named as
    in ``SolverStats`` (:data:`_COUNTS`; ``bytes_sent``: messages times the ``nbytes`` given)
    and ``time``, each rank's simulated finishing time."""

    def __init__(self, P: int):
        for k in _COUNTS:
            setattr(self, k, [0] * P)
        self.time = [0.0] * P

    @property
    def critical_path(self) -> float:
        return max(self.time)

    def rank(self, r: int) -> dict:
        return {k: getattr(self, k)[r] for k in _COUNTS}


class _Replay:
    def __init__(self, N, P, opts, batched, tau, comm_cost, nbytes, level_cost=None):
        part = Partition.even(N, P)
        self.h = [Hierarchy(part, r, opts.cfactor, opts.max_levels, opts.min_coarse).levels
                  for r in range(P)]
        self.P, self.opts, self.batched, self.tau = P, opts, batched, tau
        n = len(self.h[0])
        lc = tuple(level_cost or ())
        self.scale = [float(lc[min(l, len(lc) - 1)]) if lc else 1.0 for l in range(n)]
        self.nbytes_l = [int(round(nbytes * c)) for c in self.scale]
        self.betas = [comm_cost.message(b) for b in self.nbytes_l]
        self.beta, self.nbytes, self.host = self.betas[0], nbytes, comm_cost.host
        self.red = comm_cost.reduction(P)
        self.s = Simulation(P)
        self.cache = [[None] * len(self.h[0]) for _ in range(P)]

    def phi(self, r, n, l):
        if n == 1 or not self.batched:
            return self.single(r, n, l)
        self.s.steps_batched_calls[r] += 1
        self.s.steps_batched_items[r] += n
        self.s.time[r] += self.tau.batched(n) * self.scale[l]

    def single(self, r, n, l):
        self.s.steps_single[r] += n
        self.s.time[r] += n * self.tau.single * self.scale[l]

    def send(self, r, l):
        self.s.messages[r] += 1
        self.s.bytes_sent[r] += self.nbytes_l[l]
        self.s.time[r] += self.host
        return self.s.time[r] + self.betas[l]

    def receive(self, r, arrive):
        self.s.time[r] = max(self.s.time[r], arrive) + self.host

    def f_relax(self, l):
        arrive = None  # arrival time of the previous rank's message (ranks in chain order)
        for r in range(self.P):
            lv = self.h[r][l]
            lo, hi, m = lv.lo, lv.hi, lv.cfactor
            if lo == hi:
                continue
            self.cache[r][l] = None
            send, recv = lv.next is not None and hi % m != 0, lo % m != 0
            first_c = -(-lo // m) * m
            stop, out = (hi + 1 if send else hi), None
            if first_c < hi:
                for k in range(1, m):
                    if first_c + k >= stop:
                        break
                    self.phi(r, len(range(first_c + k - 1, stop - 1, m)), l)
                    if range(first_c + k, stop, m)[-1] == hi:
                        out = self.send(r, l)
            if recv:
                end = min(first_c, hi)
                self.receive(r, arrive)
                self.single(r, max(end - lo - 1, 0), l)
                if end == hi and send:
                    self.single(r, 1, l)
                    out = self.send(r, l)
            arrive = out

    def incoming(self, l, mod):
        arrive = None
        for r in range(self.P):
            lv = self.h[r][l]
            lo, hi = lv.lo, lv.hi
            if lo == hi or self.cache[r][l] == mod:
                continue
            first_t = max(-(-lo // mod) * mod, mod)
            send, recv = lv.next is not None and hi % mod == 0, first_t == lo
            local = range(first_t + mod if recv else first_t, hi + 1 if send else hi, mod)
            out = None
            if len(local):
                self.phi(r, len(local), l)
                if send:
                    out = self.send(r, l)
            if recv:
                self.receive(r, arrive)
            self.cache[r][l] = mod
            arrive = out

    def clear(self, l):  # an operation changed u: cached incoming steps are stale
        for r in (r for r in range(self.P) if self.h[r][l].n_local):
            self.cache[r][l] = None

    def coarse_solve(self, l):
        arrive = None
        for r in range(self.P):
            lv = self.h[r][l]
            if lv.lo == lv.hi:
                continue
            self.cache[r][l] = None
            if lv.lo > 0:
                self.receive(r, arrive)
            self.single(r, lv.n_local - (0 if lv.next is not None else 1), l)
            arrive = self.send(r, l) if lv.next is not None else None

    def allreduce(self):
        if self.P > 1:
            t = max(self.s.time) + self.red
            for r in range(self.P):
                self.s.time[r] = t
                self.s.allreduces[r] += 1

    def residual(self):
        self.incoming(0, self.h[0][0].cfactor or 1)
        self.allreduce()

    def cycle(self, l, cycle, it, first_f, skip):
        if self.h[0][l].cfactor is None:
            return self.coarse_solve(l)
        if skip:  # XBraid's skip: the fine C-values are copied down, no step, no message
            self.clear(l + 1)
        else:
            if first_f and (l > 0 or it == 0):
                self.f_relax(l)
            for _ in range(self.opts.sweeps(l)):
                self.incoming(l, self.h[0][l].cfactor)
                self.clear(l)
                self.f_relax(l)
            self.incoming(l, self.h[0][l].cfactor)  # restriction
            self.clear(l + 1)
            self.incoming(l + 1, 1)
        self.cycle(l + 1, cycle, it, True, skip)
        self.clear(l)  # correction
        self.f_relax(l)
        if l > 0 and cycle == "F":
            self.cycle(l, "V", it, False, False)

    def run(self, iterations, initial_guess):
        o = self.opts
        self.allreduce()  # validation agreement
        n = len(self.h[0])
        if n == 1:
            self.coarse_solve(0)
            return self.s
        if o.nested_iteration:
            self.coarse_solve(n - 1)
            for l in range(n - 2, -1, -1):
                self.clear(l)
                if l > 0:
                    self.cycle(l, "V", 0, True, False)
        prechecked = initial_guess and (o.tol > 0 or o.rtol > 0)
        if prechecked:  # the solver F-relaxes the guess and tests its residual first
            self.f_relax(0)
            self.residual()
        for it in range(iterations):
            self.cycle(0, o.cycle, it, not (prechecked and it == 0),
                       o.skip_first_relaxation and it == 0)
            self.residual()
        return self.s


_ZERO = StepCost(0.0, 0.0, 0.0)


def simulate(n_intervals: int, nprocs: int, options: MGRITOptions, iterations: int | None = None,
             batched: bool | None = None, tau: StepCost = _ZERO, comm: CommCost = CommCost(),
             nbytes: int = 0, initial_guess: bool = False,
             level_cost: Sequence[float] | None = None) -> Simulation:
    """Replay ``iterations`` cycles (default ``options.max_iter``; a fixed-iteration solve,
    or the cycles a tolerance solve took) of ``MGRIT.solve`` on ``nprocs`` ranks.
    ``batched`` defaults to ``options.batched`` (pass False for a propagator without a batched
    kernel). ``initial_guess``: the solve was given one (warm start); with ``tol`` or ``rtol``
    > 0 the solver then F-relaxes it and evaluates its residual before the first cycle, whose
    leading F-relaxation it skips. ``tau``: step costs; ``comm``/``nbytes``: one message.
    ``level_cost``: spatial coarsening, level ``l``'s step and message cost relative to the
    fine level's (``level_cost[l]``, the last entry repeated; :func:`spatial_level_cost`);
    default all 1 (time-only coarsening). The restriction and prolongation in space are not
    counted. ValueError: ``N < P``, ``iterations < 1``, bad options or level costs."""
    if not isinstance(options, MGRITOptions):
        raise ValueError(f"options must be MGRITOptions, got {type(options).__name__}")
    iterations = options.max_iter if iterations is None else iterations
    _posint(n_intervals=n_intervals, nprocs=nprocs, iterations=iterations)
    batched = options.batched if batched is None else batched
    if level_cost is not None and not all(isinstance(c, (int, float)) and 0 < c <= 1
                                          for c in level_cost):
        raise ValueError(f"level_cost={level_cost!r} is not allowed: use numbers in (0, 1], "
                         f"one per level (the fine level's is 1)")
    return _Replay(n_intervals, nprocs, options, batched, tau, comm, nbytes, level_cost).run(
        iterations, bool(initial_guess))


def spatial_level_cost(shape: Sequence[int], levels: Sequence[int], n_levels: int,
                       factor: int = 2) -> tuple:
    """Cost of a step on each of ``n_levels`` MGRIT levels relative to a fine step under
    spatial coarsening (``mgrit.spatial.SpatialCoarsening(levels=...)``): level ``l``'s grid
    is the fine ``shape`` (spatial sides only, e.g. ``(28, 28)`` or ``(15, 15, 15)``)
    coarsened by ``factor`` per side at every coarsened level ``<= l``; its cost is (coarse
    points) / (fine points). A side coarsens as the solver's ``grid="auto"`` does: odd
    (vertex-centred, ``2^k - 1`` points) ``n -> (n + 1) / factor - 1``, even (cell-centred)
    ``n -> n / factor`` (sides that would drop below 1 stay 1). Example:
    ``spatial_level_cost((15, 15, 15), (1,), 3) == (1.0, 343 / 3375, 343 / 3375)``.
    ValueError: an empty shape, a side or ``factor`` < 1 / 2, levels outside 1..n_levels-1."""
    shape = tuple(int(n) for n in shape)
    if not shape or min(shape) < 1 or isinstance(factor, bool) or int(factor) < 2:
        raise ValueError(f"spatial_level_cost: shape={shape!r} (spatial sides >= 1) and "
                         f"factor={factor!r} (an int >= 2) are not allowed")
    if any(not 1 <= int(l) < n_levels for l in levels):
        raise ValueError(f"spatial_level_cost: levels={tuple(levels)!r} must lie in "
                         f"1..{n_levels - 1} (level 0 is the fine grid)")
    fine, out, cur = math.prod(shape), [], shape
    for l in range(n_levels):
        if l in set(int(v) for v in levels):
            cur = tuple(max((n + 1) // factor - 1 if n % 2 else n // factor, 1) for n in cur)
        out.append(math.prod(cur) / fine)
    return tuple(out)


def layerwise_time(N: int, P: int, tau: float, beta: float) -> float:
    """Blocking chain over ``P`` ranks (one direction)."""
    return N * tau + (P - 1) * beta


def pipelined_time(N: int, P: int, M: int, tau_micro: float, beta_micro: float) -> float:
    """GPipe schedule of ``M`` micro-batches over ``P`` equal stages (one direction):
    ``tau_micro`` = one layer at the micro-batch size, ``beta_micro`` = one micro-batch message
    (non-blocking sends: only the fill pays messages). Unequal stages, head and tail:
    :func:`mgrit.perf.strategies.gpipe_step`."""
    return (M + P - 1) * math.ceil(N / P) * tau_micro + (P - 1) * beta_micro
