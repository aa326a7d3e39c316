"""Comparisons over seeds, as the evidence tables state them (issue 24, item 2): one module for
the reproductions, the studies and the main job's records.

Every accuracy comparison of the reproductions and studies reports, per arm, the mean over seeds
with its Student-t 95% interval (:func:`mgrit.reporting.writers.interval`), and -- where the arms
share seeds (same initial weights and batch order per seed) -- the interval of the paired
difference (:func:`mgrit.reporting.writers.paired_interval`), epoch by epoch (:func:`gap_rows`),
not only at the last epoch. The verdict (:func:`verdict`) is computed from the difference's
interval and a margin stated with it, never written by hand.

Only the writers of tables (world rank 0) call these. On plain numbers (one value per seed, or
arrays ``seeds x epochs``): :func:`fmt`, :func:`fmt_values`, :func:`verdict`, :func:`gap_rows`,
:func:`checkpoints`. On the main job's run summaries (``summary.json`` as
:func:`experiments.records.records.load` returns it; the records ``compare_mainjob.py``,
``transformer_records.py``, ``stateful_records.py``): :func:`series`, :func:`per_epoch` (each
method's mean and the gap MGRIT - serial per epoch), :func:`choose` (a setting chosen on the
validation split only), :func:`record_verdict` (what the gap's interval supports against a
tolerance), :func:`gap_table` / :func:`gap_figure`, :func:`plateau`, :func:`interval_last`.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from pathlib import Path

from mgrit.reporting import writers as reporting
from mgrit.reporting.writers import interval, paired_interval, plot_lines

__all__ = ["fmt", "fmt_values", "verdict", "gap_rows", "checkpoints", "GAP_HEADER", "METRICS",
           "series", "per_epoch", "choose", "fmt_interval", "record_verdict", "plateau",
           "gap_table", "gap_figure", "interval_last"]


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


# -- the main job's records: run summaries, MGRIT vs serial ------------------------------
#: metric -> (summary.json epochs key, better: +1 higher / -1 lower, gap unit, scale)
#: accuracy gaps in percentage points (MGRIT - serial); loss gaps relative, in % of serial
METRICS = {
    "test_acc": ("test_acc", +1, "points", 100.0),
    "val_acc": ("val_acc", +1, "points", 100.0),
    "test_loss": ("test_loss", -1, "%", None),
    "val_loss": ("val_loss", -1, "%", None),
}


def series(summary: dict, key: str) -> list:
    """The per-epoch values of ``key`` in a run summary (``summary["epochs"][key]``).

    Raises:
        KeyError: the run has no such series (e.g. ``val_acc`` of a run without
            ``--val-fraction``), naming the key."""
    e = summary["epochs"]
    if key not in e:
        raise KeyError(f"the run has no per-epoch {key!r} (has: {sorted(e)})")
    return [float("nan") if v is None else float(v) for v in e[key]]


def _gaps(s: list, m: list, metric: str) -> list:
    unit, scale = METRICS[metric][2], METRICS[metric][3]
    if unit == "points":
        return [scale * (b - a) for a, b in zip(s, m)]
    return [100.0 * (b / a - 1.0) for a, b in zip(s, m)]


def per_epoch(pairs: dict, metric: str) -> list:
    """Per epoch ``e`` (1-based) of the runs ``pairs = {seed: (serial summary, MGRIT
    summary)}``: ``{"epoch", "serial", "mgrit", "gap"}`` where ``serial``/``mgrit`` are
    :func:`interval` of the metric over the seeds (accuracies in %, losses as stored) and
    ``gap`` the interval of the per-seed gaps MGRIT - serial (accuracy: percentage points, the
    paired interval; loss: % of serial). Epochs beyond the shortest run are left out.

    Raises:
        ValueError: no pairs. KeyError: a run without the metric's series."""
    if not pairs:
        raise ValueError("per_epoch: no (serial, MGRIT) pairs of runs")
    key, _, unit, scale = METRICS[metric]
    seeds = sorted(pairs)
    s = [series(pairs[k][0], key) for k in seeds]
    m = [series(pairs[k][1], key) for k in seeds]
    n = min(len(v) for v in s + m)
    out = []
    f = scale or 1.0
    for e in range(n):
        a, b = [v[e] for v in s], [v[e] for v in m]
        gap = (paired_interval([f * x for x in a], [f * x for x in b]) if unit == "points"
               else interval(_gaps(a, b, metric)))
        out.append({"epoch": e + 1, "serial": interval([f * x for x in a]),
                    "mgrit": interval([f * x for x in b]), "gap": gap, "seeds": seeds})
    return out


def choose(candidates: dict, metric: str = "val_acc") -> tuple[str, dict]:
    """The candidate setting with the best mean over seeds of the LAST epoch's ``metric``
    (a validation metric: the choice never sees test data); ``candidates = {name: [summary
    per seed]}`` in order of cost (a tie goes to the earlier one). Returns ``(name, {name:
    interval of the last-epoch metric})``.

    Raises:
        ValueError: no candidates, a candidate without runs, or a metric that is not a
            validation metric."""
    if not metric.startswith("val_"):
        raise ValueError(f"choose(metric={metric!r}): choices are made on a validation "
                         f"metric (val_acc, val_loss), never on test data")
    if not candidates or not all(candidates.values()):
        raise ValueError("choose: every candidate needs at least one run")
    key, better, _, scale = METRICS[metric]
    stats = {name: interval([(scale or 1.0) * series(s, key)[-1] for s in runs])
             for name, runs in candidates.items()}
    best = None
    for name, st in stats.items():  # strict improvement only: ties keep the earlier
        if best is None or better * st["mean"] > better * stats[best]["mean"]:
            best = name
    return best, stats


def fmt_interval(r: dict, unit: str = "", digits: int = 2, signed: bool = False) -> str:
    """``mean [lo, hi]unit`` of an :func:`interval` (``(n=1, no interval)`` for one seed);
    ``signed``: with ``+`` on positive numbers (gaps)."""
    f = f"+.{digits}f" if signed else f".{digits}f"
    if r["n"] < 2 or math.isnan(r["lo"]):
        return f"{r['mean']:{f}}{unit} (n=1, no interval)"
    return f"{r['mean']:{f}} [{r['lo']:{f}}, {r['hi']:{f}}]{unit}"


def record_verdict(gap: dict, tol: float, unit: str, better: int = +1,
                   better_declared: bool = False) -> str:
    """What the 95% interval ``gap`` of MGRIT - serial (``unit``: ``points`` or ``%``)
    supports against the tolerance ``tol`` (same unit): within +-tol (and above / below
    serial when the interval also excludes 0), above / below serial with the interval reaching
    beyond tol, above / below by more than tol (the whole interval), or not resolved (the
    interval includes 0 and reaches beyond tol). ``better``: +1 when a larger value is better
    (accuracy), -1 when smaller is (loss): it labels a side ``(better)`` or ``(worse)``.
    ``better_declared``: whether the record declared a "better than serial" comparison before
    its run (issue 34 item 4); if not (the default), the better side is named without a
    "better" verdict."""
    n = gap["n"]
    d = f"{gap['mean']:+.2f} {unit}"
    tunit = "point" if unit == "points" and tol == 1 else unit  # "within 1 point"
    if n < 2:
        return f"MGRIT - serial {d} from one seed: no interval, no verdict"
    lo, hi = gap["lo"], gap["hi"]
    ci = f"MGRIT - serial {d}, 95% interval [{lo:+.2f}, {hi:+.2f}] {unit} over {n} seeds"
    side = None  # where the interval excludes 0: the value direction, and better or worse
    if lo > 0 or hi < 0:
        good = (lo > 0) == (better > 0)
        side = ("above" if lo > 0 else "below") + (
            " (worse)" if not good else " (better)" if better_declared else
            " (no 'better than serial' verdict: not declared before the run)")
    if -tol <= lo and hi <= tol:
        tail = f"; MGRIT is {side} serial (the interval excludes 0)" if side else ""
        return f"{ci}: within +-{tol:g} {tunit} of serial (the whole interval){tail}"
    if side is not None:
        far = lo > tol or hi < -tol  # the whole interval beyond the tolerance
        return (f"{ci}: MGRIT is {side} serial"
                + (f" by more than {tol:g} {tunit}" if far else
                   f"; the interval reaches beyond +-{tol:g} {tunit}"))
    return (f"{ci}: not resolved -- the interval includes 0 but reaches beyond +-{tol:g} "
            f"{tunit}; these seeds cannot show 'within {tol:g} {tunit}'")


def plateau(summaries: list, key: str = "val_loss") -> dict:
    """:func:`interval` over runs of the relative change (%) of ``key`` over the last epoch
    (``100 (v[-1] / v[-2] - 1)``; runs of one epoch are left out): how far from a plateau the
    budget stopped. Raises ValueError when no run has two epochs."""
    ch = [100.0 * (v[-1] / v[-2] - 1.0) for v in (series(s, key) for s in summaries)
          if len(v) >= 2 and v[-2]]
    if not ch:
        raise ValueError("plateau: no run with two epochs")
    return interval(ch)


def gap_table(rows: list, metric: str, what: str) -> list:
    """Markdown lines: per epoch, serial and MGRIT mean [95% interval] and the gap's."""
    unit = METRICS[metric][2]
    val_unit = "%" if unit == "points" else ""
    lines = [f"| epoch | serial {what} | MGRIT {what} | MGRIT - serial ({unit}) |",
             "|---|---|---|---|"]
    for r in rows:
        d = 2 if unit == "points" else 4
        lines.append(f"| {r['epoch']} | {fmt_interval(r['serial'], val_unit, d)} | "
                     f"{fmt_interval(r['mgrit'], val_unit, d)} | "
                     f"{fmt_interval(r['gap'], '', 2, signed=True)} |")
    return lines


def gap_figure(path: Path, curves: dict, unit: str, title: str) -> None:
    """One PNG: per curve ``name -> per_epoch rows`` the gap's mean and its interval's ends
    over epochs (dashed: the interval)."""
    lines = {}
    for name, rows in curves.items():
        ep = [r["epoch"] for r in rows]
        lines[f"{name} mean"] = (ep, [r["gap"]["mean"] for r in rows])
        if all(r["gap"]["n"] > 1 for r in rows):
            lines[f"{name} 95% lo"] = (ep, [r["gap"]["lo"] for r in rows])
            lines[f"{name} 95% hi"] = (ep, [r["gap"]["hi"] for r in rows])
    plot_lines(path, lines, "epoch", f"MGRIT - serial ({unit})", title)


def interval_last(summaries: list, metric: str) -> dict:
    """:func:`interval` over runs of the last epoch's ``metric`` (accuracies in %)."""
    key, _, _, scale = METRICS[metric]
    return interval([(scale or 1.0) * series(s, key)[-1] for s in summaries])
