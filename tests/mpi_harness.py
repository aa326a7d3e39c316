"""Launch check functions on k MPI ranks from pytest and collect every rank's verdict.

A check is a plain function ``check_x(**kwargs)`` in an importable module (usually
``tests/mpi_cases/<room>/*.py``), run on every rank. The job is

    OMP_NUM_THREADS=1 <mpiexec -n k python -m mpi4py tests/mpi_runner.py CALLS.json>

under a timeout, with the venv's ``mpiexec`` (next to ``sys.executable``; override with
``LAYERPAR_MPIEXEC``). Each rank records ``ok`` or its traceback per check before re-raising,
so ``python -m mpi4py`` aborts the whole job instead of hanging, and the failing test shows the
report of *every* rank, not only rank 0's.

Starting torch on k ranks costs seconds, so checks are grouped: :class:`MPIBatch` runs all the
checks registered for one rank count in a single job the first time one of them is requested.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpiexec_path() -> str:
    """The ``mpiexec`` to use: ``$LAYERPAR_MPIEXEC``, else the venv's, else the one on PATH."""
    env = os.environ.get("LAYERPAR_MPIEXEC")
    if env:
        return env
    venv = Path(sys.executable).parent / "mpiexec"
    if venv.exists():
        return str(venv)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec found (pip install mpich, or set LAYERPAR_MPIEXEC)")
    return found


def _launch(nprocs: int, calls: list[dict], timeout: float):
    """Run ``calls`` on ``nprocs`` ranks. Returns ``(reports per rank, log, returncode)``."""
    if not 1 <= nprocs <= 8:
        raise ValueError(f"nprocs={nprocs} is not allowed here: use 1..8")
    with tempfile.TemporaryDirectory(prefix="layerpar-mpi-") as tmp:
        spec = Path(tmp) / "calls.json"
        spec.write_text(json.dumps(calls))
        env = dict(os.environ)
        # cases catch errors on every rank: no abort from a collective section (mgrit.collective)
        env.setdefault("LAYERPAR_ABORT_ON_ERROR", "0")
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", LAYERPAR_MPI_REPORT_DIR=tmp,
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
        cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, "-m", "mpi4py",
               str(ROOT / "tests" / "mpi_runner.py"), str(spec)]
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=timeout)
            log, rc = proc.stdout[-3000:] + "\n--- stderr\n" + proc.stderr[-5000:], proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            log, rc = f"TIMED OUT after {timeout}s\n{out[-3000:]}\n--- stderr\n{err[-5000:]}", None
        reports = []
        for r in range(nprocs):
            path = Path(tmp) / f"rank-{r}.json"
            reports.append(json.loads(path.read_text()) if path.exists() else {})
    return reports, log, rc


def _verdict(name: str, target: str, nprocs: int, reports, log, rc) -> list:
    results, lines, ok = [], [], True
    for r, rep in enumerate(reports):
        entry = rep.get(name)
        if entry is None:
            ok = False
            lines.append(f"--- rank {r}: no report (job aborted or hung before this check)")
            results.append(None)
        else:
            ok &= entry["status"] == "ok"
            lines.append(f"--- rank {r}: {entry['status']}\n{entry.get('traceback', '')}")
            results.append(entry.get("result"))
    if not ok:
        pytest.fail("\n".join([f"{target} on {nprocs} ranks failed (exit {rc})", *lines,
                               "--- job output", log]), pytrace=False)
    return results


def run_mpi(target: str, nprocs: int, timeout: float = 300.0, **kwargs) -> list:
    """Run one check on ``nprocs`` ranks; returns the per-rank return values (``repr``)."""
    reports, log, rc = _launch(nprocs, [{"name": "check", "target": target, "kwargs": kwargs}],
                               timeout)
    return _verdict("check", target, nprocs, reports, log, rc)


class MPIBatch:
    """Checks registered with :meth:`add` at import time; :meth:`run` launches, on first use
    for a rank count, one job with all checks of that count and returns one check's verdict."""

    def __init__(self, timeout: float = 600.0):
        self.timeout = timeout
        self._calls: dict[int, list[dict]] = {}
        self._done: dict[int, tuple] = {}

    def add(self, nprocs: int, name: str, target: str, **kwargs) -> tuple[int, str]:
        calls = self._calls.setdefault(nprocs, [])
        if any(c["name"] == name for c in calls):
            raise ValueError(f"check {name!r} registered twice for {nprocs} ranks")
        calls.append({"name": name, "target": target, "kwargs": kwargs})
        return nprocs, name

    def ids(self) -> list[tuple[int, str]]:
        return [(k, c["name"]) for k, calls in self._calls.items() for c in calls]

    def run(self, nprocs: int, name: str) -> list:
        if nprocs not in self._done:
            self._done[nprocs] = _launch(nprocs, self._calls[nprocs], self.timeout)
        target = next(c["target"] for c in self._calls[nprocs] if c["name"] == name)
        return _verdict(name, target, nprocs, *self._done[nprocs])
