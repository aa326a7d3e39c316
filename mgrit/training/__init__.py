"""The training runtime: fault handling (fail fast across ranks), atomic re-partitionable
checkpoints, the convergence guard, and run reports.

Modules: :mod:`~mgrit.training.faults`, :mod:`~mgrit.training.checkpoint`,
:mod:`~mgrit.training.guard`, :mod:`~mgrit.training.report`.

Depends on the solver core, :mod:`mgrit.nn` and :mod:`mgrit.parallel`; never imported by
them. Communicators: those of the process grid it is given.
"""
