"""Bookkeeping of modeled numbers (experiments/reproductions/model_check.py): the model-error
column from given measured/predicted numbers and the spread over calibrations, against values
computed by hand."""
import math

import pytest

from experiments.reproductions import model_check as mc


def test_model_errors_ratio_and_worst_factor():
    rows = mc.model_errors({"P=1": 2.0, "P=2": 4.0, "P=4": float("nan"), "P=8": 1.0},
                           {"P=1": 3.0, "P=2": 2.0, "P=4": 1.0})
    # NaN measurement and the point without a prediction are left out, order kept
    assert [r["point"] for r in rows] == ["P=1", "P=2"]
    assert rows[0]["ratio"] == pytest.approx(1.5) and rows[1]["ratio"] == pytest.approx(0.5)
    assert mc.worst_factor(rows) == pytest.approx(2.0)  # 0.5 is 2x off, worse than 1.5
    assert not mc.validated(rows)
    assert mc.validated(mc.model_errors({"a": 1.0}, {"a": 1.2}))
    assert not mc.validated(mc.model_errors({"a": 1.0}, {"a": 1.3}))
    assert math.isnan(mc.worst_factor([])) and not mc.validated([])
    assert "P=1: 1.50, P=2: 0.50 (worst 2.00x off)" in mc.error_text(rows)


def test_calibration_spread_and_modeled_text():
    s = mc.calibration_spread([8.0, 10.0, 9.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 9.0, 8.0, 10.0)
    assert s["range"] == pytest.approx(0.25)
    with pytest.raises(ValueError):
        mc.calibration_spread([])
    good = mc.model_errors({"P=1": 1.0}, {"P=1": 1.1})
    text = mc.modeled_text([8.0, 10.0, 9.0], good)
    assert text.startswith("MODELED 9.00x (3 calibrations: 8.00-10.00x;") and "NOT" not in text
    bad = mc.model_errors({"P=1": 1.0}, {"P=1": 1.8})
    assert "NOT validated" in mc.modeled_text([8.0, 10.0, 9.0], bad)


def test_kirby_timing_strongest_baseline_and_model_error():
    """The timing report's lookup picks the fastest exact baseline (incl. torch.compile) and
    computes the model error of the speedup from the stored medians and predictions."""
    import numpy as np

    from experiments.reproductions import kirby_timing_report as ktr
    names = ["chain", "mgrit", "mgrit_loop", "sequential", "compiled",
             "chain_train", "kirby_train", "sequential_train", "compiled_train"]
    meas = [(1, 64, "chain", 4.0), (1, 64, "mgrit", 8.0), (1, 64, "sequential", 3.0),
            (1, 64, "compiled", 2.0), (2, 64, "chain", 4.0), (2, 64, "mgrit", 4.0),
            (1, 64, "kirby_train", 12.0), (1, 64, "sequential_train", 6.0),
            (1, 64, "compiled_train", 5.0), (1, 64, "chain_train", 7.0),
            (2, 64, "kirby_train", 9.0), (2, 64, "chain_train", 8.0)]
    s = {f"meas_{k}": np.array(v, dtype=float) for k, v in zip(
        ("P", "N", "variant", "median"), zip(*[(p, n, names.index(v), t) for p, n, v, t in meas]))}
    for k in ("q1", "q3", "min", "max"):
        s[f"meas_{k}"] = s["meas_median"]
    s.update(gerr_P=np.array([2]), gerr_N=np.array([64]), gerr_value=np.array([0.05]))
    # two calibrations, P = 1, 2, 4: chain 4 s everywhere, MGRIT 10 / 5 / 2 s and 6 / 3 / 1 s
    rows = [(c, 64, p, 4.0, tm) for c, tms in ((0, (10.0, 5.0, 2.0)), (1, (6.0, 3.0, 1.0)))
            for p, tm in zip((1, 2, 4), tms)]
    s.update({f"model_{k}": np.array(v, dtype=float)
              for k, v in zip(("cal", "N", "P", "t_chain", "t_mgrit"), zip(*rows))})
    T = ktr.Timing(s, {"variants": names})
    assert T.strongest(1, 64) == (2.0, "compiled")
    assert T.strongest(1, 64, train=True) == (5.0, "compiled_train")
    e = {r["point"]: r["ratio"] for r in T.errors(64, "chain")}
    # measured chain/MGRIT: P=1 0.5, P=2 1.0; predicted (median MGRIT 8, 4): 0.5, 1.0
    assert e == {"P=1": pytest.approx(1.0), "P=2": pytest.approx(1.0)}
    e = {r["point"]: r["ratio"] for r in T.errors(64, "strongest")}
    assert e["P=1"] == pytest.approx((2.0 / 8.0) / (2.0 / 8.0))
    np.testing.assert_allclose(T.extrapolated(64, 4, "strongest"), [2.0 / 2.0, 2.0 / 1.0])
    # Kirby's training variant: modeled MGRIT forward + the measured serial adjoint (12 - 8)
    np.testing.assert_allclose(T.extrapolated(64, 4, "kirby"), [5.0 / 6.0, 5.0 / 5.0])
    k = {r["point"]: r["ratio"] for r in T.errors(64, "kirby")}
    assert k["P=2"] == pytest.approx((5.0 / (4.0 + 4.0)) / (5.0 / 9.0))


def test_guenther_timing_strongest_and_model_error():
    """Günther's timing report: the strongest exact baseline over the 1-rank and data-parallel
    rows, and the speedup's model error from given medians and per-calibration predictions."""
    import numpy as np

    from experiments.reproductions import guenther_timing as gt
    meas = [(1, 30, "serial", 4.0), (1, 30, "simultaneous", 8.0), (1, 30, "compiled", 3.0),
            (2, 30, "serial", 4.0), (2, 30, "simultaneous", 5.0), (2, 30, "data_parallel", 2.5),
            (2, 30, "compiled_dp", 2.0)]
    s = {f"meas_{k}": np.array(v, dtype=float) for k, v in zip(
        ("P", "N", "method", "median"), zip(*[(p, n, gt.METHODS.index(m), t) for p, n, m, t in meas]))}
    for k in ("q1", "q3", "min", "max"):
        s[f"meas_{k}"] = s["meas_median"]
    s.update(gerr_P=np.array([1, 2]), gerr_N=np.array([30, 30]), gerr_value=np.array([1e-3, 1e-3]))
    rows = [(c, 30, p, se, si, 1.0) for c, (p, se, si) in enumerate([(1, 4.0, 4.0), (2, 4.0, 5.0)])]
    rows += [(c, 30, 8, 4.0, si, 1.0) for c, si in enumerate((1.0, 2.0, 4.0))]
    s.update({f"model_{k}": np.array(v, dtype=float) for k, v in zip(
        ("cal", "N", "P", "serial", "simultaneous", "serial_kernels"), zip(*rows))})
    T = gt.Timing(s, {"methods": list(gt.METHODS)})
    assert T.strongest(1, 30) == (3.0, "compiled")
    assert T.strongest(2, 30) == (2.0, "compiled_dp")
    e = {r["point"]: r["ratio"] for r in T.errors(30, "speedup")}
    # measured serial/simultaneous: P=1 0.5, P=2 0.8; predicted 1.0 and 0.8
    assert e == {"P=1": pytest.approx(2.0), "P=2": pytest.approx(1.0)}
    np.testing.assert_allclose(sorted(T.speedup(30, 8)), [1.0, 2.0, 4.0])
    k = {r["point"]: r["ratio"] for r in T.errors(30, "serial_kernels")}
    assert k == {"P=1": pytest.approx(0.25), "P=2": pytest.approx(0.25)}
