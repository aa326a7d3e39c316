"""The time-to-accuracy study's bookkeeping (``experiments/reports/time_to_target.py``) against
hand-computed values: the target from the pilot, the first crossing of a recorded curve, the
per-method summary (count of seeds at the target, mean and Student-t interval of their times),
and the verdict sentence's winner and ratios. No MPI, no training (the study's smoke run is
``tests/experiments/test_experiments_a.py``'s quick run)."""
from __future__ import annotations

import math

import pytest

from experiments.reports.time_to_target import (first_crossing, summarize_method,
                                                target_from_pilot, verdict)
from mgrit.reporting import writers as report


def test_target_is_the_fraction_of_the_pilots_last_accuracy():
    assert target_from_pilot([0.1, 0.8, 0.9, 0.88], 0.95) == pytest.approx(0.95 * 0.88)
    with pytest.raises(ValueError, match="no evaluation"):
        target_from_pilot([], 0.95)
    with pytest.raises(ValueError, match="fraction=1.5"):
        target_from_pilot([0.5], 1.5)


def test_first_crossing_is_the_first_evaluation_at_or_above_the_target():
    clock = [0.0, 1.5, 3.25, 4.0, 6.0]
    acc = [0.1, 0.6, 0.80, 0.75, 0.9]
    steps = [0, 10, 20, 30, 40]
    assert first_crossing(clock, acc, 0.8, steps) == {"index": 2, "time": 3.25, "step": 20}
    assert first_crossing(clock, acc, 0.85) == {"index": 4, "time": 6.0, "step": None}
    assert first_crossing(clock, acc, 0.05)["time"] == 0.0  # the untrained net already there
    assert first_crossing(clock, acc, 0.95, steps) is None
    with pytest.raises(ValueError, match="one of each"):
        first_crossing(clock, acc[:-1], 0.5)
    with pytest.raises(ValueError, match="decreases"):
        first_crossing([0.0, 2.0, 1.0], [0.1, 0.2, 0.3], 0.5)


def _run(clock, acc, test):
    return {"clock": clock, "val_acc": acc, "steps": list(range(0, 10 * len(clock), 10)),
            "test_acc": test}


def test_summary_over_seeds_by_hand():
    runs = [_run([0, 1, 2, 3], [0.1, 0.5, 0.9, 0.9], 0.90),   # reaches 0.8 at 2 s, step 20
            _run([0, 2, 4, 6], [0.1, 0.85, 0.9, 0.9], 0.92),  # at 2 s, step 10
            _run([0, 1, 2, 5], [0.1, 0.2, 0.3, 0.81], 0.86),  # at 5 s, step 30
            _run([0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4], 0.70)]   # never
    s = summarize_method(runs, 0.8, report.interval)
    assert s["seeds"] == 4 and s["reached"] == 3
    assert s["times"] == [2.0, 2.0, 5.0, None]
    assert s["steps_to_target"] == [20, 10, 30, None]
    # mean 3, sample sd sqrt(3), t_{0.975, 2} = 4.302653: half width 4.302653 * sqrt(3) / sqrt(3)
    assert s["time"]["mean"] == pytest.approx(3.0)
    assert s["time"]["sd"] == pytest.approx(math.sqrt(3.0))
    assert s["time"]["hi"] - 3.0 == pytest.approx(4.302653, rel=1e-6)
    assert s["test"]["n"] == 4 and s["test"]["mean"] == pytest.approx(0.845)
    none = summarize_method(runs[3:], 0.8, report.interval)
    assert none["reached"] == 0 and none["time"] is None


def test_verdict_names_the_winner_and_mgrits_ratio():
    def sm(times, seeds=2):
        reached = [t for t in times if t is not None]
        return {"seeds": seeds, "reached": len(reached), "times": times,
                "time": report.interval(reached) if reached else None}
    win, text = verdict("net", {"serial": sm([2.0, 4.0]), "serial compiled": sm([1.0, 2.0]),
                                "MGRIT": sm([3.0, 3.0])})
    assert win == "serial compiled"
    assert "**serial compiled** reaches the target first: 1.50 s" in text
    assert "serial 3.00 s (2.00x)" in text and "MGRIT 3.00 s (2.00x)" in text
    # MGRIT - compiled per seed: 2, 1 -> mean 1.5
    assert "MGRIT **loses** to serial compiled (the strongest serial): 2.00x its time" in text
    assert "MGRIT - serial compiled 1.50 (" in text
    assert "Paired difference serial - serial compiled: 1.50 (" in text
    win, text = verdict("net", {"serial": sm([2.0, 4.0]), "MGRIT": sm([1.0, None])})
    assert win == "serial" and "MGRIT (1/2 seeds)" in text and "did not reach" in text
    win, text = verdict("net", {"serial": sm([2.0, 4.0]), "MGRIT": sm([1.0, 1.0])})
    assert win == "MGRIT" and "MGRIT **beats** serial (the strongest serial): 0.33x" in text
    assert verdict("net", {"serial": sm([None, None])})[0] is None


QUICK = ["time_to_accuracy"]  # run by the session's one quick run (tests/experiments/conftest.py)


@pytest.mark.slow  # one 2-rank launch of the study's --smoke mode through regenerate.py
def test_smoke_run_writes_its_record(quick):
    """``regenerate.py --quick --only time_to_accuracy``: every output with provenance; each
    run stopped at its first evaluation at or above the stored target (or at the cap); and data
    parallelism and GPipe, which compute serial SGD's step, follow the serial curve (same
    weights and batches: validation losses equal to float32 round-off), while inexact MGRIT
    ends near it."""
    import json

    from experiments.reports import provenance as prov
    from tests.experiments.regenerate_quick import assert_every_script_ok
    out, p = quick
    assert_every_script_ok(quick, QUICK)
    d = out / "studies" / "time_to_accuracy"
    for f in ("table.md", "summary.md", "headline.json", "results.json", "mainjob_curves.png",
              "deep_curves.png"):
        assert (d / f).is_file() and (d / f).stat().st_size > 0, f
    for f in ("table.md", "headline.json", "results.json"):
        assert prov.problems(d / f) == [], f
    doc = json.loads((d / "results.json").read_text())
    table = (d / "table.md").read_text()
    for name, res in doc["networks"].items():
        target, cap = res["target"], res["settings"]["cap_steps"]
        assert target == pytest.approx(0.95 * res["pilot"]["val_acc"][-1])
        assert f"**{target:.4f}**" in table
        for k, runs in res["runs"].items():
            for r in runs:
                acc = r["val_acc"]
                assert all(a < target for a in acc[:-1]), (name, k)
                assert acc[-1] >= target or r["steps"][-1] == cap, (name, k)
        ser = res["runs"]["serial"][0]
        for k in ("data parallel", "pipeline", "lean serial"):  # exact methods: serial numbers
            other = res["runs"][k][0]
            assert other["steps"] == ser["steps"]
            assert other["val_loss"] == pytest.approx(ser["val_loss"], rel=1e-3), (name, k)
        mg = res["runs"]["MGRIT"][0]
        assert mg["val_loss"][-1] == pytest.approx(ser["val_loss"][-1], rel=0.1), name
        assert mg["bias_checks"] and all(e["noise"] > 0 for e in mg["bias_checks"]), name
        assert f"{len(mg['bias_checks'])} checks over all seeds" in table
