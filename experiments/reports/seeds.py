"""Accuracy comparisons over seeds, as the evidence tables state them (issue 24, item 2).

Every accuracy comparison of the reproductions and studies reports, per arm, the mean over seeds
with its Student-t 95% interval (:func:`mgrit.reporting.writers.interval`), and -- where the arms
share seeds (same initial weights and batch order per seed) -- the interval of the paired
difference (:func:`mgrit.reporting.writers.paired_interval`), epoch by epoch (:func:`gap_rows`),
not only at the last epoch. The verdict (:func:`verdict`) is computed from the difference's
interval and a margin stated with it, never written by hand.

Only the writers of tables (world rank 0) call these; they take plain numbers (one value per
seed, or arrays ``seeds x epochs``).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from mgrit.reporting import writers as reporting

__all__ = ["fmt", "fmt_values", "verdict", "gap_rows", "checkpoints", "GAP_HEADER"]


def fmt(iv: dict, scale: float = 1.0, digits: int = 1, unit: str = "", signed: bool = False) -> str:
    """``"mean [lo, hi]"`` of an :func:`~mgrit.reporting.writers.interval` dict, each times
    ``scale`` (100 for accuracies in points/percent) with ``digits`` decimals, ``unit`` appended
    to the mean (``"%"``); ``signed``: a ``+`` on positive numbers (differences). One seed:
    ``"mean (1 seed, no interval)"``."""
    f = (lambda x: f"{scale * x:+.{digits}f}") if signed else (lambda x: f"{scale * x:.{digits}f}")
    if iv["n"] < 2 or not math.isfinite(iv["lo"]):
        return f"{f(iv['mean'])}{unit} ({iv['n']} seed, no interval)"
    return f"{f(iv['mean'])}{unit} [{f(iv['lo'])}, {f(iv['hi'])}]"


def fmt_values(values: Sequence[float], scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    """:func:`fmt` of ``interval(values)``."""
    return fmt(reporting.interval(values), scale, digits, unit)


def verdict(diff: dict, margin: float | None, unit: str = "points", scale: float = 100.0) -> str:
    """What a paired difference's 95% interval (``diff``: :func:`paired_interval` of ``b - a``,
    in the units of the values; ``scale`` converts to ``unit``) supports, against an
    equivalence ``margin`` (in ``unit``):

    * ``"higher"`` / ``"lower"`` when the interval excludes 0 (``"by more than the margin"``
      when it also excludes the margin's side), ``"no difference shown"`` otherwise;
    * ``"within +-margin"`` when the whole interval lies inside ``[-margin, margin]``,
      ``"not shown within +-margin"`` otherwise.

    ``margin=None``: the sign part only. One seed (no interval): ``"one seed: no interval,
    nothing shown"``."""
    if diff["n"] < 2 or not math.isfinite(diff["lo"]):
        return "one seed: no interval, nothing shown"
    lo, hi = scale * diff["lo"], scale * diff["hi"]
    m = math.inf if margin is None else margin
    if hi < 0:
        sign = "lower" + (f" by more than {m:g} {unit}" if hi < -m else "")
    elif lo > 0:
        sign = "higher" + (f" by more than {m:g} {unit}" if lo > m else "")
    else:
        sign = "no difference shown (the interval contains 0)"
    if margin is None:
        return sign
    inside = -margin <= lo and hi <= margin
    eq = (f"within ±{margin:g} {unit}" if inside
          else f"not shown within ±{margin:g} {unit}")
    return f"{sign}; {eq}"


def checkpoints(k: int) -> list[int]:
    """About 8 points spread over ``1..k`` (1-based epochs, passes or iterations) at which a
    long gap table is printed: ``k`` times 1/30, 1/6, 1/3, 1/2, 2/3, 5/6 and 1, rounded, at
    least 1, without repeats. Raises :class:`ValueError` for ``k < 1``."""
    if k < 1:
        raise ValueError(f"checkpoints({k}): need at least one epoch")
    return sorted({max(1, round(k * f)) for f in (1 / 30, 1 / 6, 1 / 3, 1 / 2, 2 / 3, 5 / 6, 1)})


GAP_HEADER = ["epoch", "{a} mean [95% CI]", "{b} mean [95% CI]", "{b} - {a} [95% CI, paired]"]


def gap_rows(a: np.ndarray, b: np.ndarray, scale: float = 100.0, digits: int = 1,
             epochs: Sequence[int] | None = None) -> list[list[str]]:
    """One row per epoch: ``[epoch, interval of a, interval of b, paired interval of b - a]``
    from ``a``, ``b`` of shape ``(seeds, epochs)`` (row ``i`` of both: seed ``i``); ``epochs``
    labels the columns (default 1, 2, ...). Raises :class:`ValueError` when the shapes differ."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"gap_rows: arms of shapes {a.shape} and {b.shape}: need the same "
                         "(seeds, epochs) shape, seed i in row i of both")
    epochs = list(range(1, a.shape[1] + 1)) if epochs is None else list(epochs)
    if len(epochs) != a.shape[1]:
        raise ValueError(f"gap_rows: {len(epochs)} epoch labels for {a.shape[1]} epochs")
    return [[e, fmt(reporting.interval(a[:, j]), scale, digits),
             fmt(reporting.interval(b[:, j]), scale, digits),
             fmt(reporting.paired_interval(a[:, j], b[:, j]), scale, digits, signed=True)]
            for j, e in enumerate(epochs)]
