"""Smoke tests of the study scripts experiments/reproduce_guenther.py and
experiments/reproduce_layerwise.py: each runs with ``--smoke`` on 2 MPI ranks into a temporary
folder and must leave results.h5, table.md (with the run metadata) and PNG plots."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).with_name("mpiexec")
if not MPIEXEC.exists():
    MPIEXEC = shutil.which("mpiexec")

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")


def _run(script, out, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", str(ROOT / "experiments" / script),
           "--smoke", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def _check(d: Path, pngs):
    import h5py

    assert (d / "results.h5").is_file() and (d / "table.md").is_file()
    table = (d / "table.md").read_text()
    for key in ("command", "commit", "machine", "loadavg"):
        assert f"- {key}:" in table
    with h5py.File(d / "results.h5") as f:
        assert len(f.keys()) > 0 and "command" in f.attrs
    for name in pngs:
        assert (d / name).is_file() and (d / name).stat().st_size > 1000, name
    return table


def test_reproduce_guenther_smoke(tmp_path):
    _run("reproduce_guenther.py", tmp_path)
    d = tmp_path / "guenther2020"
    table = _check(d, ["objective_vs_iter.png", "train_acc_vs_iter.png", "val_acc_vs_iter.png",
                       "train_loss_vs_modeled_time.png", "val_acc_vs_modeled_time.png",
                       "convergence_factors.png"])
    assert "| serial |" in table and "| simultaneous |" in table
    import h5py
    import numpy as np

    with h5py.File(d / "results.h5") as f:
        ser, sim = f["serial/objective"][()], f["simultaneous/objective"][()]
        assert len(ser) == len(sim) == 4  # iterations 0..3
        assert ser[-1] < ser[0] and sim[-1] < sim[0]
        # same initial weights: the inexact (2-iteration MGRIT) objective is close to the exact one
        assert abs(ser[0] - sim[0]) < 1e-2 * ser[0]
        assert np.all(np.isfinite(f["simultaneous/fwd_factor"][()]))


def test_reproduce_layerwise_smoke(tmp_path):
    _run("reproduce_layerwise.py", tmp_path)
    d = tmp_path / "layerwise"
    table = _check(d, ["digits_3x16_test_acc.png"])
    assert "| digits | 3x16 |" in table
    import h5py

    with h5py.File(d / "results.h5") as f:
        for m in ("end-to-end", "sequential", "DGL"):
            acc = f[f"digits_3x16/{m}/final_acc"][()]
            assert acc.shape == (1,) and 0.0 <= acc[0] <= 1.0


def test_help_flags():
    for script in ("reproduce_guenther.py", "reproduce_layerwise.py"):
        p = subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--help"],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0 and "--full" in p.stdout and "--smoke" in p.stdout
