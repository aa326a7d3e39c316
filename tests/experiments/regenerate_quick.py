"""Shared by the ``quick`` fixture (``tests/experiments/conftest.py``): one
``experiments/regenerate.py --quick`` run over a list of registered scripts, the check of one
module's scripts in it, and the tails of its logs for failure messages."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT = int(os.environ.get("LAYERPAR_SMOKE_TIMEOUT", "1500"))  # every module's scripts


class QuickRun(tuple):
    """``(out, CompletedProcess)`` of one quick run; ``.only``: the scripts it was asked for."""

    def __new__(cls, out, proc, only):
        self = super().__new__(cls, (out, proc))
        self.only = list(only)
        return self


def run_quick(tmp_path_factory, only) -> QuickRun:
    """The quick run of ``only`` (concurrently, ``--jobs 2``)."""
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    out = tmp_path_factory.mktemp("quick")
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "regenerate.py"), "--quick",
                        "--jobs", "2", "--out", str(out), "--only", *only],
                       cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    return QuickRun(out, p, only)


def logs(out) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in (out / "logs").glob("*.log"))


def assert_every_script_ok(quick, only) -> dict:
    """The quick run ran exactly the scripts it was asked for (``only`` among them), each of
    ``only`` ``ok``, it failed only if one of its scripts did, and its MANIFEST names the
    commit; returns the manifest's records of ``only`` by name."""
    out, p = quick
    assert (out / "manifest.json").is_file(), p.stdout[-2000:] + p.stderr[-2000:] + logs(out)
    recs = {r["name"]: r for r in json.loads((out / "manifest.json").read_text())["records"]}
    assert sorted(recs) == sorted(quick.only) and set(only) <= set(recs), (sorted(recs), only)
    mine = {n: recs[n] for n in only}
    assert all(r["status"] == "ok" for r in mine.values()), f"{mine}\n{logs(out)}"
    assert p.returncode == 0 or any(r["status"] != "ok" for r in recs.values()), \
        p.stdout[-2000:] + p.stderr[-2000:] + logs(out)
    assert "- commit:" in (out / "MANIFEST.md").read_text()
    return mine
