"""End-to-end tests of the main job ``experiments/train.py`` (tiny settings: digits, a few
residual layers, 1-2 epochs, a few hundred samples): run directories, equality with plain-loop
references written in ``tests/mpi_cases/training/trainer_ref_cases.py`` (bit for bit), every sample
used with replicas, kill and resume.

Launching python + torch costs seconds per rank, so the jobs are started a few at a time in a
module-scoped fixture (``subprocess.Popen``) and the tests only inspect the results.
"""
from __future__ import annotations

import importlib.util
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

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "train.py"
TINY = ["--dataset", "digits", "--layers", "4", "--epochs", "1", "--limit-train", "200",
        "--limit-test", "100", "--batch-size", "50", "--no-progress"]
# the settings of tests/mpi_cases/training/trainer_ref_cases.py (2 epochs, a partial last batch)
REF = ["--dataset", "digits", "--layers", "8", "--width", "8", "--levels", "2", "--cfactor", "2",
       "--epochs", "2", "--limit-train", "200", "--limit-test", "100", "--batch-size", "48",
       "--seed", "1", "--no-progress"]
# 101 samples in batches of 50: the last batch has 1 sample for 2 replicas (issue 13 item 5)
LAST1 = ["--serial", "--dataset", "digits", "--layers", "4", "--width", "8", "--epochs", "2",
         "--limit-train", "101", "--limit-test", "60", "--batch-size", "50", "--dtype",
         "float64", "--no-progress", "--clip-grad-norm", "0.5"]  # (clipped alike on replicas)
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None  # optional extra
JOBS = {  # name: (ranks, flags)
    "mgrit1": (1, TINY + (["--tensorboard"] if HAS_TENSORBOARD else [])),
    "mgrit2": (2, REF + ["--method", "mgrit"]),
    "serial2": (2, REF + ["--serial"]),
    "sequential1": (1, TINY + ["--method", "sequential", "--layers", "2"]),
    "decoupled2": (2, REF + ["--method", "decoupled"]),
    "last1-dp2": (2, LAST1 + ["--dp", "2"]),
    "last1-dp1": (1, LAST1),
}
TIMEOUT = 420  # generous: a loaded 2-core machine stretches start-up many times
PARALLEL = 3
R = "tests.mpi_cases.training.trainer_ref_cases"
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
    for f in ("metrics.h5", "summary.json", "curves.png", "console.log", "metrics.csv",
              "steps.csv"):
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
    (["--clip-grad-norm", "-1"], 1, "--clip-grad-norm=-1.0 is not allowed"),
    (["--clip-grad-norm", "1", "--method", "decoupled"], 1, "--clip-grad-norm needs --method"),
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


# -- the run folder (issue 25 item 3): the jobs above, plus one interrupted job ---------------
def _csv(path):
    import csv
    with open(path) as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("name, solve", [("mgrit2", "inexact MGRIT forward (2 cycle(s)"),
                                         ("serial2", "serial forward (exact)")])
def test_run_folder_logs_steps_epochs_and_the_solve(jobs, name, solve):
    """console.log holds the console; steps.csv / metrics.h5 'steps' one row per optimizer
    step whose sample-weighted mean is the epoch's loss (dp = 1 for mgrit2: the step loss is
    the whole batch's); metrics.csv has epoch 0 (before training) and every epoch; the
    console and summary.json say which forward produced the test metrics."""
    out, rc, so, se = jobs[name]
    s = _check_run(jobs[name])
    assert f"(test metrics from the {solve}" in so and s["test_metrics_from"].startswith(solve)
    log = (out / "console.log").read_text()
    assert "[train] done in" in log and "epoch 2/2 loss" in log, log[-2000:]
    steps = _csv(out / "steps.csv")
    assert len(steps) == s["steps"] == 10  # 200 samples in batches of 48: 5 per epoch
    with h5py.File(out / "metrics.h5", "r") as f:
        assert [float(v) for v in f["steps"]["loss"]] == [float(r["loss"]) for r in steps]
        assert f.attrs["initial_test_acc"] == s["final"]["initial_test_acc"]
    if name == "mgrit2":  # dp = 1: steps are whole batches (48, 48, 48, 48, 8 samples)
        sizes = [48, 48, 48, 48, 8]
        for e in range(2):
            rows = steps[5 * e:5 * e + 5]
            assert [float(r["epoch"]) for r in rows] == [e + (b + 1) / 5 for b in range(5)]
            mean = sum(float(r["loss"]) * n for r, n in zip(rows, sizes)) / 200
            assert abs(mean - s["epochs"]["loss"][e]) <= 1e-6, (mean, s["epochs"]["loss"])
    rows = _csv(out / "metrics.csv")
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert float(rows[0]["test_acc"]) == s["final"]["initial_test_acc"] and rows[0]["loss"] == ""
    assert float(rows[2]["test_loss"]) == s["final"]["test_loss"]


def test_load_run_gives_the_trained_network(jobs):
    """load_run turns a run folder into a plain nn.Sequential: for the layer-parallel run
    (mgrit2, 2 ranks) its output equals the LayerParallelNet built from the run's config.json
    with the same model.pt, solved with MGRIT to a tolerance (1 rank); for the serial run its
    test loss and accuracy are the ones summary.json reports."""
    import torch
    from mpi4py import MPI
    from torch import nn
    from torch.nn import functional as F

    from mgrit.training.checkpoint import load_checkpoint
    from layerpar.export import load_run, main as export_main
    from layerpar.job import _load
    from layerpar.jobconfig import JobConfig, read_config
    from mgrit.models import build_model

    out = jobs["mgrit2"][0]
    _check_run(jobs["mgrit2"])
    cfg = JobConfig.from_json(out / "config.json")  # argv and the run's facts beside settings
    assert cfg.out == str(out) and cfg.layers == 8 and cfg.method == "mgrit"
    facts = read_config(out)
    model = load_run(out)
    assert isinstance(model, nn.Sequential) and not model.training
    (_, _), (xte, yte), _ = _load(cfg, torch.float32)
    exact = JobConfig.from_dict({**facts, "tol": 1e-6, "fwd_iters": 50})
    lp = build_model("resnet", exact, facts["input_shape"], facts["num_classes"],
                     comm=MPI.COMM_SELF).to(torch.float32)  # the run's dtype, whatever the default
    load_checkpoint(str(out / "model.pt"), lp, None, restore_warm=False, restore_options=False)
    with torch.no_grad():
        want, got = lp.eval()(xte), model(xte)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    out = jobs["serial2"][0]
    s = _check_run(jobs["serial2"])
    with torch.no_grad():
        logits = load_run(out)(xte)
    assert abs(F.cross_entropy(logits, yte).item() - s["final"]["test_loss"]) <= 1e-5
    assert (logits.argmax(1) == yte).sum().item() / len(yte) == s["final"]["test_acc"]
    saved = out.parent / "serial2-export.pt"
    assert export_main([str(out), str(saved)]) == 0
    again = torch.jit.load(saved)  # TorchScript: PyTorch alone (tests/job/test_export.py)
    with torch.no_grad():
        assert torch.equal(again(xte), logits)


def test_out_must_be_new_unless_overwrite_or_resume(tmp_path, capsys):
    """An existing non-empty --out is refused (one line, before any communication);
    --overwrite deletes only the run's own files; --overwrite with --resume is refused."""
    from layerpar.runfolder import clear_run_dir

    run = tmp_path / "run"
    run.mkdir()
    parser = _load_script().build_parser()
    parser.parse_config(TINY + ["--out", str(run)], 1)  # empty: fine
    for f in ("config.json", "summary.json", "checkpoint.pt", "error-rank-1.log", "notes.txt"):
        (run / f).write_text("x")
    for extra, message in ((["--out", str(run)], f"--out={str(run)!r} exists and is not empty "
                            "(5 entries: checkpoint.pt, config.json, error-rank-1.log, "
                            "notes.txt, ...): choose a new run folder, or pass --overwrite"),
                           (["--out", str(run), "--overwrite", "--resume",
                             str(run / "checkpoint.pt")], "pass one of them")):
        with pytest.raises(SystemExit) as e:
            parser.parse_config(TINY + extra, 1)
        assert e.value.code == 2 and message in capsys.readouterr().err
    parser.parse_config(TINY + ["--out", str(run), "--overwrite"], 1)
    parser.parse_config(TINY + ["--out", str(run), "--resume", str(run / "checkpoint.pt")], 1)
    assert clear_run_dir(run) == ["checkpoint.pt", "config.json", "error-rank-1.log",
                                  "summary.json"]
    assert os.listdir(run) == ["notes.txt"]
    import importlib.util
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(SystemExit):
            parser.parse_config(TINY + ["--tensorboard"], 1)
        assert "pip install 'layerpar[tensorboard]'" in capsys.readouterr().err


@pytest.mark.parametrize("sig,status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_reports_where_and_how_to_resume(tmp_path, sig, status):
    """SIGINT (Ctrl-C) or SIGTERM (a scheduler's time limit) to a 1-rank job in training: one
    line with the epoch and batch, the last checkpoint and the resume command; summary.json
    so far; exit status 130 / 143."""
    import signal

    out = tmp_path / "run"
    flags = ["--dataset", "digits", "--layers", "4", "--epochs", "500", "--limit-train", "200",
             "--limit-test", "50", "--batch-size", "20", "--checkpoint-every", "3",
             "--no-progress", "--out", str(out)]
    p = subprocess.Popen(_cmd(1, flags), cwd=ROOT, env=job_env(PYTHONUNBUFFERED="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:  # in training once the first epoch has finished
            if line.startswith("epoch 1/500"):
                break
        p.send_signal(getattr(signal, sig))
        so, se = p.communicate(timeout=TIMEOUT)
    finally:
        p.kill()
    lines = [ln for ln in se.splitlines() if ln.startswith("[train] interrupted at epoch ")]
    assert p.returncode == status and len(lines) == 1, (p.returncode, se[-3000:])
    assert (sig == "SIGTERM") == ("[train] SIGTERM" in se), se[-3000:]
    assert "/500, batch " in lines[0] and f"last checkpoint {out / 'checkpoint.pt'}" in lines[0]
    assert f"--resume {out / 'checkpoint.pt'}`" in lines[0], lines[0]
    assert "KeyboardInterrupt" not in se and "Traceback" not in se, se[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["interrupted"] == lines[0][len("[train] "):]
    assert len(s["epochs"]["loss"]) >= 1 and s["final"]["loss"] == s["epochs"]["loss"][-1]
    assert lines[0] in (out / "console.log").read_text()


def _interrupt_trial(out: Path, delay: float):
    """A 2-rank job interrupted as a terminal's Ctrl-C does (SIGINT to ``mpiexec``, which
    forwards it to each rank), ``delay`` s into its second epoch; a checkpoint every step, so
    the signal often lands in a write. Returns ``(status, stderr)``."""
    import signal
    import time

    flags = ["--dataset", "digits", "--layers", "4", "--epochs", "500", "--limit-train", "200",
             "--limit-test", "50", "--batch-size", "20", "--checkpoint-every", "1",
             "--no-progress", "--out", str(out)]
    p = subprocess.Popen(_cmd(2, flags), cwd=ROOT, env=job_env(PYTHONUNBUFFERED="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        for line in p.stdout:
            if line.startswith("epoch 1/500"):
                break
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, se = p.communicate(timeout=TIMEOUT)
    finally:
        p.kill()
    return p.returncode, se


def test_ctrl_c_on_two_ranks_reports_every_time(tmp_path):
    """Issue 40 item 6: Ctrl-C at varied moments of a 2-rank job (a rank inside an MPI call, a
    checkpoint write): every time one interrupted line with the resume command, summary.json,
    status 130, a loadable last checkpoint, and no CheckpointError or traceback."""
    from mgrit.training.checkpoint.io import read_file

    delays = [0.0, 0.17, 0.43]
    with ThreadPoolExecutor(len(delays)) as ex:
        results = list(ex.map(lambda a: _interrupt_trial(tmp_path / f"r{a[0]}", a[1]),
                              enumerate(delays)))
    for i, (code, se) in enumerate(results):
        out = tmp_path / f"r{i}"
        lines = [ln for ln in se.splitlines() if ln.startswith("[train] interrupted at epoch ")]
        assert code == 130 and len(lines) == 1, (delays[i], code, se[-3000:])
        assert f"--resume {out / 'checkpoint.pt'}`" in lines[0] and "mpiexec -n 2" in lines[0]
        assert "Traceback" not in se and "CheckpointError" not in se, se[-3000:]
        s = json.loads((out / "summary.json").read_text())
        assert s["interrupted"] == lines[0][len("[train] "):]
        ck, err = read_file(str(out / "checkpoint.pt"))
        assert err is None, err
        e, b = ck["extra"]["position"]
        assert "(after " in lines[0] or "(end of epoch" in lines[0]
        assert (f"(after {b} batch(es) of epoch {e + 1})" if b else f"(end of epoch {e})") \
            in lines[0], (ck["extra"]["position"], lines[0])


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="the optional extra 'tensorboard' is missing")
def test_tensorboard_logs_the_same_numbers(jobs):
    """--tensorboard (mgrit1): the per-step loss equals steps.csv's (float32 events), the test
    accuracy starts at step 0 with the accuracy before training."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = jobs["mgrit1"][0]
    s = _check_run(jobs["mgrit1"])
    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    steps = _csv(out / "steps.csv")
    got = [(e.step, e.value) for e in ea.Scalars("train/loss_step")]
    assert [g[0] for g in got] == [int(r["step"]) + 1 for r in steps]
    assert all(abs(v - float(r["loss"])) <= 1e-6 * abs(v) for (_, v), r in zip(got, steps))
    acc = [(e.step, e.value) for e in ea.Scalars("test/accuracy")]
    assert acc[0][0] == 0 and abs(acc[0][1] - s["final"]["initial_test_acc"]) <= 1e-6
    assert abs(acc[-1][1] - s["final"]["test_acc"]) <= 1e-6
