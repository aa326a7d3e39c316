"""The performance scripts' quick modes run end to end (they cannot rot between record runs):
``bench_layerparallel.py --quick`` (1 process and its 2-rank part), ``plan.py --validate
--quick`` (the planner's P = 2 validation on small networks) and ``bench_dataparallel.py
--quick``. Each writes its table; the checks are on the table's structure, never on timings."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 600


def _run(script, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "benchmarks" / script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("script, args, sections", [
    ("bench_layerparallel.py", ["--quick"], ["## a.", "## b.", "## c.", "## d."]),
    ("plan.py", ["--validate", "--quick"], ["Recommendation", "measured fastest"]),
    ("bench_dataparallel.py", ["--quick"], ["P_D = 2 vs 1", "GPipe"]),
])
def test_quick_mode_writes_its_table(tmp_path, script, args, sections):
    out = tmp_path / "table.md"
    _run(script, *args, "--out", str(out))
    text = out.read_text()
    missing = [s for s in sections if s not in text]
    assert not missing, (missing, text[:3000])
    assert "commit" in text
