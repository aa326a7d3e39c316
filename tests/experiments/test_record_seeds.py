"""The bookkeeping of the records over seeds (``experiments/reports/seeds.py``, issue 24 item 2)
on hand-made run summaries: per-epoch means, the paired interval of the gap MGRIT - serial
(checked against the Student-t formula with the tabulated t quantile), the relative loss gap,
the held-out choice (validation metrics only, ties to the cheaper candidate) and the verdicts
an interval supports."""
from __future__ import annotations

import math

import pytest

from experiments.reports import seeds

T975 = {1: 12.706205, 2: 4.302653, 4: 2.776445}  # t_{0.975, df} (printed tables)


def _run(**series):
    return {"epochs": {k: list(v) for k, v in series.items()}}


def _ci(values):
    n = len(values)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    h = T975[n - 1] * sd / math.sqrt(n)
    return m, m - h, m + h


def test_per_epoch_gap_is_the_paired_interval_of_the_differences():
    ser = [[0.80, 0.90], [0.82, 0.88], [0.78, 0.91]]
    mg = [[0.79, 0.91], [0.80, 0.89], [0.79, 0.90]]
    pairs = {k: (_run(test_acc=s), _run(test_acc=m)) for k, (s, m) in enumerate(zip(ser, mg))}
    rows = seeds.per_epoch(pairs, "test_acc")
    assert [r["epoch"] for r in rows] == [1, 2] and rows[0]["seeds"] == [0, 1, 2]
    for e, r in enumerate(rows):
        d = [100 * (m[e] - s[e]) for s, m in zip(ser, mg)]
        mean, lo, hi = _ci(d)
        assert (r["gap"]["mean"], r["gap"]["lo"], r["gap"]["hi"]) == pytest.approx(
            (mean, lo, hi), abs=1e-5)
        sm, slo, shi = _ci([100 * s[e] for s in ser])
        assert (r["serial"]["mean"], r["serial"]["lo"]) == pytest.approx((sm, slo), abs=1e-5)
    table = "\n".join(seeds.gap_table(rows, "test_acc", "test accuracy"))
    mean, lo, hi = _ci([100 * (m[1] - s[1]) for s, m in zip(ser, mg)])
    assert f"| 2 | {_ci([100 * s[1] for s in ser])[0]:.2f} [" in table
    assert f"| {mean:+.2f} [{lo:+.2f}, {hi:+.2f}] |" in table


def test_loss_gap_is_relative_and_runs_cut_to_the_shortest():
    pairs = {0: (_run(test_loss=[2.0, 1.0, 0.5]), _run(test_loss=[2.2, 1.05])),
             1: (_run(test_loss=[2.0, 1.0]), _run(test_loss=[1.8, 1.03]))}
    rows = seeds.per_epoch(pairs, "test_loss")
    assert len(rows) == 2  # the shortest run has two epochs
    mean, lo, hi = _ci([5.0, 3.0])
    assert (rows[1]["gap"]["mean"], rows[1]["gap"]["lo"], rows[1]["gap"]["hi"]) == \
        pytest.approx((mean, lo, hi), abs=1e-4)
    assert rows[0]["gap"]["mean"] == pytest.approx(0.0, abs=1e-12)  # +10% and -10%
    with pytest.raises(KeyError, match="val_acc"):
        seeds.per_epoch(pairs, "val_acc")
    with pytest.raises(ValueError, match="no"):
        seeds.per_epoch({}, "test_acc")


def test_choice_uses_validation_only_and_ties_keep_the_cheaper():
    cands = {"1/1": [_run(val_acc=[0.5, 0.80]), _run(val_acc=[0.5, 0.84])],
             "2/1": [_run(val_acc=[0.5, 0.84]), _run(val_acc=[0.5, 0.80])],
             "3/2": [_run(val_acc=[0.9, 0.81]), _run(val_acc=[0.9, 0.82])]}
    name, stats = seeds.choose(cands, "val_acc")
    assert name == "1/1"  # equal means (82%): the first; the last epoch counts, not the best
    assert stats["3/2"]["mean"] == pytest.approx(81.5) and stats["1/1"]["n"] == 2
    loss = {"a": [_run(val_loss=[1.0, 0.7])], "b": [_run(val_loss=[1.0, 0.6])]}
    assert seeds.choose(loss, "val_loss")[0] == "b"  # lower is better
    with pytest.raises(ValueError, match="never on test data"):
        seeds.choose(cands, "test_acc")
    with pytest.raises(ValueError, match="at least one run"):
        seeds.choose({"a": []}, "val_acc")


@pytest.mark.parametrize("lo, hi, better, expect", [
    (-0.5, 0.8, +1, "within +-1 point of serial (the whole interval)"),
    (-3.0, -1.5, +1, "MGRIT is below (worse) serial by more than 1 point"),
    (-0.9, -0.1, +1, "within +-1 point of serial (the whole interval); MGRIT is below (worse)"),
    (0.2, 0.9, +1, "within +-1 point of serial (the whole interval); MGRIT is above (better)"),
    (-2.0, -0.5, +1, "MGRIT is below (worse) serial; the interval reaches beyond +-1 point"),
    (-2.0, 0.5, +1, "not resolved"),
    (0.5, 2.0, -1, "MGRIT is above (worse) serial; the interval reaches beyond"),  # a loss
    (-2.0, -1.5, -1, "MGRIT is below (better) serial by more than 1"),
])
def test_verdict_follows_the_interval(lo, hi, better, expect):
    gap = {"n": 5, "mean": (lo + hi) / 2, "lo": lo, "hi": hi}
    v = seeds.record_verdict(gap, 1.0, "points", better, better_declared=True)
    assert expect in v and f"[{lo:+.2f}, {hi:+.2f}]" in v and "5 seeds" in v
    plain = seeds.record_verdict(gap, 1.0, "points", better)  # not declared: never "(better)"
    assert "(better)" not in plain and ("(worse)" in plain) == ("(worse)" in v)
    one = seeds.record_verdict({"n": 1, "mean": 0.3, "lo": math.nan, "hi": math.nan}, 1.0, "points")
    assert "one seed: no interval, no verdict" in one


def test_plateau_is_the_last_epochs_relative_change():
    runs = [_run(val_loss=[2.0, 1.0, 0.9]), _run(val_loss=[2.0, 1.0, 1.1])]
    p = seeds.plateau(runs)
    assert p["mean"] == pytest.approx(0.0, abs=1e-12) and p["n"] == 2
    with pytest.raises(ValueError, match="two epochs"):
        seeds.plateau([_run(val_loss=[1.0])])
