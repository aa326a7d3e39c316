"""experiments/studies/study_spatial.py (issue 35 item 3): the verdict arithmetic on a hand
case, and its quick run end to end (in the session's one ``regenerate.py --quick`` run): the
measurement on 2 ranks, the main job's serial, time-only and space-time runs and the report."""
from __future__ import annotations

import json
import math

import pytest

from experiments.studies.study_spatial import where_it_pays

QUICK = ["spatial_coarsening"]  # run by the session's one quick run (conftest.py)


def test_where_it_pays_hand_case():
    """time-only: residuals 1, 1e-3, 1e-6 (2 cycles to 1e-6) of 10 ms; space-time: stopped at
    1e-2 after 1 cycle, factor 0.01 -> 1 + 2 = 3 cycles of 10 ms -> 30 / 20 = 1.5x (loses); the
    arm at factor >= 1 never gets there (inf)."""
    conv = [{"config": "c", "m": 4, "L": 2, "arm": a, "fwd_factor": f, "fwd_res": r}
            for a, f, r in (("time-only", 1e-3, [1.0, 1e-3, 1e-6]),
                            ("space-time (levels 1)", 0.01, [1.0, 1e-2]),
                            ("bad", 1.2, [1.0, 1.2]))]
    timing = {"c": {f"cycle: m = 4, L = 2, {a}, P = 2": [t] * 3
                    for a, t in (("time-only", 0.01), ("space-time (levels 1)", 0.01),
                                 ("bad", 0.001))}}
    rows = {r["arm"]: r for r in where_it_pays({"convergence": conv, "timing": timing})}
    assert rows["time-only"]["ratio"] == pytest.approx(1.0) and rows["time-only"]["cycles"] == 2
    assert rows["space-time (levels 1)"]["cycles"] == pytest.approx(3.0)
    assert rows["space-time (levels 1)"]["ratio"] == pytest.approx(1.5)
    assert math.isinf(rows["bad"]["ratio"])


@pytest.mark.slow  # MPI launches and whole jobs (the session's quick run)
def test_quick_run_measures_records_and_reports(quick):
    pytest.importorskip("mgrit.spatial")
    from tests.experiments.regenerate_quick import assert_every_script_ok
    assert_every_script_ok(quick, QUICK)
    d = quick[0] / "studies" / "spatial_coarsening"
    meas = json.loads((d / "measurements.json").read_text())
    arms = {(r["config"], r["arm"]) for r in meas["convergence"]}
    for name in ("mnist5k-conv", "voxels-conv"):
        assert {(name, "time-only"), (name, "space-time (levels 1)")} <= arms
    for r in meas["convergence"]:  # exact solves converge (cold start, a few cycles)
        assert r["fwd_res"][-1] < 1e-6 * r["fwd_res"][0] and 0 <= r["fwd_factor"] < 1
    for r in meas["gradient"]:  # the inexact step's error is finite and below 100 %
        assert 0 <= r["grad_error"] < 1
    for name in ("mnist5k-conv", "voxels-conv"):
        runs = {arm: json.loads((d / "runs" / f"{name}-s0-{arm}" / "summary.json").read_text())
                for arm in ("serial", "time-only", "space-time")}
        assert [runs[a]["world_size"] for a in runs] == [1, 2, 2]
        assert runs["space-time"]["config"]["spatial_coarsening"] == "1"
        assert runs["time-only"]["config"]["spatial_coarsening"] == ""
    table = (d / "table.md").read_text()
    assert "## Where spatial coarsening pays" in table and "loadavg" in table
    assert json.loads((d / "headline.json").read_text())["rows"]
