"""Our MGRIT solver against PyMGRIT 1.0.6: residual histories to 1e-8 relative on 1..4 ranks.

References: PyMGRIT run serially in this process (its histories do not depend on the rank
count) and the golden histories of /work/shared/notes/mgrit.md (tests/pymgrit_ref.GOLDEN).
Cases (tests/pymgrit_ref.CASES): (a) Dahlquist nt=101, 2 levels, V, nested; (b) heat-1D
nx=1001, nt=65, 5 levels, F-cycle, no nested iteration; (c) Dahlquist nt=129 with cfactors
16,2,2,2 (N=128 not divisible by P=3, ranks without coarse points). On each rank count the
MPI job also checks: one-level solve == sequential stepping bitwise, converged states ==
sequential stepping to 10*tol, gather, and the ownership property of case (c).

This is the README's documented check of "same history as PyMGRIT 1.0.6": in a venv installed
as the README says (the ``dev`` extra brings PyMGRIT 1.0.6; tests/pymgrit_ref.py makes it import
on NumPy >= 2.4), ``python -m pytest -q tests/solver/test_pymgrit_crosscheck.py``.
"""
import pytest

from tests.mpi_harness import run_mpi
from tests.pymgrit_ref import (CASES, GOLDEN, compare_histories, drop_exact_zeros,
                               pymgrit_history)


@pytest.fixture(scope="module")
def references():
    """PyMGRIT 1.0.6 histories of every case, computed now (serial)."""
    return {case: pymgrit_history(case) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_pymgrit_run_reproduces_golden(references, case):
    # The golden constants carry 10-16 digits; the heat entries are truncated (~1e-11 rel).
    assert compare_histories(references[case], GOLDEN[case], rtol=1e-10) == []


def test_compare_histories_and_zero_dropping():
    ref = [1e-3, 2e-6]
    assert compare_histories(drop_exact_zeros([1e-3, 2e-6, 0.0]), ref) == []
    assert compare_histories([1e-3, 2e-6, 0.0], ref)  # an undropped zero changes the length
    assert compare_histories([1e-3, 2e-6 * (1 + 2e-8)], ref)  # 2e-8 relative is too much
    assert compare_histories([1e-3, 2e-6 * (1 + 5e-9)], ref) == []
    assert compare_histories([1e-3], ref)  # shorter history


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_histories_match_pymgrit_on_ranks(references, nprocs):
    results = run_mpi("tests.mpi_cases.core.pymgrit_cases:check_all", nprocs, timeout=120,
                      references=references, golden=GOLDEN)
    assert len(results) == nprocs and all(r is not None for r in results)
