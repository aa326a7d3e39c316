"""Reporting: the results writers shared by the runtime's metrics
(:mod:`mgrit.training.metrics`) and every experiment script (:mod:`mgrit.reporting.writers`:
run metadata and provenance, markdown tables, HDF5 series, raw timing numbers, intervals,
plots, the skip exit status).

Floor 0: imports nothing of ``mgrit``; the runtime and ``experiments/`` import it.
Before 0.2.0 the module was ``mgrit.training.report`` (that path still imports, with a
``DeprecationWarning``).
"""
from . import writers
from .writers import *  # noqa: F401,F403
from .writers import __all__ as _writers_all

__all__ = ["writers", *_writers_all]
