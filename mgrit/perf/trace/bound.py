"""The bound of one MGRIT training step: the recorded operations of its forward and adjoint
solves (a :class:`~mgrit.perf.trace.Trace`) priced at measured unit costs, plus the work a
training step does outside the solves at its minimum (issue 34, item 1).

Priced, per solve label (``"forward"``, ``"adjoint"``), by :func:`~mgrit.perf.trace.replay`:
every batched call over ``n`` intervals at ``call + item * n`` and every single step at
``single`` (one :class:`~mgrit.perf.model.StepCost` per label, fitted to kernels timed apart
from the run), messages at the ping-pong's :class:`~mgrit.perf.model.CommCost`, collectives at
``ceil(log2 P)`` small messages; no host work (``overhead=False``): the solver's bookkeeping,
Python and waits beyond a message's latency are what the bound leaves out. Then added on every
rank: ``extra`` seconds (the adjoint's linearization of the local layers, the batched
parameter-gradient kernel, one optimizer op per stacked tensor: whatever the caller measured).
The step's bound is the slowest rank's sum; ``measured / bound`` >= 1 by construction when the
unit costs are the real ones (a ratio below 1 means the unit costs were measured slower than
the run's own kernels: a loaded machine).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from ..model import CommCost, StepCost
from .replay import replay
from .trace import Trace

__all__ = ["StepBound", "step_bound"]


@dataclass
class StepBound:
    """Outcome of :func:`step_bound` (seconds, modeled from measured unit costs).

    Attributes:
        per_label: ``{label: critical path of that label's solves}``.
        extra: the per-rank work added outside the solves (as given).
        counts: ``{label: per-rank operation counts}`` (``COUNT_KEYS`` of the trace).
        total: the bound of the step: the sum of the labels' critical paths plus ``extra``.
    """
    per_label: dict = field(default_factory=dict)
    extra: float = 0.0
    counts: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.per_label.values()) + self.extra


def step_bound(trace: Trace, costs: Mapping[str, StepCost], comm: CommCost | None = None,
               extra: float = 0.0) -> StepBound:
    """The bound of the training step recorded in ``trace`` (module docstring).

    Args:
        trace: one training step's solves (labels as in ``costs``).
        costs: ``{label: StepCost}`` for every label of the trace's solves.
        comm: message cost (default free: ``P = 1`` has no messages).
        extra: seconds >= 0 of work outside the solves at its minimum (per rank).

    Raises:
        ValueError: a label of the trace without a cost, ``extra`` negative or not finite.
    """
    labels = {s["label"] for r in range(trace.nprocs) for s in trace.solves(r)}
    missing = labels - set(costs)
    if missing:
        raise ValueError(f"no unit cost for the solves labelled {sorted(missing)}")
    if isinstance(extra, bool) or not isinstance(extra, (int, float)) or not 0 <= extra < math.inf:
        raise ValueError(f"extra={extra!r} is not allowed: use seconds >= 0")
    comm = comm or CommCost(0.0, math.inf)
    out = StepBound(extra=float(extra))
    for label in sorted(labels):
        res = replay(trace, costs[label], comm, label=label)
        out.per_label[label] = res.critical_path
        out.counts[label] = res.counts
    return out
