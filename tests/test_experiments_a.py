"""Smoke tests of the reproduction studies (Kirby 2020, TorchBraid MNIST, convergence study):
each script runs with ``--smoke`` on 2 MPI ranks into a temporary folder and writes its
results.h5, table.md and PNG plots. The three launches run concurrently (each needs seconds of
compute; most of the wall time is interpreter start-up)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
SCRIPTS = {
    "reproduce_kirby.py": ("kirby2020", ["speedup_vs_depth.png", "speedup_vs_ranks.png"]),
    "reproduce_torchbraid.py": ("torchbraid_mnist", ["accuracy.png", "time_per_epoch.png"]),
    "study_convergence.py": ("convergence", ["factor_vs_N.png", "factor_vs_cfactor.png",
                                             "factor_vs_levels.png", "factor_F_vs_FCF.png"]),
}
TIMEOUT = int(os.environ.get("LAYERPAR_SMOKE_TIMEOUT", "300"))


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    out = tmp_path_factory.mktemp("results")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = {}
    for script in SCRIPTS:
        cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py",
               str(ROOT / "experiments" / script), "--smoke", "--out", str(out)]
        procs[script] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True)
    logs = {}
    for script, p in procs.items():
        try:
            logs[script] = (p.communicate(timeout=TIMEOUT)[0], p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            logs[script] = (p.communicate()[0], "timeout")
    return out, logs


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_smoke(smoke_runs, script):
    out, logs = smoke_runs
    log, rc = logs[script]
    assert rc == 0, f"{script} failed ({rc}):\n{log[-4000:]}"
    study, pngs = SCRIPTS[script]
    d = out / study
    for f in ["results.h5", "table.md", *pngs]:
        assert (d / f).is_file() and (d / f).stat().st_size > 0, f"{script}: missing {f}"
    table = (d / "table.md").read_text()
    assert "- command:" in table and "- commit:" in table and "- machine:" in table
    import h5py
    with h5py.File(d / "results.h5") as h:
        assert len(h.keys()) > 0 and "commit" in h.attrs

