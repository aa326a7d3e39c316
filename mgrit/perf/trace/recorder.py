"""Recording an MGRIT solve as it runs: each rank's exact sequence of step applications,
messages and collectives, with a wall-clock start and stop per event (measured, not modeled).

Opt-in and free when off: the solver core holds a hook slot (``MGRIT.tracer``, ``None`` by
default, copied to ``SolverStats.tracer`` for a solve) and tests it at its few counting sites
(:mod:`mgrit.comm`: ``isend``, ``irecv``, the wait of a receive, the validation allgather;
:mod:`mgrit.solver`: the residual allreduce). Steps are timed by a wrapper of the propagator
(:class:`TracedPropagator`) that the solver uses instead of the user's during a traced solve.
Every event the tracer records is one the solver also counts in its
:class:`~mgrit.stats.SolverStats`, so the two tallies must agree (:meth:`Trace.counts`).

Events (lists, so they go to JSON as they are; times ``t0``/``t1`` in seconds of
``time.perf_counter``, one clock for all processes of a Linux machine):

* ``["step", t0, t1, level, start, n, batched]``: ``n`` states advanced by one step on
  ``level``, the first from fine index ``start``; ``batched`` 1 for one batched call over ``n``
  intervals (``step_batch``/``step_batch_into``), 0 for one single step (``n = 1``);
* ``["send", t0, t1, peer, tag, nbytes, seq]``: a state message posted to ``peer``;
* ``["recv", t0, t1, peer, tag, nbytes, seq]``: a state message from ``peer`` waited for
  (``t0``: the wait started; ``t1``: it returned);
* ``["coll", t0, t1, kind]``: a collective over the solver's communicator, ``kind``
  ``"agree"`` (the input validation's allgather) or ``"residual"`` (the residual allreduce).

A message is named by ``(sender, receiver, tag, seq)``, ``seq`` counting the messages of one
``(sender, receiver, tag)`` in order (MPI delivers those in posting order), so a send and its
receive carry the same name: the sender numbers its sends, the receiver its posted receives.
"""
from __future__ import annotations

import time
from collections import Counter

from .trace import Trace

__all__ = ["Tracer", "TracedPropagator"]

_COUNT_KEYS = ("steps_single", "steps_batched_calls", "steps_batched_items", "messages",
               "bytes_sent", "allreduces")


class TracedPropagator:
    """The propagator ``prop`` with each step call recorded by ``tracer`` (same values: every
    call is passed through unchanged). Provides ``step_batch_into`` only when ``prop`` does."""

    def __init__(self, prop, tracer: "Tracer"):
        self._prop, self._tr = prop, tracer
        if getattr(prop, "step_batch_into", None) is not None:
            self.step_batch_into = self._step_batch_into

    @property
    def batched(self) -> bool:
        return self._prop.batched

    def step(self, u, start, stop, level):
        clock = self._tr.clock
        t0 = clock()
        out = self._prop.step(u, start, stop, level)
        self._tr.step(level, start, 1, False, t0, clock())
        return out

    def step_batch(self, u, starts, stops, level):
        clock = self._tr.clock
        t0 = clock()
        out = self._prop.step_batch(u, starts, stops, level)
        self._tr.step(level, starts[0], len(starts), True, t0, clock())
        return out

    def _step_batch_into(self, u, starts, stops, level, out):
        clock = self._tr.clock
        t0 = clock()
        self._prop.step_batch_into(u, starts, stops, level, out)
        self._tr.step(level, starts[0], len(starts), True, t0, clock())


class Tracer:
    """Records the MGRIT solves of one rank (one tracer per rank; attach it to every solver
    whose solves belong to the run, e.g. a ResNet's forward and adjoint solvers).

    Args:
        clock: seconds (default ``time.perf_counter``).

    Attributes:
        rank, size: this rank and the communicator size (set by the first traced solve;
            ``None`` before).
        solves: one dict per finished (or, ``"complete": False``, interrupted) solve:
            ``label``, ``n_intervals``, ``levels`` (the hierarchy's number of levels),
            ``block`` (this rank's fine points ``[lo, hi)``), ``t0``/``t1`` (the solve's wall
            clock), ``events`` (see the module) and ``stats`` (the solver's own counters of
            that solve, :meth:`mgrit.stats.SolverStats.as_dict` without times).

    Use :meth:`attach` (sets ``solver.tracer``), run, then :meth:`gather` on every rank.
    The solver calls the other methods; they are its hooks, not a user API.
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.rank = self.size = None
        self.solves: list[dict] = []
        self._labels: dict[int, str] = {}
        self._cur: dict | None = None
        self._events: list | None = None
        self._sent: Counter = Counter()
        self._posted: Counter = Counter()

    def attach(self, solver, label: str) -> None:
        """Record ``solver``'s solves under ``label`` (e.g. ``"forward"``, ``"adjoint"``)."""
        solver.tracer = self
        self._labels[id(solver)] = str(label)

    # -- hooks of the solver core ------------------------------------------------------
    def begin_solve(self, solver) -> TracedPropagator:
        """A traced solve starts; returns the propagator the solve uses (timed steps).

        Raises:
            ValueError: ``solver`` runs on a communicator of another rank or size than the
                solves recorded before (one tracer records one communicator).
        """
        rank, size = solver.comm.Get_rank(), solver.comm.Get_size()
        if self.rank is None:
            self.rank, self.size = rank, size
        elif (rank, size) != (self.rank, self.size):
            raise ValueError(f"this tracer records rank {self.rank} of {self.size}; a solver on "
                             f"rank {rank} of {size} cannot share it (one tracer per "
                             f"communicator and rank)")
        if self._cur is not None:  # the previous solve raised: keep what it did
            self._cur.update(t1=self.clock(), complete=False)
            self.solves.append(self._cur)
        lv = solver.hierarchy.levels[0]
        self._events = []
        self._cur = {"label": self._labels.get(id(solver), "solve"),
                     "n_intervals": solver.n_intervals, "levels": solver.hierarchy.n_levels,
                     "block": [lv.lo, lv.hi], "t0": self.clock(), "events": self._events}
        return TracedPropagator(solver.propagator, self)

    def end_solve(self, stats) -> None:
        cur, self._cur = self._cur, None
        d = stats.as_dict()
        cur.update(t1=self.clock(), complete=True, stats={k: d[k] for k in _COUNT_KEYS})
        self.solves.append(cur)

    def step(self, level: int, start: int, n: int, batched: bool, t0: float, t1: float) -> None:
        self._events.append(["step", t0, t1, int(level), int(start), int(n), int(batched)])

    def send(self, dest: int, tag: int, nbytes: int) -> None:
        t = self.clock()
        seq = self._sent[dest, tag]
        self._sent[dest, tag] += 1
        self._events.append(["send", t, t, int(dest), int(tag), int(nbytes), seq])

    def post_recv(self, source: int, tag: int) -> tuple:
        seq = self._posted[source, tag]
        self._posted[source, tag] += 1
        return int(source), int(tag), seq

    def recv(self, trace_id: tuple, nbytes: int, t0: float, t1: float) -> None:
        source, tag, seq = trace_id
        self._events.append(["recv", t0, t1, source, tag, int(nbytes), seq])

    def collective(self, kind: str, t0: float, t1: float) -> None:
        self._events.append(["coll", t0, t1, str(kind)])

    # -- results -------------------------------------------------------------------------
    def as_dict(self) -> dict:
        """This rank's record: ``{"rank", "size", "solves"}`` (plain lists and numbers)."""
        return {"rank": self.rank, "size": self.size, "solves": list(self.solves)}

    def gather(self, comm, root: int = 0, meta: dict | None = None):
        """Collective over ``comm`` (the solvers' communicator): every rank's record to
        ``root``, returned there as a :class:`~mgrit.perf.trace.Trace` (``None`` elsewhere).
        ``meta``: what the run was (network, options, command), stored with the trace.

        Raises:
            ValueError: on ``root``, when ``comm`` is not the communicator the solves ran on
                (a rank recorded another rank number or size).
        """
        ranks = comm.gather(self.as_dict(), root=root)
        if comm.Get_rank() != root:
            return None
        for r, d in enumerate(ranks):  # a rank that traced nothing still has its place
            if d["rank"] not in (None, r) or d["size"] not in (None, comm.Get_size()):
                raise ValueError(f"rank {r} of the gathering communicator recorded solves as "
                                 f"rank {d['rank']} of {d['size']}: gather over the solvers' "
                                 f"communicator")
            d["rank"], d["size"] = r, comm.Get_size()
        return Trace(ranks, meta or {})
