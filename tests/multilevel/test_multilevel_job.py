"""``--multilevel-init`` in the main job (mgrit.multilevel.initialization): coarse-to-fine
training in depth (Cyr, Guenther & Schroder 2019).

Reference: the schedule written as a plain loop in this file -- the job's documented serial
network (opening seeded with ``seed``, closing with ``seed + 7919``, layer ``k`` with
``layer_seed(seed, k)``, ``h = T/N``), SGD with momentum over the documented batch schedule,
then the fine network built by copying coarse layer ``k // 2`` into fine layers ``k``
(constant prolongation) or by the piecewise-linear formula, opening and closing copied, a fresh
SGD -- without the job's, the Trainer's or mgrit.nn.depth's code. Jobs (subprocesses, tiny,
float64): the serial schedule against the reference epoch by epoch; the same schedule
layer-parallel on 2 ranks in exact mode and on 2 data-parallel replicas;
``--multilevel-init 1`` against plain training; a job killed at the prolongation and again
inside the fine level, resumed twice, against the uninterrupted job.
"""
from __future__ import annotations

import json
import os
import subprocess

import h5py
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from data import load_dataset
from mgrit.nn import ResidualStep, layer_seed, make_step
from mgrit.multilevel.initialization import LevelHistory, depth_schedule, epoch_schedule
from mgrit.training.records import HISTORY_KEYS
from tests.job.test_train_job import ROOT, TIMEOUT, _cmd, _load_script, job_env, run_jobs

BASE = ["--dataset", "digits", "--layers", "4", "--width", "6", "--limit-train", "150",
        "--limit-test", "80", "--batch-size", "40", "--dtype", "float64", "--seed", "2",
        "--no-progress", "--levels", "2", "--cfactor", "2"]
ML = BASE + ["--multilevel-init", "2", "--init-epochs", "2", "--epochs", "2"]
JOBS = {
    "serial": (1, ML + ["--serial", "--checkpoint-every", "2"]),
    "linear": (1, ML + ["--serial", "--prolong", "linear"]),
    "mgrit2": (2, ML + ["--tol", "1e-12"]),
    "serial_dp2": (2, ML + ["--serial", "--dp", "2"]),
    "one_level": (1, BASE + ["--serial", "--multilevel-init", "1", "--epochs", "2"]),
    "plain": (1, BASE + ["--serial", "--epochs", "2"]),
}
KEYS = ("loss", "train_acc", "test_acc", "test_loss")


# -- unit ------------------------------------------------------------------------------------
def test_schedules():
    assert depth_schedule(32, 3) == [8, 16, 32]
    assert depth_schedule(6, 1) == [6]
    with pytest.raises(ValueError, match="allows --multilevel-init 2 at most"):
        depth_schedule(6, 3)
    assert epoch_schedule("2", 3, 5) == [2, 2, 5]
    assert epoch_schedule("3,1", 4, 5) == [3, 1, 1, 5]
    assert epoch_schedule(2, 1, 4) == [4]
    for bad in ("0", "a", "1,2,3"):
        with pytest.raises(ValueError, match="--init-epochs"):
            epoch_schedule(bad, 3, 2)


def test_level_history_joins_levels_and_keeps_state():
    lv = LevelHistory([2, 4], [1, 2])
    lv.begin(0)
    row = lambda e, t: {k: [None] * e for k in HISTORY_KEYS} | {  # noqa: E731
        "epoch": list(range(1, e + 1)), "epoch_time": [t] * e, "test_acc": [0.5] * e}
    lv.cpu = [0.25]
    lv.finish(row(1, 1.0), 0.1)
    lv.begin(1, prolong_s=0.5)
    lv.cpu = [0.5, 0.5]
    out = lv.combined(row(2, 2.0))
    assert out["epoch"] == [1, 2, 3] and out["depth"] == [2, 4, 4] and out["level"] == [0, 1, 1]
    assert out["train_time"] == [1.0, 3.5, 5.5]
    assert out["train_cpu_time"] == [0.25, 0.75, 1.25]
    other = LevelHistory([2, 4], [1, 2])
    other.load_state_dict(lv.state_dict())
    assert other.combined(row(2, 2.0)) == out


@pytest.mark.parametrize("args, world, message", [
    (["--multilevel-init", "3", "--layers", "6"], 1, "allows --multilevel-init 2 at most"),
    (["--multilevel-init", "3", "--layers", "8"], 4, "starts at 2 layers, fewer than the 4"),
    (["--multilevel-init", "2", "--method", "decoupled"], 2, "refines residual networks"),
    (["--multilevel-init", "2", "--init-epochs", "0"], 1, "--init-epochs='0'"),
    (["--multilevel-init", "2", "--prolong", "cubic"], 1, "invalid choice"),
    (["--multilevel-init", "-1"], 1, "--multilevel-init=-1"),
])
def test_bad_schedule_flags_fail_clearly(args, world, message, capsys):
    parser = _load_script().build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_config(args, world)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# -- reference -------------------------------------------------------------------------------
def _reference(prolong: str, seed=2, width=6, depths=(2, 4), epochs=(2, 2), n=150, n_test=80,
               batch=40, lr=0.01, momentum=0.9):
    """Per-epoch [loss, train_acc, test_acc, test_loss] of the schedule as a plain loop."""
    train, test = load_dataset("digits", seed=seed, test_fraction=0.2, normalize=True,
                               flatten=False)
    f64 = torch.float64
    x, y = torch.as_tensor(train.x[:n], dtype=f64), torch.as_tensor(train.y[:n])
    tx, ty = torch.as_tensor(test.x[:n_test], dtype=f64), torch.as_tensor(test.y[:n_test])
    torch.manual_seed(seed)
    opening = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Tanh())
    torch.manual_seed(seed + 7919)
    closing = nn.Sequential(nn.Flatten(), nn.Linear(width, 10))
    steps = []
    for k in range(depths[0]):
        torch.manual_seed(layer_seed(seed, k))
        steps.append(make_step("dense", width, "tanh", 3))
    history = []
    for level, (N, E) in enumerate(zip(depths, epochs)):
        if level:
            old, steps = steps, []
            f = N // len(old)
            for k in range(N):
                j, i = divmod(k, f)
                s = make_step("dense", width, "tanh", 3)
                nxt = old[min(j + 1, len(old) - 1)]  # the last interval: constant
                with torch.no_grad():
                    for p, a, b in zip(s.parameters(), old[j].parameters(), nxt.parameters()):
                        p.copy_(a if prolong == "constant" else (f - i) / f * a + i / f * b)
                steps.append(s)
        net = nn.Sequential(opening, *[ResidualStep(s, 1.0 / N) for s in steps], closing)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        for epoch in range(E):
            perm = np.random.default_rng([seed, epoch]).permutation(len(y))
            tot = np.zeros(3)
            for s0 in range(0, len(y), batch):
                j = torch.as_tensor(perm[s0:s0 + batch])
                opt.zero_grad(set_to_none=True)
                out = net(x[j])
                loss = F.cross_entropy(out, y[j])
                loss.backward()
                opt.step()
                tot += [loss.item() * len(j), (out.argmax(1) == y[j]).sum().item(), len(j)]
            with torch.no_grad():
                out = net(tx)
                test_loss = F.cross_entropy(out, ty, reduction="sum").item() / len(ty)
                test_acc = (out.argmax(1) == ty).double().mean().item()
            history.append([tot[0] / tot[2], tot[1] / tot[2], test_acc, test_loss])
    return np.array(history)


# -- jobs ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return run_jobs(JOBS, tmp_path_factory.mktemp("multilevel_job"))


def _ok(result):
    out, rc, so, se = result
    assert rc == 0, f"exit {rc}\n--- stdout\n{so[-3000:]}\n--- stderr\n{se[-3000:]}"
    return out, json.loads((out / "summary.json").read_text())


def _metrics(out) -> dict:
    with h5py.File(out / "metrics.h5", "r") as h:
        return {k: np.asarray(h[k]) for k in h}


@pytest.fixture()
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.slow
@pytest.mark.parametrize("name, prolong", [("serial", "constant"), ("linear", "linear")])
def test_serial_schedule_equals_plain_loop_reference(jobs, name, prolong, float64):
    """Depths 2 -> 4, 2 + 2 epochs, float64: every epoch's loss, accuracies and test loss
    equal the plain-loop reference to 1e-12 (relative); one history with the depth per epoch."""
    out, s = _ok(jobs[name])
    m = _metrics(out)
    ref = _reference(prolong)
    got = np.stack([m[k] for k in KEYS], axis=1)
    assert np.allclose(got, ref, rtol=1e-12, atol=1e-14), (got, ref)
    assert list(m["depth"]) == [2, 2, 4, 4] and list(m["level"]) == [0, 0, 1, 1]
    assert list(m["epoch"]) == [1, 2, 3, 4]
    assert np.all(np.diff(m["train_time"]) > 0) and np.all(m["cpu_time"] > 0)
    assert [lv["depth"] for lv in s["levels"]] == [2, 4]
    assert s["schedule"] == {"depths": [2, 4], "epochs": [2, 2], "prolong": prolong,
                             "factor": 2}
    # the prolonged network starts where the coarse one ended (test accuracy to O(h))
    assert abs(s["levels"][1]["initial_test_acc"] - s["levels"][0]["final_test_acc"]) <= 0.1


@pytest.mark.slow
def test_layer_parallel_schedule_equals_serial(jobs):
    """The same schedule with --method mgrit on 2 layer ranks, exact mode (tol 1e-12): the
    coarse level has one layer per rank, the prolongation moves layers between ranks; the
    history equals the serial job's to 1e-9."""
    _, s = _ok(jobs["mgrit2"])
    want, got = _metrics(jobs["serial"][0]), _metrics(jobs["mgrit2"][0])
    for k in KEYS:
        assert np.allclose(got[k], want[k], rtol=1e-9, atol=1e-12), (k, got[k], want[k])
    assert s["P_L"] == 2 and list(got["depth"]) == [2, 2, 4, 4]


@pytest.mark.slow
def test_schedule_with_replicas_equals_serial(jobs):
    """The serial schedule on 2 data-parallel replicas: the 1-rank history to 1e-10."""
    _, s = _ok(jobs["serial_dp2"])
    want, got = _metrics(jobs["serial"][0]), _metrics(jobs["serial_dp2"][0])
    for k in KEYS:
        assert np.allclose(got[k], want[k], rtol=1e-10, atol=1e-13), (k, got[k], want[k])
    assert s["dp"] == 2


@pytest.mark.slow
def test_one_level_equals_plain_training(jobs):
    """--multilevel-init 1 is ordinary training at depth N through the schedule's code."""
    a, b = _metrics(_ok(jobs["one_level"])[0]), _metrics(_ok(jobs["plain"])[0])
    for k in KEYS:
        assert np.array_equal(a[k], b[k]), k
    assert list(a["depth"]) == [4, 4]


@pytest.mark.slow
def test_killed_schedule_resumes_to_the_uninterrupted_result(jobs, tmp_path):
    """Killed on entering the prolongation (its checkpoint: the end of the coarse level),
    resumed and killed again inside the fine level (after the checkpoint of its 2nd step),
    resumed again: the final history equals the uninterrupted job's bit for bit."""
    want = _metrics(_ok(jobs["serial"])[0])
    flags = JOBS["serial"][1]

    def run(name, extra, fault=None):
        env = job_env(**({"LAYERPAR_INJECT_FAULT": fault} if fault else {}))
        return subprocess.run(_cmd(1, flags + extra + ["--out", str(tmp_path / name)]),
                              cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)

    first = run("first", [], fault="0:prolongation in depth:1")
    assert first.returncode != 0 and "prolongation in depth" in first.stderr, first.stderr[-2000:]
    ckpt1 = tmp_path / "first" / "checkpoint.pt"
    # entries of 'data loading': 1 = the data set, then one per step
    second = run("second", ["--resume", str(ckpt1)], fault="0:data loading:4")
    assert second.returncode != 0, second.stderr[-2000:]
    assert "multilevel level 1/2" in second.stdout and "level 2/2" in second.stdout
    ckpt2 = tmp_path / "second" / "checkpoint.pt"
    third = run("third", ["--resume", str(ckpt2)])
    assert third.returncode == 0, third.stderr[-2000:]
    assert "multilevel level 2/2" in third.stdout and "level 1/2" not in third.stdout
    got = _metrics(tmp_path / "third")
    for k in (*KEYS, "depth", "level", "epoch"):
        assert np.array_equal(got[k], want[k]), (k, got[k], want[k])
    bad = run("bad", ["--resume", str(ckpt2), "--init-epochs", "1"])
    assert bad.returncode != 0 and "belongs to the schedule" in bad.stderr, bad.stderr[-2000:]
    assert os.path.exists(ckpt2)
