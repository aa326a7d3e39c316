"""Costs fitted from timings are never zero or negative.

A slope between two timings (a residual layer's cost from two network depths) is the
difference of two noisy numbers: on a loaded machine, or with a coarse clock, it can come out
zero or negative, and a planner that divides by it fails (``ZeroDivisionError``) or ranks
options by nonsense. :func:`at_least_floor` clamps such a fit to a *measured* floor -- the
smallest step the clock was seen to make (:func:`clock_resolution`) spread over what the fit
divides by -- and records why in a list of notes, which the caller keeps with the costs
(:attr:`mgrit.perf.strategies.NetCosts.unreliable`) so that a report can say the fit is not to
be trusted; nothing downstream ever sees a cost <= 0.
"""
from __future__ import annotations

from typing import Callable

__all__ = ["clock_resolution", "at_least_floor", "NOISY_HINT"]

#: What to do about an unresolved fit (appended to each note).
NOISY_HINT = ("timings too noisy to resolve it: rerun with more repeats, clock=time.process_time "
              "or on a quieter machine")


def clock_resolution(clock: Callable[[], float], tries: int = 200) -> float:
    """The smallest positive step between successive readings of ``clock`` seen in ``tries``
    readings (seconds, or the clock's unit); ``1e-9`` when the clock never moved (a clock that
    counts events)."""
    prev, best = clock(), float("inf")
    for _ in range(tries):
        now = clock()
        if now > prev:
            best = min(best, now - prev)
        prev = now
    return best if best < float("inf") else 1e-9


def at_least_floor(value: float, floor: float, what: str, notes: list) -> float:
    """``value`` when it exceeds ``floor`` (> 0), else ``floor``, appending a note naming
    ``what``, the fitted value and the floor to ``notes``."""
    if not floor > 0:
        raise ValueError(f"floor={floor!r} for {what}: use a number > 0")
    if value > floor:
        return float(value)
    notes.append(f"{what}: fitted {value:.3g} <= the clock's resolution; clamped to {floor:.3g} "
                 f"({NOISY_HINT})")
    return float(floor)
