"""Baseline checks on k ranks (tests/perf/test_perf_baselines.py): GPipe (lean and autograd stages)
and lean data parallelism give serial autograd's gradients and SGD updates (float64)."""
import torch
from mpi4py import MPI
from torch import nn

from mgrit.grid import Partition
from mgrit.nn import DenseStep, serial_resnet
from mgrit.perf.baselines import GPipe, LeanDataParallel, LeanStage, ModuleStage
from mgrit.perf.lean import LeanResNet

COMM = MPI.COMM_WORLD
TOL = 1e-12


def _serial(N, w, act="tanh"):
    return serial_resnet(lambda k: DenseStep(w, act), N, seed=3).double()


def _x(B, w, seed=5):
    return torch.randn(B, w, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _ref_grads(net, x, loss):
    net.zero_grad()
    loss(net(x)).backward()
    return [(l.F.linear.weight.grad.clone(), l.F.linear.bias.grad.clone()) for l in net]


def _close(a, b, what):
    err = float((a - b).abs().max())
    scale = float(b.abs().max()) + 1e-300
    assert err <= TOL * max(scale, 1.0), f"rank {COMM.rank}: {what} differs by {err:.3e} (scale {scale:.3e})"


def check_gpipe_lean(N=11, w=3, B=7, micro=3):
    """Lean stages on an uneven partition, uneven micro-batches: every layer's gradient on
    its rank equals serial autograd's; the SGD step equals ``W - lr dW``."""
    net, x = _serial(N, w), _x(B, w)
    ref = _ref_grads(net, x, lambda y: (y ** 2).mean())
    lo, hi = Partition.even(N, COMM.size).block(COMM.rank)
    hi = min(hi, N)
    stage = LeanStage(LeanResNet.from_sequential(net[lo:hi]))
    pipe = GPipe(stage, COMM, micro, dtype=torch.float64)
    loss = pipe.step(x if COMM.rank == 0 else None, B,
                     lambda o, j, rows: (o ** 2).sum() / (B * w))
    for k in range(lo, hi):
        _close(stage.net.gWT[k - lo].t(), ref[k][0], f"dW of layer {k}")
        _close(stage.net.gb[k - lo], ref[k][1], f"db of layer {k}")
    if COMM.rank == COMM.size - 1:
        want = float((net(x) ** 2).mean())
        assert abs(loss - want) <= 1e-12 * abs(want), (loss, want)
    W0 = stage.net.WT.clone()
    stage.step(0.1)
    _close(stage.net.WT, W0 - 0.1 * stage.net.gWT, "SGD step")
    return "ok"


def check_gpipe_module(N=6, w=3, B=8, micro=4):
    """Autograd stages: an opening Linear(5, w) + tanh on the first stage, residual steps,
    a Linear(w, 2) classifier and cross-entropy on the last: gradients equal serial autograd."""
    torch.manual_seed(0)
    opening = nn.Sequential(nn.Linear(5, w), nn.Tanh()).double()
    closing = nn.Linear(w, 2).double()
    body = _serial(N, w)
    full = nn.Sequential(opening, *body, closing)
    x = torch.randn(B, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.arange(B) % 2
    full.zero_grad()
    nn.functional.cross_entropy(full(x), y).backward()
    ref = [p.grad.clone() for p in full.parameters()]
    lo, hi = Partition.even(N, COMM.size).block(COMM.rank)
    hi = min(hi, N)
    mods = list(body[lo:hi])
    first, last = COMM.rank == 0, COMM.rank == COMM.size - 1
    mods = ([opening] if first else []) + mods + ([closing] if last else [])
    stage = ModuleStage(nn.Sequential(*mods), (5,) if first else (w,), first=first)
    pipe = GPipe(stage, COMM, micro, dtype=torch.float64)
    pipe.step(x if first else None, B,
              lambda o, j, rows: nn.functional.cross_entropy(o, y[rows]) * (rows.stop - rows.start) / B)
    mine = {id(p) for p in stage.module.parameters()}
    n = 0
    for p, g in zip(full.parameters(), ref):
        if id(p) in mine:
            _close(p.grad, g, "a parameter gradient")
            n += 1
    assert n == len(mine)
    return "ok"


def check_lean_data_parallel(N=9, w=3, B=10):
    """Each rank a shard of the batch: after one step every replica holds serial SGD's
    weights (the gradient of the global mean loss)."""
    net, x = _serial(N, w), _x(B, w)
    ref = _ref_grads(net, x, lambda y: (y ** 2).mean())
    lean = LeanResNet.from_sequential(net)
    rows = torch.tensor_split(torch.arange(B), COMM.size)[COMM.rank]
    LeanDataParallel(lean, COMM).train_step(x[rows], B * w, 0.5)
    for k in range(N):
        _close(lean.WT[k].t(), net[k].F.linear.weight.detach() - 0.5 * ref[k][0], f"W of layer {k}")
        _close(lean.b[k], net[k].F.linear.bias.detach() - 0.5 * ref[k][1], f"b of layer {k}")
    return "ok"


def check_gpipe_bad_micro():
    """A bad micro-batch count raises the same ValueError on every rank (agreed, no hang)."""
    net = _serial(4, 2)
    stage = LeanStage(LeanResNet.from_sequential(net))
    try:
        GPipe(stage, COMM, 0 if COMM.rank == 0 else 2)
    except ValueError as e:
        assert "micro_batches=0" in str(e), e
        return "ok"
    raise AssertionError("no ValueError")
