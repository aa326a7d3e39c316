"""Bookkeeping for modeled numbers in the reproductions (issue 24, item 5): every extrapolated
number carries (a) the model's error at the points that were also measured on this machine and
(b) the spread of the extrapolated number over repeated calibrations of the model's costs.

A model counts as *validated* when its prediction is within ``VALID_FACTOR`` of the
measurement at every measured point (the same 25% target as the cost model's validation in
``experiments/benchmarks/bench_layerparallel.py``; fixed before any number was read). A number
extrapolated with a model that is not validated is printed, but marked as such and never used as
a result in a verdict.

Pure functions of given numbers (no timing, no MPI): the unit tests feed them known values.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

__all__ = ["VALID_FACTOR", "model_errors", "worst_factor", "validated", "calibration_spread",
           "error_text", "modeled_text"]

#: largest ratio predicted/measured (or its inverse) at a measured point for a validated model
VALID_FACTOR = 1.25


def model_errors(measured: Mapping, predicted: Mapping) -> list[dict]:
    """One row per key present in both mappings with a finite positive measurement:
    ``{"point": key, "measured", "predicted", "ratio": predicted / measured}``, in the order of
    ``measured``. Keys are arbitrary labels (e.g. ``"P=1"``); values are the same quantity in
    the same unit (seconds, or a speedup)."""
    rows = []
    for k, m in measured.items():
        if k not in predicted:
            continue
        m, p = float(m), float(predicted[k])
        if not (math.isfinite(m) and m > 0 and math.isfinite(p)):
            continue
        rows.append({"point": k, "measured": m, "predicted": p, "ratio": p / m})
    return rows


def worst_factor(rows: Sequence[Mapping]) -> float:
    """The largest ``max(ratio, 1 / ratio)`` over ``rows`` of :func:`model_errors` (1.0 is a
    perfect model; 1.8 means 1.8x off in one direction); NaN when there is no row or a
    non-positive prediction."""
    r = np.array([row["ratio"] for row in rows], dtype=float)
    if r.size == 0 or np.any(~np.isfinite(r)) or np.any(r <= 0):
        return float("nan")
    return float(np.max(np.maximum(r, 1.0 / r)))


def validated(rows: Sequence[Mapping], factor: float = VALID_FACTOR) -> bool:
    """Whether every measured point is predicted within ``factor`` (False without points)."""
    w = worst_factor(rows)
    return bool(math.isfinite(w) and w <= factor)


def calibration_spread(values: Sequence[float]) -> dict:
    """``{"n", "median", "min", "max", "range"}`` of one modeled number over repeated
    calibrations (``range`` = max / min - 1, the relative width). Raises :class:`ValueError`
    on no values."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        raise ValueError("calibration_spread() of no values: need at least one calibration")
    lo, hi = float(np.min(v)), float(np.max(v))
    return {"n": int(v.size), "median": float(np.median(v)), "min": lo, "max": hi,
            "range": hi / lo - 1.0 if lo > 0 else float("nan")}


def error_text(rows: Sequence[Mapping]) -> str:
    """``"predicted/measured P=1: 1.23, P=2: 0.85 (worst 1.23x off)"``."""
    if not rows:
        return "no measured point to check the model against"
    return ("predicted/measured " + ", ".join(f"{r['point']}: {r['ratio']:.2f}" for r in rows)
            + f" (worst {worst_factor(rows):.2f}x off)")


def modeled_text(values: Sequence[float], rows: Sequence[Mapping], unit: str = "x",
                 fmt: str = ".2f") -> str:
    """A modeled number as it must be printed: median over calibrations, the min-max over them,
    the model error at the measured points, and ``NOT validated`` when the model misses a
    measured point by more than :data:`VALID_FACTOR`."""
    s = calibration_spread(values)
    text = (f"MODELED {s['median']:{fmt}}{unit} ({s['n']} calibrations: {s['min']:{fmt}}-"
            f"{s['max']:{fmt}}{unit}; model error at the measured points: {error_text(rows)})")
    if not validated(rows):
        text += f" -- model NOT validated (> {VALID_FACTOR:.2f}x off): not a result"
    return text
