"""The MPI harness itself: results come back from every rank, one failing rank fails the job fast."""

import pytest

from tests.mpi_harness import MPIBatch, run_mpi

BATCH = MPIBatch()
for _k in (1, 2, 3, 4):
    BATCH.add(_k, "sum", "tests.mpi_cases.core.smoke_cases:check_sum", expected=_k * (_k + 1) // 2)


@pytest.mark.parametrize("k,name", BATCH.ids())
def test_every_rank_reports(k, name):
    assert BATCH.run(k, name) == [repr(k * (k + 1) // 2)] * k


@pytest.mark.slow
def test_failure_on_one_rank_is_reported_and_does_not_hang():
    with pytest.raises(pytest.fail.Exception) as info:
        run_mpi("tests.mpi_cases.core.smoke_cases:check_rank1_fails", 2, timeout=60)
    assert "deliberate failure on rank 1" in str(info.value)
    assert "rank 0: no report" in str(info.value)
    assert "TIMED OUT" not in str(info.value)  # ended by MPI_Abort, not by the harness timeout
