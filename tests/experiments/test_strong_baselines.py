"""Issue 34 items 2-4: the strongest baselines (``experiments/benchmarks/strong_baselines.py``,
``torch_pipeline.py``), the load gate and paired intervals (``experiments/measure.py``) and the
declared verdicts (``experiments/verdicts.py``). Correctness against serial autograd (float64);
no timing assertions. The 2-rank checks are in
``tests/mpi_cases/experiments/strong_baselines_cases.py``."""
import math

import pytest
import torch

from experiments import measure, verdicts
from experiments.benchmarks.strong_baselines import LeanOptim, optimizer
from mgrit.nn import DenseStep, serial_resnet
from mgrit.perf.lean import LeanResNet
from tests.mpi_harness import MPIBatch

T = "tests.mpi_cases.experiments.strong_baselines_cases"
BATCH = MPIBatch(timeout=300)
BATCH.add(2, "pipeline", f"{T}:check_pipeline_gradients")
BATCH.add(2, "dp", f"{T}:check_lean_data_parallel")


@pytest.mark.parametrize("kind,compiled", [("sgd", False), ("adam", False), ("sgd", True)])
def test_lean_optim_equals_autograd(kind, compiled):
    """Three steps of the lean loop with momentum SGD / Adam on its stacked tensors (compiled:
    torch.compile's eager backend, blocks of 3) give the weights of autograd + the same
    torch.optim optimizer on the nn.Sequential (float64)."""
    torch.manual_seed(0)
    seq = serial_resnet(lambda k: DenseStep(3, "tanh"), 6, seed=1).double()
    lean = LeanOptim(LeanResNet.from_sequential(seq), kind, lr=0.05, compiled=compiled, block=3,
                     backend="eager")
    W0 = lean.net.weights()[0]
    opt = optimizer(list(seq.parameters()), kind, lr=0.05)
    for _ in range(3):
        x = torch.randn(5, 3, dtype=torch.float64)
        opt.zero_grad()
        seq(x).pow(2).mean().backward()
        opt.step()
        lean.step(x)
    W, b = lean.net.weights()
    ref_W = torch.stack([l.F.linear.weight for l in seq]).detach()
    ref_b = torch.stack([l.F.linear.bias for l in seq]).detach()
    assert torch.allclose(W, ref_W, rtol=0, atol=1e-12)
    assert torch.allclose(b, ref_b, rtol=0, atol=1e-12)
    assert (W - W0).abs().max() > 1e-3  # the steps moved the weights


def test_optimizer_rejects_unknown_kind():
    with pytest.raises(ValueError, match="lbfgs"):
        optimizer([torch.zeros(1)], "lbfgs", 0.1)


def test_load_gate():
    assert measure.load_gate([1.9, 2.5], 2)["reliable"]
    g = measure.load_gate([1.0, 2.51], 2)
    assert not g["reliable"] and "UNRELIABLE" in g["note"]
    assert not measure.load_gate([float("nan")], 1)["reliable"]
    with pytest.raises(ValueError, match="own=0"):
        measure.load_gate([1.0], 0)


def test_paired_log_ratio_and_interleave():
    r = measure.paired_log_ratio([2.0, 4.0, 2.2], [1.0, 2.0, 1.0])
    assert r["n"] == 3 and r["median"] == 2.0
    assert r["lo"] < r["mean"] < r["hi"]
    assert math.isclose(r["mean"], math.exp((2 * math.log(2) + math.log(2.2)) / 3))
    with pytest.raises(ValueError, match="2 against 1"):
        measure.paired_log_ratio([1.0, 2.0], [1.0])
    order = []
    out = measure.interleave({k: (lambda k=k: order.append(k)) for k in "abc"}, 3, warm=0)
    assert order == list("abcbcacab") and all(len(v) == 3 for v in out.values())
    t = measure.time_to_target(10, [0.1, 0.2, 0.3])
    assert math.isclose(t["seconds"], 2.0) and t["lo"] <= t["seconds"] <= t["hi"]
    assert math.isnan(measure.time_to_target(None, [0.1])["seconds"])


def test_compile_cache_fresh_restores_env(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere")
    with measure.compile_cache("fresh") as d:
        import os
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == d != "/somewhere"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere"
    with pytest.raises(ValueError, match="hot"):
        with measure.compile_cache("hot"):
            pass


def test_declared_verdicts():
    d = verdicts.Declaration(
        "x.py", verdicts.Comparison("gap", "MGRIT", "serial", "test acc", "within", 1.0,
                                    "points", candidates=3, chosen_on="validation"),
        verdicts.Comparison("speed", "MGRIT", "lean", "CPU time", "faster", 1.0))
    iv = {"mean": 0.4, "lo": 0.05, "hi": 0.75, "n": 5}
    with pytest.raises(RuntimeError, match="freeze"):
        d.judge("gap", iv)
    d.freeze()
    s = d.judge("gap", iv)
    assert "within +-1" in s and "3 candidates" in s and "better" not in s
    with pytest.raises(KeyError, match="not declared"):
        d.judge("better than serial", iv)
    assert "slower" in d.judge("speed", {"mean": 0.8, "lo": 0.7, "hi": 0.9, "n": 5})
    assert "faster" in d.judge("speed", {"mean": 1.3, "lo": 1.1, "hi": 1.5, "n": 5})
    assert "no verdict" in d.judge("speed", {"mean": 1.3, "lo": 1.1, "hi": 1.5, "n": 5},
                                   reliable=False)
    with pytest.raises(ValueError, match="validation"):
        verdicts.Comparison("c", "a", "b", "m", "better", 0.0, candidates=3, chosen_on="test")


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_ranks(k, name):
    BATCH.run(k, name)


@pytest.mark.parametrize("compiled", [False, True])
def test_lean_job_equals_autograd(compiled):
    """The job's network (opening, 8 residual steps, classifier) trained 3 steps by LeanJob
    (lean body, momentum SGD on stacked tensors; compiled: torch.compile's eager backend)
    equals autograd + torch.optim.SGD on the nn.Sequential (float64)."""
    from layerpar.jobconfig import JobConfig
    from mgrit.models import build_model
    from experiments.benchmarks.job_baselines import LeanJob
    c = JobConfig(layers=8, width=4, batch_size=6, seed=0)
    ref = build_model("resnet", c, (784,), 10).double()
    net = build_model("resnet", c, (784,), 10).double()
    job = LeanJob(net, lr=0.1, momentum=0.9, compiled=compiled, block=4, backend="eager")
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(6, 784, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (6,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        job.step(x, y)
    for (k, a), b in zip(ref.named_parameters(), job.model().parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), k


def test_regime_map_report_from_recorded_numbers(tmp_path):
    """The regime map's tables, verdicts and plot from synthetic recorded repeats: the
    strongest baseline is the lowest median wall; an unreliable cell gets no verdict."""
    from experiments.reports import regime_map_report as rep
    from experiments.studies.regime_map import DECLARED
    DECLARED.freeze()

    def cell(N, mg, reliable):
        raw = {"lean": [(1.0, 1.0)] * 3, "lean DP": [(0.8, 0.9), (0.82, 0.9), (0.81, 0.9)],
               "pipeline": [(2.0, 1.0)] * 3, "MGRIT": [(mg, mg), (mg * 1.01, mg), (mg * 0.99, mg)]}
        return {"N": N, "width": 4, "raw": raw, "notes": {}, "mgrit_m": 16,
                "mgrit_m_pilot": {16: 0.1}, "pipeline": "GPipe M=2",
                "pipeline_pilot": {"GPipe M=2": 0.1, "ZBV M=2": "ValueError: x"},
                "gate": measure.load_gate([1.0 if reliable else 9.0], 2)}
    cells = [cell(64, 0.4, True), cell(256, 1.6, True), cell(1024, 0.4, False)]
    s = rep.summarize(cells[0])
    assert s["best"] == "lean DP"  # paired per repeat: median of 0.8/0.4, 0.82/0.404, 0.81/0.396
    assert s["wall"]["median"] == pytest.approx(0.82 / 0.404)
    res = {"cells": cells, "batch": 64, "lr": 1e-3, "momentum": 0.9,
           "settings": {"reps": 3}, "seconds": 1.0}
    rep.write(res, {"commit": "x", "loadavg": "0.5 0.5 0.5", "loadavg_after": "0.5 0.5 0.5",
                    "cores": 2}, tmp_path, DECLARED)
    table = (tmp_path / "table.md").read_text()
    assert "MGRIT faster (declared test) at: N=64 w=4;" in table
    assert "unreliable cells (load gate): 1 of 3" in table
    assert (tmp_path / "regime_map.png").stat().st_size > 0
