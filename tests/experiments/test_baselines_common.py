"""The timing tables' shared helpers (experiments/benchmarks/baselines_common.py) against
hand-computed cases: interleaving order, the relative gradient error, the strongest baseline and
its speed-ups, the verdict sentence, torch.compile failures reported by their first line, and
the compiled lean step's gradient hook against the eager lean step (float64)."""
from __future__ import annotations

import math

import pytest
import torch

from experiments.benchmarks import baselines_common as bc
from mgrit.perf.lean import LeanResNet, compiled_train_step


def test_interleave_runs_a_b_c_a_b_c():
    calls = []
    timers = {k: (lambda k=k: calls.append(k) or len(calls) * 0.5) for k in "ABC"}
    out = bc.interleave(timers, 3)
    assert calls == list("ABCABCABC")
    assert out == {"A": [0.5, 2.0, 3.5], "B": [1.0, 2.5, 4.0], "C": [1.5, 3.0, 4.5]}
    with pytest.raises(ValueError, match="repeats=0"):
        bc.interleave(timers, 0)


def test_grad_error_hand_case():
    # g - g_exact = ([3, 0], [0]) -> 3; ||g_exact|| = ||(0, 4, 0)|| = 4
    g = [torch.tensor([3.0, 4.0]), torch.tensor([0.0])]
    ex = [torch.tensor([0.0, 4.0]), torch.tensor([0.0])]
    assert bc.grad_error(g, ex) == pytest.approx(0.75, rel=1e-15)
    assert bc.grad_error(ex, ex) == 0.0
    assert bc.grad_error([torch.ones(2)], [torch.zeros(2)]) == math.inf
    with pytest.raises(ValueError, match="same parameters"):
        bc.grad_error(g, ex[:1])
    with pytest.raises(ValueError, match="same parameters"):
        bc.grad_error([torch.ones(2)], [torch.ones(3)])


class _TwoRanks:
    """A stand-in communicator whose other rank holds ``(d, r)`` = (16, 0) (its parts of the
    squared difference and of the squared exact norm)."""
    def allgather(self, x):
        return [x, (16.0, 0.0)]


def test_grad_error_sums_over_ranks():
    # this rank: d = 9, r = 16; other rank: d = 16, r = 0 -> sqrt(25 / 16)
    assert bc.grad_error([torch.tensor([3.0, 4.0])], [torch.tensor([0.0, 4.0])], comm=_TwoRanks()) \
        == pytest.approx(1.25, rel=1e-15)


def test_speedups_against_the_strongest_baseline_and_verdict():
    series = {"serial": [2.0, 2.0, 2.2], "compiled": [1.0, 1.2, 1.1], "dp": [1.5, 1.6, 1.4],
              "mgrit": [0.5, 0.55, 0.6], "gpipe": [4.4, 4.4, 4.4]}
    best, sp = bc.speedups(series, ["serial", "compiled", "dp", "missing"])
    assert best == "compiled"
    assert sp["mgrit"] == pytest.approx(1.1 / 0.55) and sp["gpipe"] == pytest.approx(0.25)
    assert sp["compiled"] == 1.0
    with pytest.raises(ValueError, match="none of the baselines"):
        bc.speedups(series, ["nope"])
    s = bc.verdict("MGRIT", [("N = 64", 2.0), ("N = 256", 0.5)], "compiled", reliable=True)
    assert s == "MGRIT against compiled: wins at N = 64 (2.00x); loses at N = 256 (0.50x)."
    assert "wins nowhere" in bc.verdict("X", [("a", 1.0)], reliable=True)
    # the load gate: an unreliable run gets no verdict, whatever its numbers
    no = bc.verdict("MGRIT", [("N = 64", 2.0)], "compiled", reliable=False)
    assert "no verdict" in no and "wins" not in no


def test_cell_and_raw_path():
    assert bc.cell([1.0, 2.0, 3.0, 4.0, 5.0]) == "3 [2-4]"
    assert bc.cell([0.001, 0.002, 0.003], scale=1e3) == "2 [1.5-2.5]"
    assert bc.raw_path("a/b/table.md").as_posix() == "a/b/table.raw.json"


def test_try_compile_reports_only_compile_errors():
    def fails():
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler\nlong traceback")
    fn, note = bc.try_compile(fails)
    assert fn is None and note == "does not compile here: TorchDynamoException: no C++ compiler"
    with pytest.raises(ZeroDivisionError):  # not torch.compile's: a bug, never hidden
        bc.try_compile(lambda: 1 / 0)
    fn, note = bc.try_compile(lambda: (lambda: 3), warm=lambda f: f())
    assert fn() == 3 and note.startswith("compiled in")


def test_compiled_step_gradient_hook_sees_the_eager_gradient():
    """compiled_train_step(grad_hook=...) (eager backend: dynamo only, seconds) calls the hook
    with the gradient of the eager lean step before SGD; a hook that halves the gradient gives
    the SGD step of lr / 2 (what the data-parallel Allreduce + 1/P does)."""
    torch.manual_seed(0)
    W, b = torch.randn(8, 4, 4, dtype=torch.float64) * 0.3, torch.randn(8, 4, dtype=torch.float64)
    x = torch.randn(6, 4, dtype=torch.float64)
    eager, comp, half = (LeanResNet(W, b, 0.125) for _ in range(3))
    seen = []
    step = compiled_train_step(comp, 4, "eager", grad_hook=lambda n: seen.append(n.grad_flat.clone()))
    step(x, 0.1)
    eager.train_step(x, 0.1)
    assert torch.allclose(seen[0], eager.grad_flat, rtol=1e-12, atol=1e-14)
    assert torch.allclose(comp.WT, eager.WT, rtol=1e-12, atol=1e-14)
    compiled_train_step(half, 4, "eager", grad_hook=lambda n: n.grad_flat.mul_(0.5))(x, 0.2)
    assert torch.allclose(half.WT, eager.WT, rtol=1e-12, atol=1e-14)
