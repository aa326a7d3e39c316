"""Launch check functions on k MPI ranks from pytest and collect every rank's verdict.

A check is a plain function ``check_x(**kwargs)`` in an importable module (usually
``tests/mpi_cases/<room>/*.py``), run on every rank. The job is

    OMP_NUM_THREADS=1 <mpiexec -n k python -m mpi4py tests/mpi_runner.py CALLS.json>

under a timeout, with the venv's ``mpiexec`` (next to ``sys.executable``; override with
``LAYERPAR_MPIEXEC``). Each rank records ``ok`` or its traceback per check before re-raising,
so ``python -m mpi4py`` aborts the whole job instead of hanging, and the failing test shows the
report of *every* rank, not only rank 0's.

Starting torch (and torch._dynamo, which the first optimizer imports) costs about 5 CPU-s per
rank, so checks are grouped: :class:`MPIBatch` runs all the checks registered for one rank count
in a single job the first time one of them is requested, and under pytest that job also runs the
checks of that rank count of every other *shared* batch whose test file has a selected ``slow``
test (``tests/conftest.py`` passes the selection): one launch per rank count for the whole run
instead of one per file. A check that fails ends its job (MPI_Abort); the checks after it are
run again in a new job (at most ``RELAUNCHES`` times), so one failure does not fail
every later check. The runner restores torch's default dtype and grad mode between the files'
groups of checks, so each file's checks start as in a job of their own. ``--durations`` shows
the shared job under the first test that asked for it.
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


RELAUNCHES = 3  # per job: new jobs for the checks after a failed one
START_UP = 120.0  # s: a batch's job may take this beyond its timeout (its checks' watchdog may not)

_BATCHES: list["MPIBatch"] = []
_SELECTED: set[str] | None = None  # modules with a selected slow test; None: outside pytest


def select_modules(modules) -> None:
    """Called by ``tests/conftest.py`` after collection: the test modules whose shared batches
    join the one job per rank count (their files have a selected ``slow`` test)."""
    global _SELECTED
    _SELECTED = set(modules)


def _launch_all(nprocs: int, calls: list[dict], timeout: float) -> dict:
    """Run ``calls``; after a failed check, the checks after it again in a new job.

    Returns ``{name: (entry per rank or None, log, returncode)}`` for every call.
    """
    out, todo = {}, list(calls)
    for attempt in range(RELAUNCHES + 1):
        reports, log, rc = _launch(nprocs, todo, timeout)
        first_bad = None
        for i, call in enumerate(todo):
            entries = [rep.get(call["name"]) for rep in reports]
            out[call["name"]] = (entries, log, rc)
            if first_bad is None and not all(e is not None and e["status"] == "ok"
                                             for e in entries):
                first_bad = i
        # a timeout is not retried (a hang would cost the timeout again); nor the last call
        if first_bad is None or rc is None or first_bad + 1 >= len(todo) or attempt == RELAUNCHES:
            break
        todo = todo[first_bad + 1:]
    return out


def _verdict(name: str, target: str, nprocs: int, entries, log, rc) -> list:
    results, lines, ok = [], [], True
    for r, entry in enumerate(entries):
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
    return _verdict("check", target, nprocs, [rep.get("check") for rep in reports], log, rc)


class MPIBatch:
    """Checks registered with :meth:`add` at import time; :meth:`run` launches, on first use
    for a rank count, one job with all checks of that count and returns one check's verdict.

    ``shared=False`` keeps the batch in jobs of its own (checks that must run after something
    the test does first, or the harness's own smoke test). ``timeout`` bounds the batch's job
    and each of its checks (a rank whose check runs longer ends the job with tracebacks); a
    shared job gets the sum of its batches' timeouts plus ``START_UP``."""

    def __init__(self, timeout: float = 600.0, shared: bool = True):
        self.timeout = timeout
        self.shared = shared
        self.module = sys._getframe(1).f_globals.get("__name__", "?")
        self._calls: dict[int, list[dict]] = {}
        self._done: dict[int, dict] = {}
        _BATCHES.append(self)

    def add(self, nprocs: int, name: str, target: str, **kwargs) -> tuple[int, str]:
        calls = self._calls.setdefault(nprocs, [])
        if any(c["name"] == name for c in calls):
            raise ValueError(f"check {name!r} registered twice for {nprocs} ranks")
        calls.append({"name": name, "target": target, "kwargs": kwargs})
        return nprocs, name

    def ids(self) -> list[tuple[int, str]]:
        return [(k, c["name"]) for k, calls in self._calls.items() for c in calls]

    def _joining(self, nprocs: int) -> list["MPIBatch"]:
        if not self.shared or _SELECTED is None:
            return [self]
        return [b for b in _BATCHES if b is self or (
            b.shared and nprocs in b._calls and nprocs not in b._done and b.module in _SELECTED)]

    def run(self, nprocs: int, name: str) -> list:
        if nprocs not in self._done:
            batches = self._joining(nprocs)
            calls = [dict(c, name=f"{i}:{c['name']}", group=b.module, timeout=b.timeout)
                     for i, b in enumerate(batches) for c in b._calls[nprocs]]
            done = _launch_all(nprocs, calls, START_UP + sum(b.timeout for b in batches))
            for i, b in enumerate(batches):
                b._done[nprocs] = {c["name"]: done[f"{i}:{c['name']}"] for c in b._calls[nprocs]}
        target = next(c["target"] for c in self._calls[nprocs] if c["name"] == name)
        return _verdict(name, target, nprocs, *self._done[nprocs][name])
