"""Trace and replay of real MGRIT runs (issue 24, item 5): what the solver did on each rank,
recorded as it ran (measured), and its critical path under calibrated costs (modeled).

* :class:`Tracer` (:mod:`~mgrit.perf.trace.recorder`): attach to solvers
  (``tracer.attach(solver, "forward")``), run, ``tracer.gather(comm)``;
* :class:`Trace` (:mod:`~mgrit.perf.trace.trace`): every rank's events, tallies under the names
  of :class:`~mgrit.stats.SolverStats`, matched messages, JSON;
* :func:`replay` (:mod:`~mgrit.perf.trace.replay`): the critical path of the recorded
  dependencies with per-operation and per-message costs;
* :func:`step_costs` (:mod:`~mgrit.perf.trace.costs`): a cost table fitted to a trace's
  recorded step durations;
* :func:`step_bound` (:mod:`~mgrit.perf.trace.bound`): a training step's recorded solves priced
  at measured unit costs, plus its work outside the solves at its minimum (issue 34);
* ``trace_resnet`` (:mod:`~mgrit.perf.trace.resnet`, also a command): a layer-parallel
  ResNet's forward and adjoint solves at any ``P``;
* :mod:`~mgrit.perf.trace.calibrate` (also a command): the replay's and the cost model's costs
  of that ResNet measured on one core (step costs, the solver's host work, the untraced part of
  a step, the lean serial loop, the gradient error).

Off by default and free when off: the solver core only tests ``tracer is not None`` at its
counting sites and never imports this package.
"""
from .recorder import TracedPropagator, Tracer
from .replay import UNIT, ReplayResult, replay
from .trace import COUNT_KEYS, Trace
from .costs import step_costs
from .bound import StepBound, step_bound

__all__ = ["Tracer", "TracedPropagator", "Trace", "COUNT_KEYS", "replay", "ReplayResult", "UNIT",
           "step_costs", "StepBound", "step_bound"]
