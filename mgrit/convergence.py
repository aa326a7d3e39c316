"""The MGRIT solver's stopping test and its verdict when the cycles run out
(:class:`~mgrit.options.MGRITOptions` ``tol``, ``rtol``, ``on_not_converged``).

Every input is an allreduced number, identical on every rank (:meth:`mgrit.solver.MGRIT.solve`
reduces the residual so that a NaN on any rank is NaN on every rank), so every rank reaches the
same verdict: all ranks stop at the same cycle, and with ``on_not_converged="raise"`` all ranks
raise.
"""
from __future__ import annotations

import math
import warnings

from .options import MGRITOptions

__all__ = ["UnconvergedWarning", "UnconvergedError", "met", "not_converged"]


class UnconvergedWarning(RuntimeWarning):
    """An MGRIT solve with a tolerance stopped at ``max_iter`` cycles before meeting it
    (``MGRITOptions.on_not_converged="warn"``; the training loop's per-epoch summary uses it
    too)."""


class UnconvergedError(RuntimeError):
    """An MGRIT solve with a tolerance stopped at ``max_iter`` cycles before meeting it
    (``MGRITOptions.on_not_converged="raise"``; raised on every rank)."""


def met(o: MGRITOptions, res: float, state_norm: float) -> bool:
    """The stopping test ``r < tol or r <= rtol * ||u_C||`` (each part only when its
    tolerance is > 0; a non-finite state norm never satisfies the relative part; a NaN
    residual never satisfies either)."""
    return bool((o.tol > 0 and res < o.tol)
                or (o.rtol > 0 and math.isfinite(state_norm) and res <= o.rtol * state_norm))


def not_converged(o: MGRITOptions, res: float, state_norm: float | None, warned: bool,
                  speaker: bool) -> bool:
    """``o.on_not_converged`` for a tolerance solve that ran ``o.max_iter`` cycles to the
    residual ``res`` without meeting the test: raise :class:`UnconvergedError` (``"raise"``),
    warn with :class:`UnconvergedWarning` on the ``speaker`` rank unless ``warned`` already
    (``"warn"``), or nothing (``"ignore"``). Returns the new ``warned``."""
    if o.on_not_converged == "ignore" or (o.on_not_converged == "warn" and warned):
        return warned
    want = " or ".join(([f"r < tol = {o.tol:g}"] if o.tol > 0 else [])
                       + ([f"r <= rtol * ||u_C|| = {o.rtol:g} * {state_norm:.3e}"]
                          if o.rtol > 0 else []))
    msg = (f"MGRIT stopped after max_iter={o.max_iter} cycles with residual r = {res:.3e}, "
           f"not meeting {want}: the states (and gradients computed from them) are not exact. "
           f"Raise max_iter or loosen the tolerance "
           f"(MGRITOptions.on_not_converged='warn'|'raise'|'ignore')")
    if o.on_not_converged == "raise":
        raise UnconvergedError(msg)
    if speaker:
        warnings.warn(msg + "; warned once per solver", UnconvergedWarning, stacklevel=4)
    return True
