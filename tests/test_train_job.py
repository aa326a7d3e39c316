"""End-to-end smoke tests of the main job ``experiments/train.py`` (tiny settings: digits,
4 residual layers, 1 epoch, a few hundred samples).

Launching python + torch costs seconds per rank, so every job is started at once in a
module-scoped fixture (``subprocess.Popen``) and the tests only inspect the results.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi_harness import mpiexec_path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "experiments" / "train.py"
TINY = ["--dataset", "digits", "--layers", "4", "--epochs", "1", "--limit-train", "200",
        "--limit-test", "100", "--batch-size", "50", "--no-progress"]
JOBS = {  # name: (ranks, extra flags)
    "mgrit1": (1, []),
    "mgrit2": (2, []),
    "serial2": (2, ["--serial"]),
    "sequential1": (1, ["--method", "sequential", "--layers", "2"]),
    "decoupled2": (2, ["--method", "decoupled"]),
}
TIMEOUT = 420  # generous: a loaded 2-core machine stretches start-up many times


def _cmd(ranks: int, args: list) -> list:
    py = [sys.executable, "-m", "mpi4py", str(SCRIPT)]
    return py + args if ranks == 1 else [mpiexec_path(), "-n", str(ranks)] + py + args


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    base = tmp_path_factory.mktemp("train_job")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = {}
    for name, (ranks, extra) in JOBS.items():
        out = base / name
        procs[name] = (out, subprocess.Popen(_cmd(ranks, TINY + extra + ["--out", str(out)]),
                                             cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True))
    results = {}
    for name, (out, p) in procs.items():
        try:
            so, se = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        results[name] = (out, p.returncode, so, se)
    return results


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


def test_mgrit_matches_serial_when_exact(jobs):
    """4 layers with cfactor 4 leave one MGRIT level (a direct serial solve), so MGRIT on 2
    layer ranks must reproduce the serial reference (2 data-parallel replicas, same global
    batches) up to rounding."""
    a = _check_run(jobs["mgrit2"])["final"]
    b = _check_run(jobs["serial2"])["final"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert a["test_acc"] == pytest.approx(b["test_acc"], abs=0.011)


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
])
def test_bad_flags_fail_clearly(args, world, message, capsys):
    """Validation runs before any communication (in-process here; the job exits with
    argparse's status 2 and the message on stderr on every rank)."""
    mod = _load_script()
    parser = mod.build_parser()
    with pytest.raises(SystemExit) as e:
        mod.validate(parser, parser.parse_args(args), world)
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
