"""Measurements that survive load (issue 34, item 3): the one place every timing script of
``experiments/`` takes its load gate, its CPU-and-wall clock, its interleaved repeats, its
paired log-ratio intervals and its compile-cache control.

* :func:`load_gate` / :class:`LoadGate` -- the 1-minute load average before and after a timed
  section; a timing taken while it exceeds the job's own processes by more than
  :data:`MARGIN` (0.5) is **unreliable**: it is marked so in every table and JSON and never
  enters the README or a verdict (:mod:`experiments.verdicts` refuses it).
* :func:`clock` -- ``(wall, cpu)`` seconds of one call (``time.perf_counter`` and this
  process's ``time.process_time``); with ``comm``: the max over the ranks of each (the slowest
  rank), after a barrier.
* :func:`interleave` -- repeats over the options with the order rotated each repeat
  (A B C, B C A, C A B, ...: no option always runs first or after the same neighbour) and one
  untimed warm-up call before every timed one.
* :func:`paired_log_ratio` -- the median ratio ``a / b`` of paired repeats and the 95%
  Student-t interval of the mean of ``log(a_i / b_i)`` (exponentiated).
* :func:`compile_cache` -- ``"fresh"``: a new, empty inductor cache folder and a reset of
  dynamo's in-process caches for the block (every run pays its compilation, no order
  effects); ``"warm"``: only the in-process reset (the caller warms before timing).
* :func:`time_to_target` -- steps x median time per step, with the step-time interval.
"""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Mapping, Sequence

__all__ = ["MARGIN", "load1", "load_gate", "LoadGate", "clock", "interleave",
           "paired_log_ratio", "compile_cache", "time_to_target", "UNRELIABLE"]

#: A timing is reliable while the 1-minute load stays <= the job's own processes + MARGIN.
MARGIN = 0.5
#: The mark an unreliable timing carries in tables.
UNRELIABLE = "UNRELIABLE (load above the job's own processes + 0.5): not a result"


def load1() -> float:
    """The 1-minute load average (``nan`` where the OS has none)."""
    try:
        return float(os.getloadavg()[0])
    except OSError:
        return float("nan")


def load_gate(loads: Sequence[float], own: int) -> dict:
    """``{"load1": [...], "own": own, "reliable": bool, "note": str}``: reliable when every
    sampled 1-minute load is at most ``own + MARGIN`` (``own``: the processes of the job
    itself, e.g. its MPI ranks); a ``nan`` load is unreliable. ValueError for ``own < 1`` or no
    samples."""
    if isinstance(own, bool) or not isinstance(own, int) or own < 1:
        raise ValueError(f"own={own!r} is not allowed: use the job's process count (int >= 1)")
    loads = [float(v) for v in loads]
    if not loads:
        raise ValueError("load_gate needs at least one load sample")
    ok = all(v <= own + MARGIN for v in loads)  # nan compares False: unreliable
    worst = max(loads, key=lambda v: -1.0 if math.isnan(v) else v)
    note = (f"load1 max {worst:.2f} <= {own} + {MARGIN}: reliable" if ok else
            f"load1 max {worst:.2f} > {own} + {MARGIN}: {UNRELIABLE}")
    return {"load1": loads, "own": own, "reliable": ok, "note": note}


class LoadGate:
    """Samples the 1-minute load at :meth:`sample` calls (one at construction); :meth:`result`
    is :func:`load_gate` of all samples. ``own``: the job's process count."""

    def __init__(self, own: int):
        load_gate([0.0], own)  # validates own
        self.own, self.loads = own, [load1()]

    def sample(self) -> None:
        self.loads.append(load1())

    def result(self) -> dict:
        return load_gate(self.loads, self.own)


def clock(fn: Callable[[], object], comm=None) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one ``fn()``; with ``comm`` (mpi4py): a barrier first, and
    the max over the ranks of each (collective)."""
    if comm is not None:
        comm.Barrier()
    w, c = time.perf_counter(), time.process_time()
    fn()
    w, c = time.perf_counter() - w, time.process_time() - c
    if comm is not None:
        from mpi4py import MPI
        w, c = comm.allreduce(w, op=MPI.MAX), comm.allreduce(c, op=MPI.MAX)
    return w, c


def interleave(timers: Mapping[str, Callable[[], object]], repeats: int, comm=None,
               warm: int = 1) -> dict:
    """``{name: [(wall, cpu) per repeat]}``: repeat ``r`` runs every option once, the order
    rotated by ``r`` (no fixed first option or neighbour); each timed call is preceded by
    ``warm`` untimed calls (refilling caches the previous option evicted). ``comm``: as
    :func:`clock` (every rank must pass the same timers in the same order). ValueError for
    ``repeats < 1`` or ``warm < 0``."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is not allowed: use an int >= 1")
    if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
        raise ValueError(f"warm={warm!r} is not allowed: use an int >= 0")
    names = list(timers)
    out = {k: [] for k in names}
    for r in range(repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(warm):
                timers[k]()
            out[k].append(clock(timers[k], comm))
    return out


def _t975(df: int) -> float:
    try:
        from scipy import stats
        return float(stats.t.ppf(0.975, df))
    except ImportError:  # pragma: no cover - scipy is a dependency of the project
        return 1.96


def paired_log_ratio(a: Sequence[float], b: Sequence[float]) -> dict:
    """Paired repeats ``a[i]``, ``b[i]`` (positive times taken in the same round):
    ``{"median": median of a_i / b_i, "mean": exp(mean log ratio), "lo", "hi": 95% Student-t
    interval of exp(mean log ratio), "n"}``; ``lo = hi = nan`` for ``n < 2``. ValueError for
    unequal lengths, no pairs or a time <= 0."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_log_ratio: {len(a)} against {len(b)} repeats; use the same "
                         "number (>= 1) of paired repeats")
    if min(a + b) <= 0.0:
        raise ValueError("paired_log_ratio: times must be > 0")
    d = [math.log(x / y) for x, y in zip(a, b)]
    n, m = len(d), statistics.fmean(d)
    med = statistics.median(x / y for x, y in zip(a, b))
    if n < 2:
        return {"median": med, "mean": math.exp(m), "lo": math.nan, "hi": math.nan, "n": n}
    half = _t975(n - 1) * statistics.stdev(d) / math.sqrt(n)
    return {"median": med, "mean": math.exp(m), "lo": math.exp(m - half),
            "hi": math.exp(m + half), "n": n}


@contextmanager
def compile_cache(mode: str = "fresh"):
    """Controls torch.compile's caches for the block. ``"fresh"``: ``TORCHINDUCTOR_CACHE_DIR``
    points to a new empty folder (removed afterwards) and dynamo's in-process caches are reset
    before and after: the block pays its full compilation whatever ran before.
    ``"warm"``: dynamo reset only (the on-disk cache is kept; time after a warm-up call).
    Yields the cache folder (``None`` for ``"warm"``). ValueError for another mode."""
    if mode not in ("fresh", "warm"):
        raise ValueError(f"mode={mode!r} is not allowed: use 'fresh' or 'warm'")
    import torch
    torch._dynamo.reset()
    if mode == "warm":
        try:
            yield None
        finally:
            torch._dynamo.reset()
        return
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="inductor-") as d:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
        try:
            yield d
        finally:
            torch._dynamo.reset()
            if saved is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def time_to_target(steps: int | None, step_seconds: Sequence[float]) -> dict:
    """Time to a target as ``steps x`` the median step time (not a wall clock that mixes in
    compilation and evaluation): ``{"steps", "step_s" (median), "seconds", "lo", "hi"}`` with
    ``lo``/``hi`` from the step times' quartiles; ``seconds = nan`` when the target was not
    reached (``steps is None``). ValueError without step times."""
    ts = sorted(float(v) for v in step_seconds)
    if not ts:
        raise ValueError("time_to_target needs at least one step time")
    med = statistics.median(ts)
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
    if steps is None:
        return {"steps": None, "step_s": med, "seconds": math.nan, "lo": math.nan,
                "hi": math.nan}
    return {"steps": int(steps), "step_s": med, "seconds": steps * med, "lo": steps * q[0],
            "hi": steps * q[2]}
