"""The MPI harness itself: results come back from every rank, one failing rank fails the job fast."""

import pytest

from tests.mpi_harness import MPIBatch, run_mpi

BATCH = MPIBatch(shared=False)  # the harness smoke test: its own small jobs
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


@pytest.mark.slow
def test_shared_batches_one_job_fresh_torch_defaults_and_a_new_job_after_a_failure(monkeypatch):
    """Two files' batches run in one job; the second file's checks see torch's start-up
    defaults although the first changed them; after a failed check the rest run anew."""
    from tests import mpi_harness
    monkeypatch.setattr(mpi_harness, "_BATCHES", [])
    monkeypatch.setattr(mpi_harness, "_SELECTED", {__name__, "other_file"})
    launches, launch = [], mpi_harness._launch
    monkeypatch.setattr(mpi_harness, "_launch", lambda k, calls, t: (
        launches.append([c["name"] for c in calls]), launch(k, calls, t))[1])
    s = "tests.mpi_cases.core.smoke_cases:"
    a, b = MPIBatch(timeout=60), MPIBatch(timeout=60)
    b.module = "other_file"
    a.add(2, "sum", s + "check_sum", expected=3)
    a.add(2, "change", s + "check_leave_torch_changed")
    b.add(2, "defaults", s + "check_torch_defaults")
    b.add(2, "fails", s + "check_rank1_fails")
    b.add(2, "sum", s + "check_sum", expected=3)
    assert a.run(2, "sum") == ["3", "3"]
    assert b.run(2, "defaults") == [repr(("torch.float32", True))] * 2
    with pytest.raises(pytest.fail.Exception, match="deliberate failure on rank 1"):
        b.run(2, "fails")
    assert b.run(2, "sum") == ["3", "3"]
    assert launches == [["0:sum", "0:change", "1:defaults", "1:fails", "1:sum"], ["1:sum"]]


@pytest.mark.slow
def test_a_hung_check_ends_its_job_at_the_batch_timeout(monkeypatch):
    """The per-check watchdog (faulthandler) ends a rank whose check outlives the batch's
    timeout, tracebacks in the log, before the job's own (summed) timeout."""
    from tests import mpi_harness
    monkeypatch.setattr(mpi_harness, "_BATCHES", [])
    monkeypatch.setattr(mpi_harness, "_SELECTED", {__name__})
    b = MPIBatch(timeout=3)
    b.add(1, "hangs", "tests.mpi_cases.core.smoke_cases:check_hangs")
    b.add(1, "sum", "tests.mpi_cases.core.smoke_cases:check_sum", expected=1)
    with pytest.raises(pytest.fail.Exception) as info:
        b.run(1, "hangs")
    assert "rank 0: no report" in str(info.value) and "Timeout (0:00:03)!" in str(info.value)
    assert "TIMED OUT" not in str(info.value)  # the watchdog, not the harness's timeout
    assert b.run(1, "sum") == ["1"]  # the check after it ran in a new job
