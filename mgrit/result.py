"""The outcome of one MGRIT solve on one rank (:class:`MGRITResult`, returned by
:meth:`mgrit.solver.MGRIT.solve`, importable from :mod:`mgrit.solver`): the rank's fine states,
the residual history and the counters.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .stats import SolverStats

__all__ = ["MGRITResult"]


@dataclass
class MGRITResult:
    """Outcome of :meth:`MGRIT.solve` on one rank.

    All floats are identical on every rank (one allreduce each).

    Attributes:
        states: this rank's fine states, shape ``(hi - lo, *state_shape)``; row ``i`` is the
            state at fine index ``lo + i``.
        lo, hi: owned fine points ``[lo, hi)``.
        residuals: C-point residual norm after each cycle, ``len(residuals) == iterations``.
            Empty when the initial guess already met the tolerance (0 cycles); ``[0.0]`` for a
            one-level solve (one exact sequential sweep). Use :attr:`final_residual` for "the
            residual of the returned states" without special cases.
        initial_residual: residual of the F-relaxed initial guess, evaluated before the first
            cycle when an ``initial_guess`` is given and ``tol`` or ``rtol`` is > 0; ``None``
            otherwise (cold starts: zeros or nested iteration, as PyMGRIT, whose history also
            starts after cycle 1).
        state_norm: norm of the C-point states ``||(||u_c||_2)_c||`` (same norm as the
            residual) at the last residual evaluation: the scale of ``rtol``; ``None`` when no
            residual was evaluated (one level).
        iterations: cycles performed; 0 when the initial guess already met the tolerance.
        converged: whether the stopping criterion was met, by the initial guess (0 cycles)
            or after a cycle; True for a one-level solve; False when ``max_iter`` cycles did
            not meet it and always False for a fixed-iteration solve (``tol = rtol = 0``).
        stats: counters of this solve on this rank.
    """

    states: torch.Tensor
    lo: int
    hi: int
    residuals: list = field(default_factory=list)
    initial_residual: float | None = None
    state_norm: float | None = None
    iterations: int = 0
    converged: bool = False
    stats: SolverStats = field(default_factory=SolverStats)

    @property
    def final_residual(self) -> float | None:
        """Residual of the returned states: ``residuals[-1]``, or ``initial_residual`` after 0
        cycles (``None`` only if neither was evaluated, which :meth:`MGRIT.solve` never
        returns)."""
        return self.residuals[-1] if self.residuals else self.initial_residual

    @property
    def convergence_factors(self) -> list:
        """Ratios ``r_{k+1} / r_k`` of consecutive residuals (``nan`` where ``r_k == 0``)."""
        r = self.residuals
        return [r[i + 1] / r[i] if r[i] else float("nan") for i in range(len(r) - 1)]
