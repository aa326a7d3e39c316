"""Performance model of layer-parallel training: calibrated costs, the MGRIT replay, the
baselines it is compared with, and the planner.

Public names here (from :mod:`mgrit.perf.model`, :mod:`mgrit.perf.steptime` and
:mod:`mgrit.perf.configs`):
:class:`StepCost`, :class:`CommCost`, :func:`calibrate_step`, :func:`pingpong`,
:func:`simulate`, :func:`spatial_level_cost`, :class:`TrainCosts`, :func:`training_times`, :func:`plan`,
:func:`scaling_table`. Submodules: :mod:`~mgrit.perf.strategies` (predicted times of serial,
data-parallel, GPipe, MGRIT and hybrid grids), :mod:`~mgrit.perf.planner` (what to run: a
convergence probe of the user's network + calibrated costs -> a recommendation),
:mod:`~mgrit.perf.lean` (the fastest serial loop for dense ResNets) and
:mod:`~mgrit.perf.baselines` (GPipe and data parallelism over MPI), and
:mod:`~mgrit.perf.calibration` (costs timed on the machine at hand); the sub-room
:mod:`~mgrit.perf.trace` records a real run's operations and messages on every rank and replays
them to a critical path (not imported here).

Depends on the solver core (grid, options, solver) and on :mod:`mgrit.nn` (calibration, lean
loop, planner); never on :mod:`mgrit.training` or :mod:`mgrit.parallel`. Communicators: only
those passed in.
"""
from .model import *  # noqa: F401,F403
from .model import __all__ as _model_all
from .steptime import *  # noqa: F401,F403
from .steptime import __all__ as _step_all
from .configs import Plan, plan, scaling_table  # noqa: F401

__all__ = [*_model_all, *_step_all, "Plan", "plan", "scaling_table"]
