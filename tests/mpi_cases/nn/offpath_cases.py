"""Rank-side checks of issue 36 (items 2-6, 10, 12): paths one step off the Trainer's own --
a user network on NetMixin, ``clip_grad_norm_`` called the README's way, dropout outside the
segment and per-rank seeds, BatchNorm without running statistics under data parallelism,
``torch.utils.checkpoint`` around a 2-level net with BatchNorm. float64; references are plain
serial PyTorch loops on the same weights (tests/nn/test_offpath.py)."""
from __future__ import annotations

import copy
import os
import tempfile

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import DenseStep, GRUSequenceClassifier, LayerParallelNet, LayerParallelResNet
from mgrit.nn.protocol import NetMixin
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid, clip_grad_norm_
from mgrit.training import Trainer
from mgrit.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tests.mpi_cases.training.trainer_cases import data, mgrit_net, serial_net

COMM = MPI.COMM_WORLD
DT = torch.float64


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _expect(fn, exc_type, *words):
    try:
        fn()
    except exc_type as exc:
        msg = str(exc)
        for w in words:
            assert w in msg, f"{w!r} not in {msg!r}"
        return msg
    raise AssertionError(f"no {exc_type.__name__} raised")


# -- item 2: a user network type on NetMixin ------------------------------------------------
class Wrapped(NetMixin, nn.Module):
    """A user network: a LayerParallelNet held as ``self.net``; only the loop's members."""

    def __init__(self, net):
        super().__init__()
        self.net, self.comm = net, net.comm

    @property
    def is_last(self):
        return self.net.is_last

    def forward(self, x):
        return self.net(x)

    def loss(self, out, target, fn=F.cross_entropy):
        return self.net.loss(out, target, fn)

    def from_last(self, value):
        return self.net.from_last(value)


class LocalLayers(NetMixin, nn.Module):
    """A partial protocol network: each rank holds its own layers under local keys (the
    default global_modules is wrong for it)."""

    def __init__(self, comm):
        super().__init__()
        torch.manual_seed(comm.Get_rank())
        self.layers = nn.ModuleList([nn.Linear(3, 3).to(DT) for _ in range(2)])
        self.comm = comm
        self.is_last = comm.Get_rank() == comm.Get_size() - 1

    def loss(self, out, target, fn=F.cross_entropy):
        return fn(out, target)

    def from_last(self, value):
        return self.comm.bcast(value, root=self.comm.Get_size() - 1)


class Plain(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


def _train(net, steps, x, y, opt):
    for s in range(steps):
        j = torch.arange(8 * s, 8 * s + 8) % len(y)
        opt.zero_grad()
        out = net(x[j])
        net.loss(out, y[j]).backward()
        opt.step()


def check_user_net_checkpoint(ckpt_dir):
    """The wrapper's checkpoint holds every tensor of the serial network under ``net.`` + its
    serial key; resume equals the continuous run and both equal serial PyTorch."""
    torch.set_default_dtype(DT)
    x, y = data()
    ckpt_dir = ckpt_dir or COMM.bcast(tempfile.mkdtemp(prefix="offpath-") if COMM.Get_rank() == 0
                                      else None)
    path = os.path.join(ckpt_dir, f"user-{COMM.Get_size()}.pt")
    cont = Wrapped(mgrit_net(COMM))
    opt = torch.optim.SGD(cont.parameters(), lr=0.1, momentum=0.9)
    _train(cont, 2, x, y, opt)
    save_checkpoint(path, cont, opt, ProcessGrid(COMM))
    _train(cont, 2, x[16:], y[16:], opt)
    ser = serial_net()
    sopt = torch.optim.SGD(ser.parameters(), lr=0.1, momentum=0.9)
    for s in range(4):
        j = torch.arange(8 * s, 8 * s + 8) if s < 2 else torch.arange(16 + 8 * (s - 2),
                                                                       24 + 8 * (s - 2))
        sopt.zero_grad()
        F.cross_entropy(ser(x[j]), y[j]).backward()
        sopt.step()
    serial_sd = ser.state_dict()
    if COMM.Get_rank() == 0:
        saved = torch.load(path, weights_only=True)["model"]
        assert sorted(saved) == sorted("net." + k for k in serial_sd), sorted(saved)
    resumed = Wrapped(mgrit_net(COMM))
    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()
    ropt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    load_checkpoint(path, resumed, ropt, ProcessGrid(COMM))
    _train(resumed, 2, x[16:], y[16:], ropt)
    worst = 0.0
    gc = cont.net.gather_state_dict()
    gr = resumed.net.gather_state_dict()
    if COMM.Get_rank() == 0:
        for k, t in serial_sd.items():
            worst = max(worst, _rel(gc[k], t), _rel(gr[k], t))
        assert worst < 1e-9, worst
    # a partial network with local keys: refused naming the colliding keys (P > 1)
    local = LocalLayers(COMM)
    if COMM.Get_size() > 1:
        _expect(lambda: save_checkpoint(path + ".bad", local, None, ProcessGrid(COMM)), CheckpointError,
                "'layers.0.weight'", "several layer ranks", "global_modules()")
        assert not os.path.exists(path + ".bad")
        # a plain wrapper: refused with advice that names the protocol, not the communicator
        msg = _expect(lambda: Trainer(Plain(mgrit_net(COMM)), torch.optim.SGD(
            Wrapped(mgrit_net(COMM)).parameters(), lr=0.1),
            ProcessGrid(COMM, data_parallel=1)), TypeError, "NetMixin", "spans")
        assert "build the network on grid.layer_comm" not in msg
    return f"{COMM.bcast(worst):.1e}"


# -- item 3: clip_grad_norm_(net, max_norm, comm) as the README shows it -------------------
def _tied_pair():
    from mgrit.nn import ResidualStep
    torch.manual_seed(3)
    shared = DenseStep(4, "tanh").to(DT)
    ref = copy.deepcopy(shared)
    n = 5
    o = MGRITOptions(max_levels=2, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80)
    seg = LayerParallelResNet.build(lambda k: shared, n, (4,), comm=COMM, tie=lambda k: 0,
                                    forward=o, backward=o)
    torch.manual_seed(11)
    opening, closing = nn.Linear(3, 4).to(DT), nn.Linear(4, 2).to(DT)
    serial = nn.Sequential(copy.deepcopy(opening), *[ResidualStep(ref, 1.0 / n)] * n,
                           copy.deepcopy(closing))
    return LayerParallelNet(opening, seg, closing), serial


def check_clip_readme_way(max_norm=0.05):
    """Tied group spanning ranks and a ParallelGRU: the norm and the clipped gradients of
    ``clip_grad_norm_(net, max_norm, comm)`` equal torch's on the serial model."""
    torch.set_default_dtype(DT)
    x = torch.randn(5, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 1, 0, 1])
    net, serial = _tied_pair()
    net.loss(net(x), y).backward()
    F.cross_entropy(serial(x), y).backward()
    norm = float(clip_grad_norm_(net, max_norm, COMM))
    snorm = float(torch.nn.utils.clip_grad_norm_(serial.parameters(), max_norm))
    sp = dict(serial.named_parameters(remove_duplicate=False))
    worst = abs(norm - snorm) / snorm
    for key, p in net.named_global_parameters():
        worst = max(worst, _rel(p.grad, sp[key].grad))
    assert worst < 1e-9, f"tied: norm {norm} vs serial {snorm}, worst {worst:.2e}"
    # ParallelGRU: replicated weights counted once
    torch.manual_seed(7)
    o = MGRITOptions(max_levels=2, cfactor=2, tol=1e-12, max_iter=60)
    model = GRUSequenceClassifier(3, 4, 2, comm=COMM, forward=o, backward=o)
    ser = model.to_serial()
    xs = torch.randn(4, 6, 3, dtype=DT, generator=torch.Generator().manual_seed(2))
    ys = torch.tensor([0, 1, 1, 0])
    model.loss(model(xs), ys).backward()
    F.cross_entropy(ser["head"](ser["gru"](xs)[1][0]), ys).backward()
    norm = float(clip_grad_norm_(model, max_norm, COMM))
    snorm = float(torch.nn.utils.clip_grad_norm_(ser.parameters(), max_norm))
    e = abs(norm - snorm) / snorm
    for p, q in zip(model.gru.parameters(), ser["gru"].parameters()):
        e = max(e, _rel(p.grad, q.grad))
    assert e < 1e-8, f"GRU: norm {norm} vs serial {snorm}, worst {e:.2e}"
    # a plain module around the network is searched the same way
    net2, serial2 = _tied_pair()
    net2.loss(net2(x), y).backward()
    F.cross_entropy(serial2(x), y).backward()
    n2 = float(clip_grad_norm_(Plain(net2), max_norm, COMM))
    s2 = float(torch.nn.utils.clip_grad_norm_(serial2.parameters(), max_norm))
    assert abs(n2 - s2) / s2 < 1e-9, (n2, s2)
    return f"{COMM.allreduce(max(worst, e), op=MPI.MAX):.1e}"


# -- item 4: dropout outside the segment, per-rank seeds ------------------------------------
def check_dropout_streams(per_rank, levels=2, steps=3, tol=1e-10):
    """``nn.Dropout`` in the opening and the closing, mgrit Dropout/DropPath in the steps;
    seeded once (the same seed everywhere, or ``1000 + rank``: the DDP habit), several SGD
    steps without reseeding: loss, gradients and parameters equal the serial network seeded
    as the first layer rank (1000); the layer ranks' generators are equal after every
    forward."""
    from tests.mpi_cases.nn.stateful_cases import DropDense, _batches
    from mgrit.nn import serial_resnet
    torch.set_default_dtype(DT)
    make = lambda k: DropDense().double()  # noqa: E731

    def ends():
        torch.manual_seed(5)
        return (nn.Sequential(nn.Linear(2, 3), nn.Dropout(0.3)).double(),
                nn.Sequential(nn.Dropout(0.2), nn.Linear(3, 4)).double())
    o = MGRITOptions(max_levels=levels, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80)
    opening, closing = ends()
    ser = nn.Sequential(opening, *serial_resnet(make, 7, 1.0, seed=3), closing)
    opening, closing = ends()
    seg = LayerParallelResNet.build(make, 7, (3,), comm=COMM, seed=3, forward=o, backward=o)
    net = LayerParallelNet(opening, seg, closing)
    batches = _batches((2,), 6, steps)
    ropt = torch.optim.SGD(ser.parameters(), lr=0.1)
    torch.manual_seed(1000)
    ref = []
    for x, y in batches:
        ropt.zero_grad()
        loss = F.cross_entropy(ser(x), y)
        loss.backward()
        ref.append((loss.item(), {k: p.grad.clone() for k, p in ser.named_parameters()}))
        ropt.step()
    final = {k: p.detach().clone() for k, p in ser.named_parameters()}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    torch.manual_seed(1000 + COMM.Get_rank() if per_rank else 1000)
    worst = 0.0
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        out = net(x)
        loss = net.loss(out, y)
        loss.backward()
        gens = COMM.allgather(torch.default_generator.get_state())
        assert all(torch.equal(s, gens[0]) for s in gens), f"step {i}: generators differ"
        if net.is_last:
            e = abs(loss.item() - ref[i][0]) / ref[i][0]
            assert e <= tol, f"step {i}: loss rel err {e} ({loss.item()} vs {ref[i][0]})"
        for key, p in net.named_global_parameters():
            e = _rel(p.grad, ref[i][1][key])
            assert e <= tol, f"step {i}: grad of {key} rel err {e}"
            worst = max(worst, e)
        opt.step()
    for key, p in net.named_global_parameters():
        worst = max(worst, _rel(p, final[key]))
    assert worst <= tol, worst
    return f"{COMM.allreduce(worst, op=MPI.MAX):.1e}"


# -- item 5: BatchNorm without running statistics, data-parallel evaluation ----------------
def check_dp_eval_batch_stats():
    """Every rank a data-parallel replica; a serial net with ``BatchNorm1d(track_running_stats
    =False)``: ``Trainer.evaluate`` equals the one-process evaluation in the same chunks (and
    a net with running statistics still splits the samples: equal too)."""
    torch.set_default_dtype(DT)
    x, y = data(n=24)
    grid = ProcessGrid(COMM, data_parallel=COMM.Get_size())
    worst = 0.0
    for track in (False, True):
        torch.manual_seed(4)
        net = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5, track_running_stats=track),
                            nn.Tanh(), nn.Linear(5, 3)).double()
        ref = copy.deepcopy(net)
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), grid,
                          eval_batch_size=10)
        acc, loss = trainer.evaluate((x, y))
        ref.eval()
        with torch.no_grad():
            total = sum(F.cross_entropy(ref(x[s:s + 10]), y[s:s + 10], reduction="sum").item()
                        for s in range(0, len(y), 10))
        e = abs(loss - total / len(y)) / (total / len(y))
        assert e < 1e-12, f"track_running_stats={track}: {loss} vs {total / len(y)}"
        worst = max(worst, e)
    return f"{COMM.allreduce(worst, op=MPI.MAX):.1e}"


# -- item 6: torch.utils.checkpoint around a 2-level net with BatchNorm ---------------------
def check_checkpoint_batchnorm(levels=2, steps=2, tol=1e-10):
    """Non-reentrant ``torch.utils.checkpoint`` around the whole net (BatchNorm in the steps,
    running statistics): gradients, running statistics and ``num_batches_tracked`` equal
    serial PyTorch with the same checkpoint (which updates them in the forward and in the
    recomputation) on every rank."""
    from torch.utils.checkpoint import checkpoint
    from tests.mpi_cases.nn.stateful_cases import _batches, _compare_state, _nets
    torch.set_default_dtype(DT)
    net, ser, in_shape = _nets("dense", COMM, levels)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ser.parameters(), lr=0.1)
    worst = 0.0
    for i, (x, y) in enumerate(_batches(in_shape, 6, steps)):
        for o in (opt, ropt):
            o.zero_grad(set_to_none=True)
        F.cross_entropy(checkpoint(ser, x, use_reentrant=False), y).backward()
        out = checkpoint(net, x, use_reentrant=False)
        net.loss(out, y).backward()
        worst = max(worst, _compare_state(net, ser, tol, f"step {i}"))
        opt.step()
        ropt.step()
    tracked = [int(t) for k, t in ser.state_dict().items() if k.endswith("num_batches_tracked")]
    assert set(tracked) == {2 * steps}, tracked
    return f"{COMM.allreduce(worst, op=MPI.MAX):.1e}"
