"""Rank-side checks of the main job's staged ResNet, ViT and character-level GPT
(``mgrit.models.transformer``), run by ``tests/models/test_models_transformer.py`` on 2 ranks.

* exact mode (float64, MGRIT to 1e-13): the layer-parallel network from the job's builder
  against its serial form from the same builder -- output, loss, every parameter gradient by
  global name (reference: serial PyTorch autograd), layer counts odd (not divisible by 2);
* tiny end-to-end jobs (``run_job``) per model: run directory contents, and for the language
  model bits per character = validation loss / ln 2, a greedy sample, checkpoint/resume equal to
  an uninterrupted run, and ``--dp 2`` equal to one replica (float64);
* bad input: the same clear ValueError on every rank before any message.
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import LayerParallelNet, LayerParallelResNet
from mgrit.options import MGRITOptions
from layerpar.jobconfig import JobConfig
from layerpar.job import run_job
from mgrit.models.lm import lm_loss
from mgrit.models import build_model

COMM = MPI.COMM_WORLD
DT = torch.float64
EXACT = dict(tol=1e-13, levels=2, cfactor=2, fwd_iters=60, bwd_iters=60)
#: name -> (config, one sample's shape, classes / vocabulary)
SMALL = {
    "staged-resnet": (dict(dataset="digits", step="conv", layers=3, channels=2), (1, 8, 8), 10),
    "vit": (dict(dataset="digits", layers=5, d_model=8, heads=2, patch=4, T=5.0), (1, 8, 8), 10),
    "gpt": (dict(dataset="pydoc-topics", layers=5, d_model=8, heads=2, context=6,
                 buffer_layers=1, T=5.0), (6,), 13),
}


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _input(name, shape, classes, n=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        x = torch.randint(0, classes, (n, *shape), generator=g)
        return x, torch.randint(0, classes, (n, *shape), generator=g)
    return torch.randn(n, *shape, generator=g, dtype=DT), torch.randint(0, classes, (n,),
                                                                         generator=g)


def check_builder_exact(model, tol=1e-10):
    """The job's layer-parallel ``model`` vs its serial form (same builder, same seed): output,
    loss, every parameter gradient by global key, relative error <= ``tol``."""
    torch.set_default_dtype(DT)
    kw, shape, classes = SMALL[model]
    c = JobConfig(model=model, dtype="float64", **kw, **EXACT).validated(COMM.Get_size())
    x, y = _input(model, shape, classes)
    loss_fn = lm_loss if model == "gpt" else F.cross_entropy
    ser = build_model(model, c, shape, classes)
    ref = ser(x)
    loss_ref = loss_fn(ref, y)
    loss_ref.backward()
    net = build_model(model, c, shape, classes, comm=COMM)
    assert isinstance(net, LayerParallelNet) and len(net.segments) == (3 if model ==
                                                                        "staged-resnet" else 1)
    out = net(x)
    loss = net.loss(out, y, loss_fn)
    loss.backward()
    worst = 0.0
    if net.is_last:
        e, e2 = _rel(out, ref), abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
        assert e <= tol and e2 <= tol, f"{model}: output rel err {e}, loss rel err {e2}"
        worst = max(e, e2)
    grads = dict(ser.named_parameters())
    n = 0
    for key, p in net.named_global_parameters():
        assert p.grad is not None, f"{model} {key}: no gradient"
        e = _rel(p.grad, grads[key].grad)
        assert e <= tol, f"{model} {key}: gradient rel err {e}"
        worst, n = max(worst, e), n + 1
    n = COMM.allreduce(n)
    assert n == len(grads), f"{model}: {n} parameters on the ranks, serial has {len(grads)}"
    return COMM.allreduce(worst, op=MPI.MAX), n


def _job(name, world=None, comm=COMM, **kw):
    """run_job on ``comm``; returns (final, summary dict, run dir) on every rank."""
    torch.set_default_dtype(DT if kw.get("dtype") == "float64" else torch.float32)
    base, shape, classes = SMALL[name]
    cfg = dict(base, model=name, epochs=1, batch_size=8, limit_train=40, limit_test=16,
               levels=2, cfactor=2, no_progress=True, seed=2)
    cfg.update(kw)
    c = JobConfig(**cfg).validated(comm.Get_size() if world is None else world)
    final = run_job(c, comm)
    run = Path(c.out)
    summary = json.loads((run / "summary.json").read_text()) if comm.Get_rank() == 0 else None
    return final, comm.bcast(summary, root=0), run


@contextmanager
def _shared_tmp():
    """A temporary folder made by rank 0, its path on every rank; removed afterwards."""
    path = COMM.bcast(tempfile.mkdtemp(prefix="layerpar-models-") if COMM.Get_rank() == 0
                      else None, root=0)
    try:
        yield path
    finally:
        COMM.Barrier()
        if COMM.Get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def _shared_dir(tmp_dir, what) -> str:
    return str(Path(tmp_dir) / what)  # the same path on every rank (tmp_dir is rank 0's)


def check_job(model):
    with _shared_tmp() as tmp_dir:
        return _check_job(model, tmp_dir)


def _check_job(model, tmp_dir):
    """A tiny inexact layer-parallel job per model (vit with nested iteration): finite
    metrics, run directory complete; for gpt: lm.json with bpc = loss / ln 2 per epoch and a
    200-character greedy sample."""
    extra = {"nested_iteration": True} if model == "vit" else {}  # the records' setting
    final, summary, run = _job(model, out=_shared_dir(tmp_dir, f"job-{model}"), epochs=2,
                               **extra)
    assert all(math.isfinite(final[k]) for k in ("loss", "test_loss", "test_acc")), final
    if COMM.Get_rank() == 0:
        for f in ("config.json", "metrics.h5", "summary.json", "curves.png"):
            assert (run / f).is_file(), f"{model}: {f} missing"
        assert summary["config"]["model"] == model and len(summary["epochs"]["loss"]) == 2
    if model == "gpt" and COMM.Get_rank() == 0:
        lm = json.loads((run / "lm.json").read_text())
        for v, b in zip(summary["epochs"]["test_loss"], lm["test_bpc"]):
            assert abs(b - v / math.log(2)) <= 1e-12 * b
        assert len(lm["sample"]) == 200 and lm["sample_prompt"]
        assert summary["lm"]["final_test_bpc"] == lm["final_test_bpc"] and "val_bpc" not in lm
        assert summary["config"]["corpus"]["name"] == "pydoc-topics"
    return final["test_loss"]


def check_gpt_resume_and_dp():
    with _shared_tmp() as tmp_dir:
        return _check_gpt_resume_and_dp(tmp_dir)


def _check_gpt_resume_and_dp(tmp_dir):
    """gpt, float64: (a) 2 inexact layer-parallel epochs straight vs 1 epoch, then resume from
    its checkpoint for the second: identical histories; (b) serial ``--dp 2`` (two replicas)
    vs one replica on one rank: losses and token accuracies equal to 1e-12 (the per-sequence
    loss convention averages to the global per-token mean for any shard sizes)."""
    common = dict(dtype="float64", limit_train=35, batch_size=8)
    straight, s1, _ = _job("gpt", out=_shared_dir(tmp_dir, "straight"), epochs=2,
                           **common)
    first_dir = _shared_dir(tmp_dir, "first")
    _job("gpt", out=first_dir, epochs=1, checkpoint_every=2, **common)
    resumed, s2, _ = _job("gpt", out=_shared_dir(tmp_dir, "resumed"), epochs=2,
                          resume=str(Path(first_dir) / "checkpoint.pt"), **common)
    for k in ("loss", "train_acc", "test_loss", "test_acc"):
        assert s1["epochs"][k] == s2["epochs"][k], (k, s1["epochs"][k], s2["epochs"][k])
    _, dp2, _ = _job("gpt", out=_shared_dir(tmp_dir, "dp2"), serial=True, dp=2,
                     epochs=2, **common)
    worst = 0.0
    if COMM.Get_rank() == 0:  # the one-replica reference on this rank alone
        _, dp1, _ = _job("gpt", comm=MPI.COMM_SELF, out=str(Path(tmp_dir) / "dp1"),
                         serial=True, epochs=2, **common)
        for k in ("loss", "train_acc", "test_loss", "test_acc"):
            a, b = np.array(dp2["epochs"][k]), np.array(dp1["epochs"][k])
            e = float(np.max(np.abs(a - b) / np.abs(b)))
            assert e <= 1e-12, (k, a, b)
            worst = max(worst, e)
    return COMM.bcast(worst, root=0)


def _agreed_error(fn) -> str:
    """Run ``fn`` on every rank; it must raise ValueError everywhere, with the same message."""
    try:
        fn()
    except ValueError as exc:
        msg = str(exc)
    else:
        raise AssertionError("no ValueError")
    msgs = COMM.allgather(msg)
    assert len(set(msgs)) == 1, f"ranks disagree: {msgs}"
    return msg


def check_bad_input():
    """Each a clear ValueError on every rank before any message between ranks: (1) a sequence
    longer than the gpt's positions, (2) d_model not divisible by heads, (3) an empty segment,
    (4) a segment step that changes the state shape, (5) a patch that does not divide the
    image."""
    torch.set_default_dtype(DT)
    kw, shape, classes = SMALL["gpt"]
    c = JobConfig(model="gpt", **kw).validated(COMM.Get_size())
    net = build_model("gpt", c, shape, classes, comm=COMM)
    long = torch.zeros(2, c.context + 3, dtype=torch.long)
    msgs = [_agreed_error(lambda: net(long))]
    assert "9 tokens is longer than the model's 6 positions" in msgs[-1], msgs[-1]
    msgs.append(_agreed_error(lambda: JobConfig(model="vit", d_model=10, heads=4)
                              .validated(COMM.Get_size())))
    assert "--d-model=10 is not divisible by --heads=4" in msgs[-1], msgs[-1]
    opts = MGRITOptions(max_levels=2, cfactor=2)
    msgs.append(_agreed_error(lambda: LayerParallelResNet.build(
        lambda k: nn.Identity(), 0, (4,), comm=COMM, forward=opts, backward=opts)))
    assert "N=0 intervals" in msgs[-1], msgs[-1]  # the partition's check comes first

    def widening():
        seg = LayerParallelResNet.build(lambda k: nn.Linear(4, 4 if k < 3 else 5), 4, (4,),
                                        comm=COMM, forward=opts, backward=opts)
        LayerParallelNet(nn.Linear(3, 4), seg, nn.Linear(4, 2))
    msgs.append(_agreed_error(widening))
    assert "must keep the state shape" in msgs[-1], msgs[-1]
    vkw, vshape, vclasses = SMALL["vit"]
    cv = JobConfig(model="vit", **dict(vkw, patch=3)).validated(COMM.Get_size())
    msgs.append(_agreed_error(lambda: build_model("vit", cv, vshape, vclasses, comm=COMM)))
    assert "--patch=3 does not divide the 8x8 images" in msgs[-1], msgs[-1]
    return msgs
