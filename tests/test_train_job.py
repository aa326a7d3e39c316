"""End-to-end tests of the main job ``experiments/train.py`` (tiny settings: digits, a few
residual layers, 1-2 epochs, a few hundred samples): run directories, equality with plain-loop
references written in ``tests/mpi_cases/trainer_ref_cases.py`` (bit for bit), every sample
used with replicas, kill and resume.

Launching python + torch costs seconds per rank, so the jobs are started a few at a time in a
module-scoped fixture (``subprocess.Popen``) and the tests only inspect the results.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import h5py
import pytest

from tests.mpi_harness import MPIBatch, mpiexec_path

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "experiments" / "train.py"
TINY = ["--dataset", "digits", "--layers", "4", "--epochs", "1", "--limit-train", "200",
        "--limit-test", "100", "--batch-size", "50", "--no-progress"]
# the settings of tests/mpi_cases/trainer_ref_cases.py (2 epochs, a partial last batch)
REF = ["--dataset", "digits", "--layers", "8", "--width", "8", "--levels", "2", "--cfactor", "2",
       "--epochs", "2", "--limit-train", "200", "--limit-test", "100", "--batch-size", "48",
       "--seed", "1", "--no-progress"]
# 101 samples in batches of 50: the last batch has 1 sample for 2 replicas (issue 13 item 5)
LAST1 = ["--serial", "--dataset", "digits", "--layers", "4", "--width", "8", "--epochs", "2",
         "--limit-train", "101", "--limit-test", "60", "--batch-size", "50", "--dtype",
         "float64", "--no-progress"]
JOBS = {  # name: (ranks, flags)
    "mgrit1": (1, TINY),
    "mgrit2": (2, REF + ["--method", "mgrit"]),
    "serial2": (2, REF + ["--serial"]),
    "sequential1": (1, TINY + ["--method", "sequential", "--layers", "2"]),
    "decoupled2": (2, REF + ["--method", "decoupled"]),
    "last1-dp2": (2, LAST1 + ["--dp", "2"]),
    "last1-dp1": (1, LAST1),
}
TIMEOUT = 420  # generous: a loaded 2-core machine stretches start-up many times
PARALLEL = 3
R = "tests.mpi_cases.trainer_ref_cases"
REFS = MPIBatch(timeout=400)
REFS.add(2, "mgrit", f"{R}:reference_end_to_end", method="mgrit")
REFS.add(2, "serial", f"{R}:reference_end_to_end", method="serial")
REFS.add(2, "decoupled", f"{R}:reference_decoupled")


def _cmd(ranks: int, args: list) -> list:
    py = [sys.executable, "-m", "mpi4py", str(SCRIPT)]
    return py + args if ranks == 1 else [mpiexec_path(), "-n", str(ranks)] + py + args


def job_env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("LAYERPAR_INJECT_FAULT", None)
    env.update(extra)
    return env


def run_jobs(jobs: dict, base: Path, parallel: int = PARALLEL) -> dict:
    """Run ``{name: (ranks, flags)}`` (``--out base/name`` appended unless given), a few at a time;
    returns ``{name: (out dir, exit code, stdout, stderr)}``."""
    def one(item):
        name, (ranks, flags) = item
        out = base / name
        flags = list(flags) + ([] if "--out" in flags else ["--out", str(out)])
        p = subprocess.Popen(_cmd(ranks, flags), cwd=ROOT,
                             env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            so, se = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        return name, (out, p.returncode, so, se)

    with ThreadPoolExecutor(parallel) as pool:
        return dict(pool.map(one, jobs.items()))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return run_jobs(JOBS, tmp_path_factory.mktemp("train_job"))


def _check_run(result):
    out, rc, so, se = result
    assert rc == 0, f"exit {rc}\n--- stdout\n{so[-3000:]}\n--- stderr\n{se[-3000:]}"
    for f in ("metrics.h5", "summary.json", "curves.png"):
        assert (out / f).is_file(), f"{f} missing in {out}: {sorted(os.listdir(out))}"
    s = json.loads((out / "summary.json").read_text())
    fin = s["final"]
    assert math.isfinite(fin["loss"])
    for k in ("train_acc", "test_acc"):
        assert 0.0 <= fin[k] <= 1.0, (k, fin[k])
    import h5py
    with h5py.File(out / "metrics.h5", "r") as h:
        assert len(h["loss"]) >= 1 and "config" in h.attrs
    return s


@pytest.mark.parametrize("name", ["mgrit1", "mgrit2", "serial2", "sequential1", "decoupled2"])
def test_job_writes_run_directory(jobs, name):
    s = _check_run(jobs[name])
    ranks, _ = JOBS[name]
    assert s["world_size"] == ranks
    assert s["method"] == name.rstrip("12")


@pytest.mark.parametrize("method", ["mgrit", "serial", "decoupled"])
def test_job_equals_plain_loop_bit_for_bit(jobs, method):
    """The job's per-epoch loss, train/test accuracy and test loss (2 ranks, 2 epochs, float32,
    inexact MGRIT with warm start / 2 replicas / 2 pipelined DGL stages) equal the plain loops
    of trainer_ref_cases.py exactly (the library loop changes no number)."""
    name = f"{method}2"
    _check_run(jobs[name])
    with h5py.File(jobs[name][0] / "metrics.h5", "r") as f:
        keys = ["loss", "train_acc", "test_acc"] + (["test_loss"] if method != "decoupled" else [])
        got = [[float(f[k][e]) for k in keys] for e in range(len(f["loss"]))]
    refs = [eval(r) for r in REFS.run(2, method)]
    assert refs[0] == refs[1]
    assert got == refs[0], (got, refs[0])


def test_every_sample_used_with_replicas(jobs):
    """Issue 13 item 5: 101 samples in batches of 50 on 2 replicas (the last batch has one
    sample: one replica's shard is empty) train exactly as one replica (float64, 1e-12); the old
    job dropped that batch."""
    a = _check_run(jobs["last1-dp2"])
    b = _check_run(jobs["last1-dp1"])
    assert a["dp"] == 2 and b["dp"] == 1
    for k in ("loss", "train_acc", "test_acc", "test_loss"):
        assert abs(a["final"][k] - b["final"][k]) <= 1e-12 * max(1.0, abs(b["final"][k])), \
            (k, a["final"], b["final"])


def _load_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_job_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("args, world, message", [
    (["--levels", "0"], 1, "--levels=0 is not allowed"),
    (["--relax", "F,XYZ"], 1, "--relax='F,XYZ'"),
    (["--dp", "3"], 2, "--dp=3 does not divide the world size 2"),
    (["--serial", "--dp", "1"], 2, "has no layer parallelism"),
    (["--layers", "1"], 2, "--layers=1 is smaller than the 2 layer ranks"),
    (["--dataset", "nosuchset"], 1, "--dataset='nosuchset' is unknown"),
    (["--dataset", "nosuchset"], 1, "'hdf5'"),
])
def test_bad_flags_fail_clearly(args, world, message, capsys):
    """Validation runs before any communication (in-process here, one rank; a job prints the
    usage once, on rank 0, and every rank exits with argparse's status 2)."""
    mod = _load_script()
    parser = mod.build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_config(args, world)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_killed_job_resumes_to_the_uninterrupted_result(tmp_path):
    """--method mgrit, float64, 2 ranks: a job that fails on rank 1 mid-epoch (injected fault in
    its 13th 'data loading' phase, after the checkpoint of step 10) and is resumed from that
    checkpoint on 2 and on 3 ranks ends with the metrics of the uninterrupted job."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    flags = ["--dataset", "digits", "--layers", "6", "--width", "8", "--epochs", "2",
             "--limit-train", "700", "--limit-test", "100", "--batch-size", "50",
             "--dtype", "float64", "--levels", "2", "--cfactor", "2", "--no-progress"]

    def run(name, ranks, extra, fault=None):
        e = dict(env)
        if fault:
            e["LAYERPAR_INJECT_FAULT"] = fault
        return subprocess.run(_cmd(ranks, flags + extra + ["--out", str(tmp_path / name)]),
                              cwd=ROOT, env=e, capture_output=True, text=True, timeout=TIMEOUT)

    full = run("full", 2, [])
    assert full.returncode == 0, full.stderr[-2000:]
    killed = run("killed", 2, ["--checkpoint-every", "5"], fault="1:data loading:13")
    assert killed.returncode != 0 and "rank 1" in killed.stderr, killed.stderr[-2000:]
    ckpt = tmp_path / "killed" / "checkpoint.pt"
    assert ckpt.exists()
    want = json.loads((tmp_path / "full" / "summary.json").read_text())["final"]
    for ranks in (2, 3):
        res = run(f"resumed{ranks}", ranks, ["--resume", str(ckpt)])
        assert res.returncode == 0, res.stderr[-2000:]
        assert "resumed" in res.stdout and "epoch 1, batch 10" in res.stdout, res.stdout[-2000:]
        got = json.loads((tmp_path / f"resumed{ranks}" / "summary.json").read_text())["final"]
        for k in ("loss", "train_acc", "test_acc", "test_loss"):
            tol = 0.0 if ranks == 2 else 1e-10  # bitwise on the same P
            assert abs(got[k] - want[k]) <= tol * max(1.0, abs(want[k])), (ranks, k, got, want)
