"""Issue 25 item 1: a failure inside a collective section on one rank ends the job whatever the
launch line, and a library rendezvous names the ranks that never arrived instead of hanging.
The user script (tests/mpi_cases/core/collective_script.py) runs on 2 ranks with a plain
``mpiexec -n 2 python script.py`` (no ``-m mpi4py``, no fail_fast)."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from mgrit import collective
from tests.mpi_harness import mpiexec_path
from tests.job.test_train_job import ROOT, job_env

pytestmark = pytest.mark.slow  # MPI launches / builds (the quick subset skips them)

SCRIPT = ROOT / "tests" / "mpi_cases" / "core" / "collective_script.py"


def _run(mode: str):
    env = job_env()
    env.pop("LAYERPAR_ABORT_ON_ERROR", None)
    env.pop("LAYERPAR_COLLECTIVE_TIMEOUT", None)
    p = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(SCRIPT), mode], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_missing_backward_and_one_rank_failure_end_the_job():
    with ThreadPoolExecutor(2) as pool:
        (rc_skip, skip), (rc_fail, fail) = pool.map(_run, ["skip", "adjoint"])
    # .backward() on rank 0 only: rank 0's agreement names rank 1 after the 2 s deadline
    assert rc_skip != 0 and "finished (must not happen)" not in skip, skip[-3000:]
    assert "rank 0 failed in phase backward agreement: CollectiveTimeout" in skip \
        and "rank(s) [1] never arrived within 2 s" in skip, skip[-3000:]
    # a step's VJP fails on rank 1 only, inside the adjoint solve: the job ends at once
    assert rc_fail != 0 and "finished (must not happen)" not in fail, fail[-3000:]
    assert "rank 1 failed in phase MGRIT solve: ValueError: step VJP failed on purpose" \
        in fail, fail[-3000:]


def test_one_rank_failure_on_the_one_level_path_ends_the_job():
    """A step's backward fails on the last rank only, on the pipelined one-level path (in the
    caller's autograd engine, no library section around it): the previous rank's receive of
    the gradient has the collective deadline, so the job ends naming rank 1 instead of waiting
    forever (it waited forever before)."""
    rc, out = _run("pipelined")
    assert rc != 0 and "finished (must not happen)" not in out, out[-3000:]
    assert "rank 0 failed in phase pipelined adjoint: CollectiveTimeout" in out \
        and "the gradient of its last state from rank 1" in out, out[-3000:]


def test_settings_are_checked(monkeypatch):
    monkeypatch.setattr(collective, "_settings", dict(collective._settings,
                                                      timeout=collective._UNSET, abort=None))
    monkeypatch.delenv(collective.TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(collective.ABORT_ENV, raising=False)
    assert collective.collective_timeout() == 600.0 and collective.abort_on_error()
    monkeypatch.setenv(collective.TIMEOUT_ENV, "none")
    assert collective.collective_timeout() is None
    monkeypatch.setenv(collective.TIMEOUT_ENV, "-3")
    with pytest.raises(ValueError, match=r"\$LAYERPAR_COLLECTIVE_TIMEOUT='-3' is not allowed"):
        collective.collective_timeout()
    for bad in (0, float("nan"), "x", True):
        with pytest.raises(ValueError, match="is not allowed: use a number of seconds > 0"):
            collective.set_collective_timeout(bad)
    collective.set_collective_timeout(2.5)
    assert collective.collective_timeout() == 2.5
    monkeypatch.setenv(collective.ABORT_ENV, "0")
    assert not collective.abort_on_error()
    collective.set_abort_on_error(True)
    assert collective.abort_on_error()
