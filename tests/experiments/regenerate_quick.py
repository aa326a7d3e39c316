"""Shared by ``tests/experiments/test_experiments_{a,b}.py``: one ``experiments/regenerate.py --quick`` run
over a list of registered scripts, and the tails of its logs for failure messages."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT = int(os.environ.get("LAYERPAR_SMOKE_TIMEOUT", "600"))


def run_quick(tmp_path_factory, only):
    """``(out, CompletedProcess)`` of the quick run of ``only`` (concurrently, ``--jobs 2``)."""
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    out = tmp_path_factory.mktemp("quick")
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "regenerate.py"), "--quick",
                        "--jobs", "2", "--out", str(out), "--only", *only],
                       cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    return out, p


def logs(out) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in (out / "logs").glob("*.log"))


def assert_every_script_ok(quick, only) -> dict:
    """The quick run succeeded, ran exactly ``only``, each ``ok``, and its MANIFEST names the
    commit; returns the manifest's records by name."""
    out, p = quick
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + logs(out)
    recs = {r["name"]: r for r in json.loads((out / "manifest.json").read_text())["records"]}
    assert sorted(recs) == sorted(only)
    assert all(r["status"] == "ok" for r in recs.values()), recs
    assert "- commit:" in (out / "MANIFEST.md").read_text()
    return recs
