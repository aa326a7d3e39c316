"""Replay of a recorded run (:class:`~mgrit.perf.trace.Trace`): the critical path of the real
run's dependency graph under given costs -- modeled time, from measured dependencies.

Every rank walks its recorded events in order on its own clock (starting at 0):

* a step costs its cost-table entry: ``tau.single`` per single step, ``tau.batched(n) =
  tau.call + tau.item * n`` per batched call over ``n`` intervals
  (:class:`~mgrit.perf.model.StepCost`, one step for the whole batch, seconds; calibrated by
  :func:`~mgrit.perf.model.calibrate_step` on a dedicated core), or ``tau="recorded"``: the
  step's own recorded duration;
* a send costs the sender ``comm.host`` (non-blocking: posting only) and arrives
  ``comm.message(nbytes)`` later (:class:`~mgrit.perf.model.CommCost`: ``latency + nbytes /
  bandwidth``, from :func:`~mgrit.perf.model.pingpong`);
* a receive completes at ``max(t_own, arrival of its matching send) + comm.host``;
* the ``k``-th collective of every rank ends on all ranks at ``max_r t_r +
  comm.reduction(P)`` (the reduction of a few numbers, as :func:`mgrit.perf.model.simulate`).

``overhead=True`` also charges, before each event, the recorded host time between it and the
rank's previous event of the same solve (the solver's bookkeeping that the trace does not
itemize: FAS arithmetic, copies, Python), and after the last event the time to the solve's
end. With ``tau="recorded"`` and ``overhead=True`` the replay of a one-rank trace is its
recorded wall clock (minus waits: there are none); on more ranks the difference to the
recorded wall clock is the error of the message and collective costs.

``host`` and ``per_solve`` charge the solver's host work from a calibration instead (modeled:
:func:`mgrit.perf.overhead.solver_overhead_fit`, the bookkeeping of one-rank solves with a free
propagator, measured apart from the run it predicts): ``host`` is added to every step's cost
in the form of ``tau`` (per single step, per batched call, per batched interval), and
``per_solve`` (seconds) is charged at the start of every solve. Messages and collectives keep
their costs (their host work is in the ping-pong's latency).

Unlike :func:`mgrit.perf.model.simulate` (which re-derives the operations from ``N``, ``P``
and the options) the operations and their order here are the ones the real solver did,
including every decision it took at run time (iterations to a tolerance, warm starts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from ..model import CommCost, StepCost
from .trace import COUNT_KEYS, Trace

__all__ = ["replay", "ReplayResult", "UNIT"]

#: Unit costs: every step application 1 (single or one interval of a batched call, no call
#: overhead); use with ``CommCost(0.0, math.inf)`` (free messages).
UNIT = StepCost(1.0, 0.0, 1.0)


@dataclass
class ReplayResult:
    """Outcome of :func:`replay`.

    Attributes:
        finish: per rank, the time its last event ended (seconds, modeled).
        counts: per rank, the tallies of the replayed events (keys
            :data:`~mgrit.perf.trace.trace.COUNT_KEYS`).
        wall: per rank, the recorded wall clock of the same solves (seconds, measured).
    """
    finish: list = field(default_factory=list)
    counts: list = field(default_factory=list)
    wall: list = field(default_factory=list)

    @property
    def critical_path(self) -> float:
        """Modeled time of the run: the latest rank's finish (seconds)."""
        return max(self.finish)

    @property
    def recorded(self) -> float:
        """Measured time of the run: the longest rank's recorded wall clock (seconds)."""
        return max(self.wall)


def _step_cost(tau, e) -> float:
    if tau is None:
        return 0.0
    if isinstance(tau, str):  # "recorded"
        return e[2] - e[1]
    t = tau[e[3]] if isinstance(tau, Mapping) else tau
    return t.batched(e[5]) if e[6] else e[5] * t.single


def _check_costs(name, tau, levels, recorded_ok):
    if not ((recorded_ok and isinstance(tau, str) and tau == "recorded")
            or isinstance(tau, (StepCost, Mapping))):
        raise ValueError(f"{name}={tau!r} is not allowed: use a StepCost, a mapping level -> "
                         f"StepCost{' or ' + repr('recorded') if recorded_ok else ''}")
    if isinstance(tau, Mapping) and not levels <= set(tau):
        raise ValueError(f"{name} has no cost for levels {sorted(levels - set(tau))}")


def replay(trace: Trace, tau: StepCost | Mapping[int, StepCost] | str = UNIT,
           comm: CommCost = CommCost(0.0, math.inf), overhead: bool = False,
           label: str | None = None, host: StepCost | Mapping[int, StepCost] | None = None,
           per_solve: float = 0.0) -> ReplayResult:
    """Critical path of ``trace`` (only its solves named ``label``, default all) under the
    given costs (module docstring).

    Args:
        trace: the recorded run.
        tau: step costs: one :class:`StepCost` for every level, a mapping level ->
            :class:`StepCost`, or ``"recorded"`` (each step's measured duration). Default
            :data:`UNIT`.
        comm: message cost (default free: latency 0, infinite bandwidth).
        overhead: charge the recorded time between events (default False: only the
            itemized operations cost).
        host: the solver's host work per step, added to ``tau`` (a :class:`StepCost` or a
            mapping level -> StepCost; default None: none).
        per_solve: host work charged at the start of every solve (seconds >= 0; default 0).

    Raises:
        ValueError: ``tau`` or ``host`` of another kind or missing a level; ``per_solve``
            negative or not finite; ``overhead=True`` with ``host`` or ``per_solve`` (the
            recorded host time and a calibrated one would count it twice); the trace's messages or
            collectives do not match (a receive whose send never comes, collectives of
            different kinds or numbers on different ranks).
    """
    if not isinstance(comm, CommCost):
        raise ValueError(f"comm must be a CommCost, got {type(comm).__name__}")
    P = trace.nprocs
    levels = {e[3] for r in range(P) for e in trace.events(r, label) if e[0] == "step"}
    _check_costs("tau", tau, levels, True)
    if host is not None:
        _check_costs("host", host, levels, False)
    if isinstance(per_solve, bool) or not isinstance(per_solve, (int, float)) or not (
            0 <= per_solve < math.inf):
        raise ValueError(f"per_solve={per_solve!r} is not allowed: use seconds >= 0")
    if overhead and (host is not None or per_solve):
        raise ValueError("overhead=True charges the recorded host time; host/per_solve charge a "
                         "calibrated one: use one of the two")
    red, host_msg = comm.reduction(P), comm.host
    # (kind, event, host time before it) per rank; the solve's tail as a pseudo-event
    work = []
    for r in range(P):
        seq = []
        for s in trace.solves(r, label):
            last = s["t0"]
            if per_solve:
                seq.append((None, float(per_solve)))
            for e in s["events"]:
                seq.append((e, max(e[1] - last, 0.0) if overhead else 0.0))
                last = e[2]
            if overhead:
                seq.append((None, max(s["t1"] - last, 0.0)))
        work.append(seq)
    t, pos = [0.0] * P, [0] * P
    arrivals: dict = {}
    colls: list[dict] = []  # k -> {rank: (arrival time, kind)}
    ncoll = [0] * P
    counts = [dict.fromkeys(COUNT_KEYS, 0) for _ in range(P)]
    progress = True
    while progress:
        progress = False
        for r in range(P):
            seq = work[r]
            while pos[r] < len(seq):
                e, gap = seq[pos[r]]
                c = counts[r]
                if e is None:
                    t[r] += gap
                elif e[0] == "recv":
                    key = (e[3], r, e[4], e[6])
                    if key not in arrivals:
                        break  # its send has not been replayed yet
                    t[r] = max(t[r] + gap, arrivals.pop(key)) + host_msg
                elif e[0] == "coll":
                    k = ncoll[r]
                    if k == len(colls):
                        colls.append({})
                    if r not in colls[k]:
                        colls[k][r] = (t[r] + gap, e[3])
                    if len(colls[k]) < P:
                        break  # the other ranks have not reached it
                    kinds = {v[1] for v in colls[k].values()}
                    if len(kinds) > 1:
                        raise ValueError(f"collective {k} differs between ranks: {sorted(kinds)}")
                    t[r] = max(v[0] for v in colls[k].values()) + red
                    ncoll[r] += 1
                    c["allreduces"] += 1
                elif e[0] == "send":
                    t[r] += gap + host_msg
                    arrivals[(r, e[3], e[4], e[6])] = t[r] + comm.message(e[5])
                    c["messages"] += 1
                    c["bytes_sent"] += e[5]
                else:
                    t[r] += gap + _step_cost(tau, e) + _step_cost(host, e)
                    if e[6]:
                        c["steps_batched_calls"] += 1
                        c["steps_batched_items"] += e[5]
                    else:
                        c["steps_single"] += e[5]
                pos[r] += 1
                progress = True
    stuck = [r for r in range(P) if pos[r] < len(work[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(f"the trace cannot be replayed: rank {r} waits forever at event "
                         f"{pos[r]} {work[r][pos[r]][0]} (its send or a rank's collective is "
                         f"missing)")
    if arrivals:
        raise ValueError(f"messages sent but never received: {sorted(arrivals)[:5]}")
    return ReplayResult(t, counts, [trace.wall(r, label) for r in range(P)])
