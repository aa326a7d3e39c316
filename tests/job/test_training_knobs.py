"""The main job's training knobs (issue 23 item 4): --weight-decay, --lr-schedule with
--warmup-epochs, --optimizer sgd|adam|adamw, --device, --tied.

* the schedules' learning rates equal the closed forms (linear warm-up, cosine annealing,
  step decay) at every optimizer step;
* one serial job (``--serial --optimizer adamw --weight-decay --lr-schedule cosine
  --warmup-epochs 1 --tied``, float64) ends with the weights of a plain loop written here with
  ``torch.optim.AdamW`` and torch's own ``LinearLR`` + ``CosineAnnealingLR`` on the same data
  and batches (an independent reference: no Trainer, no job code in the loop), and the rates it
  saved in its checkpoint are the reference's;
* a Trainer run interrupted after its checkpoint and resumed gives the uninterrupted run's rates
  and weights bit for bit (the scheduler state is in the checkpoint);
* bad values fail with one clear line naming the flag.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mgrit.nn import ResidualStep, layer_seed, make_step
from mgrit.training import Trainer
from mgrit.training.lrschedule import LRSchedule, make_scheduler
from tests.job.test_train_job import ROOT, SCRIPT, _load_script, job_env


def _lrs(kind, epochs, batches, warmup=0, step_epochs=1, gamma=0.1, lr=0.3):
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    s = make_scheduler(opt, kind, epochs=epochs, batches=batches, warmup_epochs=warmup,
                       step_epochs=step_epochs, gamma=gamma)
    out = []
    for _ in range(epochs * batches):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if s is not None:
            s.step()
    return out


def _closed_form(kind, epochs, batches, warmup, step_epochs, gamma, lr):
    w, total = warmup * batches, epochs * batches
    out = []
    for t in range(total):
        if t < w:
            out.append(lr * (1 / w + (1 - 1 / w) * t / w))
        elif kind == "cosine":
            out.append(lr * (1 + math.cos(math.pi * (t - w) / (total - w))) / 2)
        elif kind == "step":
            out.append(lr * gamma ** ((t - w) // (step_epochs * batches)))
        else:
            out.append(lr)
    return out


@pytest.mark.parametrize("kind,epochs,batches,warmup,step_epochs", [
    ("cosine", 4, 3, 0, 1), ("cosine", 5, 4, 2, 1), ("step", 5, 3, 0, 2), ("step", 6, 2, 1, 2),
    ("none", 3, 4, 1, 1), ("none", 2, 3, 0, 1)])
def test_schedule_rates_equal_closed_forms(kind, epochs, batches, warmup, step_epochs):
    got = _lrs(kind, epochs, batches, warmup, step_epochs, 0.5)
    want = _closed_form(kind, epochs, batches, warmup, step_epochs, 0.5, 0.3)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.slow
def test_serial_job_equals_plain_adamw_cosine_loop(tmp_path):
    """--serial --optimizer adamw --weight-decay 0.05 --lr-schedule cosine --warmup-epochs 1
    --tied, 2 epochs of 4 batches, float64: final weights (from the job's checkpoint) equal a
    plain loop with torch.optim.AdamW + LinearLR/CosineAnnealingLR to 1e-12; the job's rates
    equal the loop's."""
    seed, N, width, bs, n, epochs = 3, 4, 6, 25, 100, 2
    flags = ["--serial", "--dataset", "digits", "--layers", str(N), "--width", str(width),
             "--epochs", str(epochs), "--limit-train", str(n), "--limit-test", "50",
             "--batch-size", str(bs), "--dtype", "float64", "--seed", str(seed), "--no-progress",
             "--optimizer", "adamw", "--weight-decay", "0.05", "--lr", "0.02",
             "--lr-schedule", "cosine", "--warmup-epochs", "1", "--tied", "--device", "auto",
             "--checkpoint-every", "1000", "--out", str(tmp_path / "run")]
    res = subprocess.run([sys.executable, str(SCRIPT)] + flags, cwd=ROOT, env=job_env(),
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["optimizer"] == "adamw" and config["tied"] is True
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)

    # the reference: independent construction and loop
    torch.set_default_dtype(torch.float64)
    try:
        from tests.mpi_cases.training.trainer_ref_cases import _data, _ends
        x, y, _, _ = _data(seed, n, 50, torch.float64)
        opening, closing = _ends(seed, width)
        torch.manual_seed(layer_seed(seed, 0))
        shared = make_step("dense", width, "tanh", 3)
        net = nn.Sequential(opening, *[ResidualStep(shared, 1.0 / N) for _ in range(N)], closing)
        opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.05)
        nb = n // bs
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, 1 / nb, 1.0, total_iters=nb),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=(epochs - 1) * nb)],
            milestones=[nb])
        rates = []
        for epoch in range(epochs):
            perm = np.random.default_rng([seed, epoch]).permutation(n)
            for s in range(0, n, bs):
                j = torch.as_tensor(perm[s:s + bs])
                rates.append(opt.param_groups[0]["lr"])
                opt.zero_grad()
                F.cross_entropy(net(x[j]), y[j]).backward()
                opt.step()
                sched.step()
    finally:
        torch.set_default_dtype(torch.float32)
    want = net.state_dict()
    assert set(ckpt["model"]) == set(want)
    for k, v in want.items():
        err = (ckpt["model"][k] - v).abs().max().item()
        assert err <= 1e-12 * max(1.0, v.abs().max().item()), (k, err)
    assert ckpt["model"]["1.F.linear.weight"].data_ptr() == \
        ckpt["model"][f"{N}.F.linear.weight"].data_ptr(), "tied weights saved twice"
    saved = ckpt["ranks"][0]["extra"]["callbacks"]
    history = next(v["history"] for k, v in saved.items() if k.endswith("LRSchedule"))
    assert history == pytest.approx(rates, rel=1e-15), (history, rates)
    assert len(set(rates)) == len(rates)  # the schedule really moved the rate every step


class _Stop(Exception):
    pass


class _StopAt:
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, rec):
        if trainer.steps_done == self.step:
            raise _Stop()


def _tiny_fit(tmp_path, callbacks, resume=None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    sch = LRSchedule("step", warmup_epochs=1, step_epochs=1, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(40, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 2, (40,), generator=g))
    tr = Trainer(net, opt, callbacks=[sch, *callbacks], checkpoint=tmp_path / "c.pt",
                 checkpoint_every=3)
    tr.fit(data, epochs=4, batch_size=10, seed=2, resume=resume)
    return net, sch


@pytest.mark.slow
def test_resume_continues_the_schedule_exactly(tmp_path):
    """Interrupted at step 8 (checkpoint at step 6), resumed: the rates of all 16 steps and
    the final weights equal the uninterrupted run's bit for bit."""
    full, s_full = _tiny_fit(tmp_path / "a", [])
    with pytest.raises(_Stop):
        _tiny_fit(tmp_path / "b", [_StopAt(8)])
    resumed, s_res = _tiny_fit(tmp_path / "b", [], resume=tmp_path / "b" / "c.pt")
    assert s_res.lrs == s_full.lrs and len(s_full.lrs) == 16
    assert len(set(s_full.lrs)) > 3
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("args, message", [
    (["--weight-decay", "-1"], "--weight-decay=-1.0 is not allowed"),
    (["--lr-schedule", "linear"], "--lr-schedule"),
    (["--warmup-epochs", "2", "--epochs", "2", "--lr-schedule", "cosine"],
     "--warmup-epochs=2 leaves no epoch"),
    (["--lr-step-epochs", "0"], "--lr-step-epochs=0 is not allowed"),
    (["--lr-gamma", "1.5"], "--lr-gamma=1.5 is not allowed"),
    (["--optimizer", "rmsprop"], "--optimizer"),
    (["--device", "tpu"], "--device"),
    (["--tied", "--model", "vit"], "--tied is the weight-tied --model resnet"),
    (["--method", "sequential", "--optimizer", "adamw"], "--optimizer adamw is not available"),
    (["--method", "decoupled", "--lr-schedule", "cosine"], "--lr-schedule/--warmup-epochs is not"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no CUDA device")]))
def test_bad_knobs_fail_clearly(args, message, capsys):
    parser = _load_script().build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_config(args, 1)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
