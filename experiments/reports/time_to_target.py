"""Bookkeeping of the time-to-accuracy study (``experiments/studies/time_to_accuracy.py``):
the target fixed in advance from a pilot run, the first time a recorded curve reaches it, and
the per-method summary over seeds. Pure functions of recorded numbers (no MPI, no torch):
``tests/experiments/test_time_to_target.py`` checks them against hand-computed values.

A *curve* is what a run records at every evaluation: the optimizer steps done, the training
clock (seconds of training wall time so far, evaluation excluded), and the validation loss and
accuracy after those steps; its first point is the untrained network (step 0, clock 0).
"""
from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["target_from_pilot", "first_crossing", "summarize_method"]


def target_from_pilot(pilot_val_acc: Sequence[float], fraction: float) -> float:
    """The target validation accuracy: ``fraction`` times the pilot run's *last* recorded
    validation accuracy (its accuracy after its stated number of epochs).

    Raises:
        ValueError: an empty curve, or ``fraction`` outside (0, 1].
    """
    if len(pilot_val_acc) == 0:
        raise ValueError("target_from_pilot: the pilot curve has no evaluation")
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
        raise ValueError(f"fraction={fraction!r} is not allowed: use a number in (0, 1]")
    return float(fraction) * float(pilot_val_acc[-1])


def first_crossing(clock: Sequence[float], val_acc: Sequence[float], target: float,
                   steps: Sequence[int] | None = None) -> dict | None:
    """The first evaluation of a curve at which the validation accuracy reached ``target``
    (``>=``): ``{"index", "time", "step"}`` (``time``: the training clock at that evaluation,
    seconds; ``step``: ``steps[index]``, or None without ``steps``). None when the curve never
    reaches it. The time is that of the evaluation, not an interpolation between evaluations:
    with evaluations every ``k`` steps it overstates the true crossing by less than ``k`` steps'
    time, alike for every method.

    Raises:
        ValueError: ``clock`` and ``val_acc`` (and ``steps``) of different lengths, or a
            clock that decreases.
    """
    if len(clock) != len(val_acc) or (steps is not None and len(steps) != len(clock)):
        raise ValueError(f"first_crossing: {len(clock)} clock values, {len(val_acc)} "
                         f"accuracies{'' if steps is None else f', {len(steps)} steps'}: "
                         "one of each per evaluation")
    if any(b < a for a, b in zip(clock, clock[1:])):
        raise ValueError("first_crossing: the training clock decreases along the curve")
    for i, acc in enumerate(val_acc):
        if acc >= target:
            return {"index": i, "time": float(clock[i]),
                    "step": None if steps is None else int(steps[i])}
    return None


def summarize_method(runs: Sequence[Mapping], target: float, interval) -> dict:
    """Summary of one method over its seeds. ``runs``: one mapping per seed with the curve
    (``clock``, ``val_acc``, ``steps``) and ``test_acc`` (the final test accuracy);
    ``interval``: :func:`mgrit.training.report.interval` (mean and Student-t 95% interval).

    Returns ``{"seeds", "reached", "times", "steps_to_target", "time" (interval of the times of
    the seeds that reached the target, or None), "test" (interval of every seed's test
    accuracy)}``; ``times[i]`` is None for a seed that did not reach the target."""
    hits = [first_crossing(r["clock"], r["val_acc"], target, r["steps"]) for r in runs]
    times = [None if h is None else h["time"] for h in hits]
    reached = [t for t in times if t is not None]
    return {"seeds": len(runs), "reached": len(reached), "times": times,
            "steps_to_target": [None if h is None else h["step"] for h in hits],
            "time": interval(reached) if reached else None,
            "test": interval([r["test_acc"] for r in runs])}
