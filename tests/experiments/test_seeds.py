"""The bookkeeping of accuracy comparisons over seeds (``experiments/reports/seeds.py``): the
per-epoch gap table against a hand-computed Student-t interval, and the verdict's cases."""
from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.reports import seeds

T975_2 = 4.302653  # t_{0.975, 2} (printed tables): 3 seeds


def test_gap_rows_are_paired_student_t_intervals_per_epoch():
    a = np.array([[0.50, 0.80], [0.60, 0.82], [0.70, 0.84]])  # 3 seeds x 2 epochs
    b = a + np.array([[0.00, 0.01], [0.02, 0.02], [0.04, 0.03]])
    rows = seeds.gap_rows(a, b, epochs=[3, 4])
    assert [r[0] for r in rows] == [3, 4]
    # epoch 3: a = 50, 60, 70 -> mean 60, sd 10; diff = 0, 2, 4 -> mean 2, sd 2 (points)
    h = T975_2 * 10 / math.sqrt(3)
    assert rows[0][1] == f"60.0 [{60 - h:.1f}, {60 + h:.1f}]"
    hd = T975_2 * 2 / math.sqrt(3)
    assert rows[0][3] == f"+2.0 [{2 - hd:+.1f}, {2 + hd:+.1f}]"
    # epoch 4: diff = 1, 2, 3 points -> mean 2, sd 1
    hd = T975_2 * 1 / math.sqrt(3)
    assert rows[1][3] == f"+2.0 [{2 - hd:+.1f}, {2 + hd:+.1f}]"
    with pytest.raises(ValueError, match="same"):
        seeds.gap_rows(a, b[:2])
    with pytest.raises(ValueError, match="labels"):
        seeds.gap_rows(a, b, epochs=[1])


def test_checkpoints_spread_over_the_run():
    assert seeds.checkpoints(30) == [1, 5, 10, 15, 20, 25, 30]
    assert seeds.checkpoints(2) == [1, 2] and seeds.checkpoints(1) == [1]
    with pytest.raises(ValueError, match="at least one"):
        seeds.checkpoints(0)


def test_fmt_one_seed_has_no_interval():
    assert seeds.fmt_values([0.9], 100, 1, "%") == "90.0% (1 seed, no interval)"


@pytest.mark.parametrize("lo, hi, want", [
    (-0.004, 0.006, "no difference shown (the interval contains 0); within ±1 points"),
    (-0.030, 0.006, "no difference shown (the interval contains 0); not shown within ±1 points"),
    (-0.009, -0.001, "lower; within ±1 points"),
    (-0.050, -0.020, "lower by more than 1 points; not shown within ±1 points"),
    (0.002, 0.015, "higher; not shown within ±1 points"),
    (0.020, 0.030, "higher by more than 1 points; not shown within ±1 points"),
])
def test_verdict_reads_the_interval(lo, hi, want):
    d = {"n": 5, "mean": (lo + hi) / 2, "lo": lo, "hi": hi}
    assert seeds.verdict(d, 1.0) == want


def test_verdict_without_margin_is_the_sign_only():
    d = {"n": 3, "mean": -0.02, "lo": -0.03, "hi": -0.01}
    assert seeds.verdict(d, None, "MSE", 1.0) == "lower"


def test_verdict_one_seed():
    d = {"n": 1, "mean": 0.01, "lo": float("nan"), "hi": float("nan")}
    assert seeds.verdict(d, 1.0).startswith("one seed")


def test_gru_study_selects_on_the_training_loss_only():
    """study_gru.select_setting: the setting whose final training loss is closest to serial's
    (in ratio), first on ties; bad losses are an error."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "experiments" / "studies" / "study_gru.py"
    spec = importlib.util.spec_from_file_location("study_gru", path)
    gru = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gru)
    assert gru.select_setting(0.2, [0.3, 0.21, 0.19]) == 1  # |log 1.05| < |log 0.95|
    assert gru.select_setting(0.2, [0.1, 0.4]) == 0  # equal ratios: the first
    for bad in ([], [0.0], [float("nan")]):
        with pytest.raises(ValueError, match="positive finite"):
            gru.select_setting(0.2, bad)


def test_multilevel_pays_reads_the_paired_interval():
    """study_multilevel's (b): MG/Opt 'pays' only when the paired interval of its loss minus
    the inner optimizer's lies below 0."""
    from experiments.studies.multilevel_report import _pays
    alone = [1.0, 2.0, 3.0]
    assert _pays([0.9, 1.88, 2.89], alone) == "yes"  # -0.10, -0.12, -0.11: hi = -0.085
    assert _pays([1.1, 2.12, 3.11], alone) == "no"
    assert _pays([0.5, 2.5, 3.0], alone) == "not shown"
    assert _pays([0.5], [1.0]) == "one seed"
