"""``--model gru`` and ``--dataset adding`` in the main job (mgrit.models.recurrent).

In-process (one rank, float64): the serial form (fused ``nn.GRU`` through
``torch.func.functional_call``) against an unrolled ``nn.GRUCell`` loop; the layer-parallel
form on one rank in exact mode against the serial form; evaluation forwards iterate to the
relative tolerance. Jobs (subprocesses, tiny): the 2-rank exact-mode job (and 2 x 2 ranks with data-parallel
replicas) against the serial job epoch by epoch, an inexact 2-rank row-by-row job, the adding problem on 2 ranks, and the
serial job's checkpoint resumed by a layer-parallel job.
"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerpar.jobconfig import JobConfig
from mgrit.models import build_model
from mgrit.models.recurrent import (GRUNet, SerialGRUNet, load_sequence_task,
                                             regression_loss, sequence_shape)
from tests.job.test_train_job import _load_script, run_jobs

DIGITS = ["--dataset", "digits", "--model", "gru", "--hidden", "6", "--epochs", "2",
          "--limit-train", "120", "--limit-test", "60", "--batch-size", "40", "--no-progress"]
EXACT = ["--dtype", "float64", "--tol", "1e-12", "--levels", "2", "--cfactor", "2",
         "--relax", "FCF"]
ADDING = ["--dataset", "adding", "--model", "gru", "--seq-len", "64", "--hidden", "4",
          "--epochs", "1", "--limit-train", "64", "--limit-test", "32", "--batch-size", "32",
          "--levels", "2", "--cfactor", "4", "--relax", "FCF", "--lr", "0.05",
          "--no-progress"]
JOBS = {
    "serial": (1, DIGITS + EXACT + ["--serial"]),
    "serial1": (1, DIGITS + EXACT + ["--serial", "--epochs", "1", "--checkpoint-every", "3"]),
    "exact2": (2, DIGITS + EXACT),
    "exact2x2": (4, DIGITS + EXACT + ["--dp", "2"]),
    "inexact2": (2, DIGITS + ["--levels", "2", "--cfactor", "2", "--relax", "FCF"]),
    "adding2": (2, ADDING),
}


def _cfg(**kw) -> SimpleNamespace:
    c = JobConfig(**kw)
    return SimpleNamespace(**c.to_dict())


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _unrolled(model: SerialGRUNet, x):
    cell = nn.GRUCell(x.shape[-1], model.gru.weight_hh.shape[1])
    with torch.no_grad():
        for a, b in (("weight_ih", "weight_ih"), ("weight_hh", "weight_hh"),
                     ("bias_ih", "bias_ih"), ("bias_hh", "bias_hh")):
            getattr(cell, a).copy_(getattr(model.gru, b))
    params = [cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh]
    h = torch.zeros(x.shape[0], cell.hidden_size)
    for t in range(x.shape[1]):
        h = cell(x[:, t], h)
    return model.head(h), params


def test_serial_form_equals_unrolled_grucell():
    """SerialGRUNet (fused nn.GRU with ParallelGRU's parameter names) == an unrolled
    nn.GRUCell loop + the same head: output and every gradient to 1e-13 (float64)."""
    torch.manual_seed(0)
    model = SerialGRUNet(5, 7, 3)
    x = torch.randn(4, 9, 5)
    y = torch.tensor([0, 2, 1, 2])
    F.cross_entropy(model(x), y).backward()
    out, cell_params = _unrolled(model, x)
    F.cross_entropy(out, y).backward()
    assert torch.allclose(model(x), out, rtol=0, atol=1e-13)
    for p, q in zip([model.gru.weight_ih, model.gru.weight_hh, model.gru.bias_ih,
                     model.gru.bias_hh], cell_params):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-13)
    assert [n for n, _ in model.named_parameters()] == [
        "gru.weight_ih", "gru.weight_hh", "gru.bias_ih", "gru.bias_hh", "head.weight",
        "head.bias"]


def test_builder_parallel_exact_equals_serial_one_rank():
    """build_model('gru') on one time rank (COMM_SELF) in exact mode vs the serial form
    from the same flags: same initial weights and parameter names, outputs and gradients to
    1e-10 relative on images read row by row."""
    from mpi4py import MPI
    cfg = _cfg(model="gru", hidden=6, tol=1e-13, levels=2, cfactor=2, relax="FCF")
    par = build_model("gru", cfg, (1, 8, 8), 10, comm=MPI.COMM_SELF)
    ser = build_model("gru", cfg, (1, 8, 8), 10)
    assert isinstance(par, GRUNet) and isinstance(ser, SerialGRUNet)
    sp, ss = dict(par.named_parameters()), dict(ser.named_parameters())
    assert sp.keys() == ss.keys()
    for k in sp:
        assert torch.equal(sp[k], ss[k]), k
    torch.manual_seed(1)
    x, y = torch.randn(5, 1, 8, 8), torch.randint(0, 10, (5,))
    for m in (par, ser):
        F.cross_entropy(m(x), y).backward()
    assert torch.allclose(par(x), ser(x), rtol=1e-10, atol=0)
    for k in sp:
        scale = ss[k].grad.abs().max().item()
        assert (sp[k].grad - ss[k].grad).abs().max().item() <= 1e-10 * scale, k


def test_evaluation_forwards_iterate_to_the_tolerance():
    """Inexact training (1 forward cycle, F-relaxation, 2 levels) keeps its fixed cycles in
    train mode; in eval mode without grad the forward converges to --gru-eval-rtol and the
    output equals the serial network's to that accuracy; the training options are restored.
    F-relaxation for a GRU warns."""
    from mpi4py import MPI
    cfg = _cfg(model="gru", hidden=8, tol=0.0, fwd_iters=1, bwd_iters=1, levels=2, cfactor=4,
               relax="F", gru_eval_rtol=1e-10)
    with pytest.warns(UserWarning, match="use --relax FCF"):
        par = build_model("gru", cfg, (24, 3), 2, comm=MPI.COMM_SELF)
    ser = build_model("gru", cfg, (24, 3), 2)
    torch.manual_seed(2)
    x = torch.randn(6, 24, 3) * 2
    par(x)
    train_res = par.gru.last_forward
    assert train_res.iterations == 1
    par.eval()
    with torch.no_grad():
        out = par(x)
    res = par.gru.last_forward
    assert res.converged and res.iterations > 1
    assert res.residuals[-1] <= 1e-10 * res.state_norm
    assert torch.allclose(out, ser(x), rtol=0, atol=1e-8)
    assert par.gru.fwd_opts.max_iter == 1 and par.gru.fwd_opts.tol == 0  # restored


def test_sequence_shapes_and_adding_task():
    assert sequence_shape((1, 28, 28)) == (28, 28)
    assert sequence_shape((1024, 2)) == (1024, 2)
    with pytest.raises(ValueError, match="single-channel images"):
        sequence_shape((3, 32, 32))
    cfg = _cfg(dataset="adding", model="gru", seq_len=16, limit_train=10, limit_test=5, seed=3)
    train, test = load_sequence_task(cfg)
    assert train.x.shape == (10, 16, 2) and test.x.shape == (5, 16, 2)
    assert train.num_classes == 1 and train.y.dtype == np.float32
    marked = (train.x[..., 1] * train.x[..., 0]).sum(1)  # the target by definition
    assert np.allclose(marked, train.y, atol=1e-6)
    out = torch.tensor([[0.5], [1.0]])
    assert regression_loss(out, torch.tensor([1.0, 1.0])).item() == pytest.approx(0.125)


@pytest.mark.parametrize("args, world, message", [
    (["--model", "gru", "--method", "decoupled"], 2, "has no --model gru"),
    (["--dataset", "adding"], 1, "use --model gru"),
    (["--model", "gru", "--dataset", "adding", "--seq-len", "1"], 1, "--seq-len=1"),
    (["--model", "gru", "--gru-coarse", "cubic"], 1, "invalid choice"),
    (["--model", "gru", "--hidden", "0"], 1, "--hidden=0"),
    (["--model", "gru", "--dataset", "adding", "--seq-len", "2"], 4, "--seq-len=2 is smaller"),
])
def test_bad_gru_flags_fail_clearly(args, world, message, capsys):
    parser = _load_script().build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_config(args, world)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return run_jobs(JOBS, tmp_path_factory.mktemp("gru_job"))


def _history(out):
    with h5py.File(out / "metrics.h5", "r") as h:
        return {k: np.asarray(h[k]) for k in ("loss", "train_acc", "test_acc", "test_loss")}


def _ok(result):
    out, rc, so, se = result
    assert rc == 0, f"exit {rc}\n--- stdout\n{so[-3000:]}\n--- stderr\n{se[-3000:]}"
    return out, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_exact_gru_job_on_two_ranks_equals_serial_job(jobs):
    """--model gru, float64, MGRIT in time to 1e-12 on 2 time ranks vs the serial nn.GRU job
    (same seed, data, batches): every epoch's loss, accuracies and test loss to 1e-9."""
    _, s_ser = _ok(jobs["serial"])
    out_par, s_par = _ok(jobs["exact2"])
    assert s_par["world_size"] == 2 and s_par["P_L"] == 2
    want, got = _history(jobs["serial"][0]), _history(out_par)
    for k in want:
        assert np.allclose(got[k], want[k], rtol=1e-9, atol=0), (k, got[k], want[k])
    assert len(s_par["gru_solver"]) == 2  # per-epoch solver record of the GRU


@pytest.mark.slow
def test_exact_gru_job_with_replicas_equals_serial_job(jobs):
    """2 time ranks x 2 data-parallel replicas (4 ranks), exact mode: the serial job's history
    to 1e-9 (the GRU's parameters are replicated over the time ranks and averaged over the
    replicas)."""
    out, s = _ok(jobs["exact2x2"])
    assert s["P_L"] == 2 and s["dp"] == 2
    want, got = _history(jobs["serial"][0]), _history(out)
    for k in want:
        assert np.allclose(got[k], want[k], rtol=1e-9, atol=0), (k, got[k], want[k])


@pytest.mark.slow
def test_inexact_row_by_row_job_runs(jobs):
    out, s = _ok(jobs["inexact2"])
    fin = s["final"]
    assert 0.0 <= fin["test_acc"] <= 1.0 and math.isfinite(fin["loss"])
    rec = s["gru_solver"]
    assert [r["fwd_iters"] for r in rec] == [2, 2]  # the job's default 2 forward cycles
    assert s["config"]["input_shape"] == [1, 8, 8]


@pytest.mark.slow
def test_adding_problem_job_on_two_ranks(jobs):
    """--dataset adding: generated sequences of 64 steps, MSE regression on 2 time ranks."""
    out, s = _ok(jobs["adding2"])
    assert s["config"]["input_shape"] == [64, 2] and s["config"]["num_classes"] == 1
    assert math.isfinite(s["final"]["loss"]) and math.isfinite(s["final"]["test_loss"])
    assert math.isnan(s["final"]["test_acc"]) and s["final"]["train_acc"] is None  # no accuracy


@pytest.mark.slow
def test_serial_checkpoint_resumes_layer_parallel(jobs, tmp_path):
    """The serial job's checkpoint after epoch 1 (same parameter names) continues on 2 time
    ranks in exact mode for a second epoch: the history equals the uninterrupted serial
    2-epoch job's to 1e-9."""
    ckpt = jobs["serial1"][0] / "checkpoint.pt"
    _ok(jobs["serial1"])
    res = run_jobs({"resumed": (2, DIGITS + EXACT + ["--resume", str(ckpt)])}, tmp_path)
    out, s = _ok(res["resumed"])
    want, got = _history(jobs["serial"][0]), _history(out)
    for k in want:
        assert np.allclose(got[k], want[k], rtol=1e-9, atol=0), (k, got[k], want[k])
