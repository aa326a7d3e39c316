"""The differential fuzzer (issue 22; tests/fuzz/) in CI: a bounded, deterministic budget.

* 1 rank, in-process: Hypothesis generates and shrinks programs (``derandomize``: the same
  programs every run), each run on the layer-parallel model and its serial twin, compared
  after every action in float64 at 1e-9 (:mod:`tests.fuzz.executor`).
* 2 and 3 ranks: fixed seeds, one ``mpiexec`` per rank count (programs seeded alike on every
  rank, failures shrunk in the job and printed with a replay command), plus the regression
  programs of :mod:`tests.fuzz.regressions` for that rank count.
* No MPI: the shrinker on a synthetic predicate, and the oracle against a planted bug (a
  layer-parallel output off by 1e-8 must fail).

Features in ``KNOWN_BROKEN_ON_MAIN`` (and ``compile``, campaign only) are not generated here;
regression programs that need one are skipped until it leaves that set. The long campaign: ``python -m tests.fuzz campaign``.
"""
import pytest
import torch
from mpi4py import MPI

from tests.fuzz import nets
from tests.fuzz.executor import differ, run_program
from tests.fuzz.hypo import fuzz_one_rank
from tests.fuzz.program import (FEATURES, KNOWN_BROKEN_ON_MAIN, default_features, from_seed,
                                shrink)
from tests.fuzz.regressions import REGRESSIONS
from tests.mpi_harness import MPIBatch

SEEDS = {2: list(range(0, 10)), 3: list(range(10, 18))}  # CI budget per rank count
BATCH = MPIBatch()
for k, seeds in SEEDS.items():
    BATCH.add(k, "seeds", "tests.fuzz.driver:check_seeds", seeds=seeds)
for i, reg in enumerate(REGRESSIONS):
    if reg["ranks"] > 1 and reg["feature"] not in KNOWN_BROKEN_ON_MAIN:
        BATCH.add(reg["ranks"], f"regression-{i}", "tests.fuzz.driver:check_program",
                  program=reg["program"], expect="pass")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fuzz_one_rank_hypothesis():
    fuzz_one_rank(max_examples=14)()


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_fuzz_mpi(k, name):
    BATCH.run(k, name)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("i", [i for i, r in enumerate(REGRESSIONS) if r["ranks"] == 1])
def test_fuzz_regression_one_rank(i):
    reg = REGRESSIONS[i]
    if reg["feature"] in KNOWN_BROKEN_ON_MAIN:
        pytest.skip(f"{reg['feature']} is in KNOWN_BROKEN_ON_MAIN (issue 22: {reg['issue']})")
    verdict = run_program(reg["program"], MPI.COMM_SELF)
    assert verdict["status"] != "fail", verdict  # ok, or an agreed refusal


def test_regressions_name_known_features():
    """Every regression program names a gate that exists (or None) and a rank count 1-3."""
    for reg in REGRESSIONS:
        assert reg["feature"] is None or reg["feature"] in FEATURES, reg
        assert reg["ranks"] in (1, 2, 3), reg


def test_programs_are_deterministic_and_gated():
    """The same seed gives the same program (what lets every rank generate it alone), and a
    gated feature never appears unless enabled."""
    assert from_seed(123) == from_seed(123)
    assert from_seed(5) == from_seed(5, default_features())
    gated = {"clip", "replace_param", "load_assign", "nan_backward"}
    for s in range(200):
        p = from_seed(s, frozenset())
        assert p["net"]["step"] not in ("subclass", "subclass_buffer") and not p["net"]["compiled"]
        assert not gated & {a[0] for a in p["actions"]}
        if p["net"]["levels"] > 1:
            assert all(a[0] != "hook_add" for a in p["actions"])
        if p["net"]["dp"] > 1:  # under data parallelism: no unfreezing
            assert all(a[1]["on"] is False for a in p["actions"] if a[0] == "freeze")
    everything = [from_seed(s, FEATURES) for s in range(400)]
    kinds = {a[0] for p in everything for a in p["actions"]}
    assert gated <= kinds and {p["net"]["step"] for p in everything} >= {"subclass"}


def test_shrinker_finds_a_minimal_program():
    """Greedy shrinking of a 12-action program whose 'failure' needs a hook_add before a
    forward, on any network: two actions and the simplest network remain."""
    acts = [["train", {"on": True}], ["forward", {"x": 1, "mode": "no_grad"}],
            ["hook_add", {"kind": "count"}], ["zero_grad", {"none": True}]] * 3
    program = {"net": {"kind": "conv", "step": "buffer", "layers": 6, "levels": 2,
                       "norm": "inf", "compiled": False, "seed": 5}, "actions": acts}

    def fails(p):
        names = [a[0] for a in p["actions"]]
        return "hook_add" in names and "forward" in names[names.index("hook_add"):]

    small = shrink(program, fails, budget=200)
    assert [a[0] for a in small["actions"]] == ["hook_add", "forward"]
    assert small["net"] == {"kind": "dense", "step": "shipped", "layers": 4, "levels": 1,
                            "norm": "l2", "compiled": False, "seed": 5}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_oracle_catches_a_planted_error(monkeypatch):
    """The comparison is sharp: an output off by 1e-8 fails at the first forward;
    the unmodified twin passes the same program."""
    program = {"net": {"kind": "dense", "step": "shipped", "layers": 4, "levels": 2,
                       "norm": "l2", "compiled": False, "seed": 1},
               "actions": [["forward", {"x": 3, "mode": "grad"}],
                           ["backward", {"i": 0, "w": 4, "retain": False, "all": False}]]}
    assert run_program(program, MPI.COMM_SELF)["status"] == "ok"
    forward = nets.Twin.lp_forward
    monkeypatch.setattr(nets.Twin, "lp_forward", lambda self, x: forward(self, x) + 1e-8)
    verdict = run_program(program, MPI.COMM_SELF)
    assert verdict["status"] == "fail" and verdict["step"] == 0, verdict
    assert differ(torch.ones(2), torch.ones(2) + 2e-9) is None
    assert "NaN" in differ(torch.tensor([float("nan")]), torch.tensor([1.0]))
