"""Performance model of layer-parallel training: calibrated costs, the MGRIT replay, baselines
and the planner.

Public names (from :mod:`mgrit.perf.model`): :class:`StepCost`, :class:`CommCost`,
:func:`calibrate_step`, :func:`pingpong`, :func:`simulate`, :class:`TrainCosts`,
:func:`training_times`, :func:`plan`, :func:`scaling_table`; :mod:`mgrit.perf.calibration`
times a dense layer-parallel ResNet's costs on the machine at hand.

Depends on the solver core (grid, options, solver) and, for calibration only, on
:mod:`mgrit.nn`; never on :mod:`mgrit.training` or :mod:`mgrit.parallel`. Communicators: only
those passed in (calibration's ping-pong).
"""
from .model import *  # noqa: F401,F403
from .model import __all__  # noqa: F401
