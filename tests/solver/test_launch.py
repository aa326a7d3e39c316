"""Issue 25 item 1: a foreign launcher (torchrun, srun with another MPI, another MPI's mpirun)
that starts K processes MPI sees as K separate 1-rank jobs is refused with one line saying how
to launch -- by the library (ProcessGrid) and by the main job, before anything runs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from mpi4py import MPI

from mgrit.launch import LaunchError, check_launch, foreign_launch
from mgrit.parallel import ProcessGrid
from tests.job.test_train_job import ROOT, SCRIPT, TINY, job_env


@pytest.mark.parametrize("env, want", [
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
     ("torchrun (torch.distributed)", 2, 1)),
    ({"SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0",
      "SLURM_PROCID": "3"}, ("Slurm srun", 4, 3)),
    ({"PMI_SIZE": "3", "PMI_RANK": "2"}, ("an MPICH-style mpiexec (PMI) (PMI_SIZE=3)", 3, 2)),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},
     ("Open MPI's mpirun (OMPI_COMM_WORLD_SIZE=2)", 2, 0)),
    # not a launch of several processes: the batch script itself, one task, torchrun of 1
    ({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}, None),
    ({"SLURM_NTASKS": "8", "SLURM_STEP_ID": "batch"}, None),
    ({"WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}, None),
    ({"PMI_SIZE": "1"}, None),
    ({}, None),
])
def test_foreign_launch_reads_the_launchers_variables(env, want):
    assert foreign_launch(env) == want


def test_process_grid_refuses_a_foreign_launch(monkeypatch):
    assert MPI.COMM_WORLD.Get_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    with pytest.raises(LaunchError, match=r"torchrun .* 2 processes, but MPI sees 1 rank.*"
                                          r"mpiexec -n 2 python -m mpi4py"):
        ProcessGrid(MPI.COMM_SELF)
    monkeypatch.setenv("LAYERPAR_IGNORE_LAUNCHER", "1")
    check_launch()  # independent processes on purpose
    ProcessGrid(MPI.COMM_SELF).free()


@pytest.mark.slow
def test_torchrun_of_the_main_job_is_one_line_and_nonzero(tmp_path):
    """A real ``torchrun --nproc_per_node 2 experiments/train.py`` (offline: --standalone)."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun not installed next to python")
    out = tmp_path / "run"
    p = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(SCRIPT)] + TINY
                       + ["--out", str(out)], cwd=ROOT, env=job_env(), capture_output=True,
                       text=True, timeout=300)
    text = p.stdout + p.stderr
    assert p.returncode != 0, text[-3000:]
    lines = [ln for ln in text.splitlines() if ln.startswith("experiments/train.py: error: ")]
    assert lines and all(ln == lines[0] for ln in lines), text[-3000:]
    assert "torchrun" in lines[0] and "mpiexec -n 2 python -m mpi4py experiments/train.py" \
        in lines[0] and "srun" in lines[0], lines[0]
    assert not out.exists()  # nothing ran
