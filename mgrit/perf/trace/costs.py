"""Step costs read off a recorded run: the cost table of :func:`~mgrit.perf.trace.replay` fitted
to the step durations a trace measured (best from a one-rank run, whose process had a core to
itself: on an oversubscribed run the durations include time the process was not scheduled).
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from ..model import StepCost, fit_step_cost
from .trace import Trace

__all__ = ["step_costs"]


def step_costs(trace: Trace, rank: int = 0, label: str | None = None) -> StepCost:
    """:class:`~mgrit.perf.model.StepCost` (seconds, one step for the whole batch) from the
    recorded steps of ``rank``'s solves named ``label`` (default all): ``single`` the mean
    single step; ``call + item * n`` fitted by :func:`~mgrit.perf.model.fit_step_cost` to the
    mean batched call at each recorded ``n`` (with fewer than two distinct ``n``: ``call =
    0``, ``item`` the mean time per interval; without batched calls ``item = single``).

    Means, not medians: the model prices a solve as the sum of its operations, and the mean
    is the per-operation cost whose count times it is the recorded sum. The durations under
    one key are skewed (issue 34: coarse single steps with median 16 us and mean 50 us, adjoint
    batched calls with median 0.47 ms and mean 0.98 ms, one-rank CPU time, N = 1024, load
    10-20): the median priced a P = 1 step about 25 % too cheap.

    Raises:
        ValueError: the solves hold no single step (nothing to measure ``single`` from).
    """
    single, batched = [], defaultdict(list)
    for e in trace.events(rank, label):
        if e[0] == "step":
            (batched[e[5]] if e[6] else single).append(e[2] - e[1])
    if not single:
        raise ValueError(f"rank {rank}'s solves {label or ''} hold no single step")
    s = statistics.fmean(single)
    if len(batched) >= 2:
        sizes = sorted(batched)
        return fit_step_cost(s, sizes, [statistics.fmean(batched[n]) for n in sizes])
    if batched:
        (n, times), = batched.items()
        return StepCost(s, 0.0, statistics.fmean(times) / n)
    return StepCost(s, 0.0, s)
