"""Rank-side checks of the reliability suite (mgrit.training.support.faults, mgrit.training.guard,
mgrit.training.checkpoint): resume, convergence guard, non-finite states, kill -9 during a
checkpoint write. The bad-input table is in :mod:`tests.mpi_cases.training.bad_input_cases`."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import sys
import time
import warnings

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from mgrit.parallel import ProcessGrid
from mgrit.training import checkpoint_io
from mgrit.training.checkpoint import load_checkpoint, save_checkpoint
from mgrit.training.guard import ConvergenceGuard
from mgrit.training.support.solvers import replace_solver, solver_states
from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet
from mgrit.options import MGRITOptions

WIDTH, N_LAYERS, D_IN, CLASSES, N_DATA, BATCH = 4, 8, 3, 3, 40, 8


def make_data():
    g = torch.Generator().manual_seed(123)
    return (torch.randn(N_DATA, D_IN, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (N_DATA,), generator=g))


def build(comm, mode="exact", seed=0, n_layers=N_LAYERS, T=1.0, cfactor=2, step=None, relax="FCF"):
    torch.set_default_dtype(torch.float64)
    if mode == "exact":
        fw = MGRITOptions(max_levels=2, cfactor=cfactor, tol=1e-13, max_iter=60)
        bw = MGRITOptions(max_levels=2, cfactor=cfactor, tol=1e-13, max_iter=60)
    else:
        fw = MGRITOptions(max_levels=2, cfactor=cfactor, tol=0, max_iter=2, relax=relax)
        bw = MGRITOptions(max_levels=2, cfactor=cfactor, tol=0, max_iter=1)
    make = step or (lambda k: DenseStep(WIDTH, "tanh"))
    resnet = LayerParallelResNet.build(make, n_layers, (WIDTH,), comm=comm, seed=seed, T=T,
                                       forward=fw, backward=bw)
    torch.manual_seed(1000 + seed)
    opening, closing = nn.Linear(D_IN, WIDTH), nn.Linear(WIDTH, CLASSES)
    net = LayerParallelNet(opening, resnet, closing)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    # the same global RNG state on every rank (build() reseeds per layer)
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    return net, opt


def train_steps(net, opt, n_steps, x, y, guard=None, step0=0):
    """Batches drawn with the global RNGs (so restoring them matters); returns losses."""
    losses = []
    for s in range(n_steps):
        idx = torch.randint(0, N_DATA, (BATCH,))
        noise = 1e-3 * float(np.random.rand()) + 1e-3 * random.random()
        xb, yb = x[idx] + noise, y[idx]
        opt.zero_grad()
        out = net(xb)
        loss = net.loss(out, yb)
        loss.backward()
        if guard is not None:
            guard.check_resnet(net.resnet, step0 + s)
        opt.step()
        losses.append(net.from_last(float(loss.detach())))
    return losses


def _save(path, net, opt, extra):
    save_checkpoint(path, net, opt, ProcessGrid(net.comm), extra=extra)


def _load(path, net, opt):
    """The saved extra plus ``_notes`` and ``_nprocs`` (ranks that wrote it)."""
    loaded = load_checkpoint(path, net, opt, ProcessGrid(net.comm))
    P_L, P_D = loaded.saved_grid
    return {**loaded.extra, "_notes": loaded.notes, "_nprocs": P_L * P_D}


# -- acceptance 3: resume ------------------------------------------------------------------
def check_resume_bitwise(ckpt_dir, mode="exact"):
    """4 uninterrupted steps == 2 steps + save + load into a differently seeded model + 2."""
    comm = MPI.COMM_WORLD
    x, y = make_data()
    net, opt = build(comm, mode)
    ref = train_steps(net, opt, 4, x, y)
    net, opt = build(comm, mode)
    first = train_steps(net, opt, 2, x, y)
    path = os.path.join(ckpt_dir, f"resume-{mode}-P{comm.Get_size()}.pt")
    _save(path, net, opt, {"epoch": 0, "batch": 2, "sampler_seed": 7})
    net2, opt2 = build(comm, mode, seed=99)   # different weights, RNG, no warm start
    torch.manual_seed(12345)
    extra = _load(path, net2, opt2)
    assert extra["batch"] == 2 and extra["_nprocs"] == comm.Get_size(), extra
    rest = train_steps(net2, opt2, 2, x, y)
    got = first + rest
    assert got == ref, f"resumed {got} != uninterrupted {ref}"
    params = [p.detach().clone() for p in net2.parameters()]
    net3, opt3 = build(comm, mode)
    train_steps(net3, opt3, 4, x, y)
    for a, b in zip(params, net3.parameters()):
        assert torch.equal(a, b), "parameters differ after resume"
    return ref


def check_save_for_repartition(ckpt_dir):
    """P ranks: uninterrupted 4-step losses, and a checkpoint after 2 steps."""
    comm = MPI.COMM_WORLD
    x, y = make_data()
    net, opt = build(comm, "exact")
    ref = train_steps(net, opt, 4, x, y)
    net, opt = build(comm, "exact")
    train_steps(net, opt, 2, x, y)
    _save(os.path.join(ckpt_dir, "repartition.pt"), net, opt, {"epoch": 0, "batch": 2})
    return ref


def check_resume_repartitioned(ckpt_dir, saved_p=2):
    """Load the P=saved_p checkpoint on this P, train 2 steps; return all 4 losses
    (first two from this P's uninterrupted run) and the reference."""
    comm = MPI.COMM_WORLD
    x, y = make_data()
    net, opt = build(comm, "exact")
    ref = train_steps(net, opt, 4, x, y)
    net2, opt2 = build(comm, "exact", seed=5)
    extra = _load(os.path.join(ckpt_dir, "repartition.pt"), net2, opt2)
    assert extra["_nprocs"] == saved_p, extra
    if comm.Get_size() != saved_p:
        assert extra["_notes"] and "re-partitioned" in extra["_notes"][0], extra
        # issue 13 item 6: the note says what happened to every saved and every new rank
        P = comm.Get_size()
        want = ("RNG and per-rank states of rank 0 restored from the same saved ranks; those "
                "of saved rank 1 are not used" if P == 1 else
                "RNG and per-rank states of ranks 0..1 restored from the same saved ranks; "
                "rank 2 (new) starts from saved rank 0's states")
        assert want in extra["_notes"], extra["_notes"]
    rest = train_steps(net2, opt2, 2, x, y)
    for a, b in zip(rest, ref[2:]):
        assert abs(a - b) <= 1e-10, (rest, ref)
    return ref[:2] + rest


def check_determinism(steps=3):
    comm = MPI.COMM_WORLD
    x, y = make_data()
    net, opt = build(comm, "exact")
    return train_steps(net, opt, steps, x, y)


# -- acceptance 4: convergence guard ---------------------------------------------------------
class _Lin(nn.Module):
    """Linear step with a large weight: MGRIT with large h * cfactor diverges."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.lin.weight.copy_(-1.0 * torch.eye(WIDTH) + 0.1 * torch.randn(WIDTH, WIDTH))
            self.lin.bias.zero_()

    def forward(self, x):
        return self.lin(x)


def check_guard(action, log_dir):
    comm = MPI.COMM_WORLD
    x, y = make_data()
    net, opt = build(comm, "inexact", n_layers=64, T=64.0, cfactor=8, step=lambda k: _Lin(), relax="F")
    log = os.path.join(log_dir, f"guard-{action}.jsonl")
    guard = ConvergenceGuard(window=3, threshold=1.0, action=action, max_extra=4,
                             extra_per_trigger=2, log_path=log)
    # more forward cycles so that growth shows within one solve
    replace_solver(net.resnet, "forward", dataclasses.replace(net.resnet.fwd_opts, max_iter=4))
    opt.param_groups[0]["lr"] = 0.0  # keep the diverging weights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        idx = torch.arange(BATCH)
        out = net(x[idx])
        hist = list(net.resnet.last_forward.residuals)
        net.loss(out, y[idx]).backward()
        done = guard.check_resnet(net.resnet, 0)
    assert any(n == "forward" and a == action for n, a in done), (done, hist)
    grew = [str(w.message) for w in caught if "grew" in str(w.message)]
    assert bool(grew) == (comm.Get_rank() == 0), grew  # one warning per job, on rank 0
    if action == "add_iterations":
        assert net.resnet.fwd_opts.max_iter == 6, net.resnet.fwd_opts
        assert net.resnet._fsolver.options.max_iter == 6
    if action == "serial":
        assert net.resnet.fwd_opts.max_levels == 1 and net.resnet.bwd_opts.max_levels == 1
        assert net.resnet._fsolver.hierarchy.n_levels == 1
        # after the switch: exact, equal to the serial network
        out = net(x[idx])
        serial = net.to_serial()
        want = serial(x[idx])
        if net.is_last:
            assert torch.allclose(out, want, atol=1e-10, rtol=0), (out - want).abs().max()
        net.loss(out, y[idx]).backward()
        assert guard.check_resnet(net.resnet, 1) == []
    comm.Barrier()
    if comm.Get_rank() == 0:
        events = [json.loads(line) for line in open(log)]
        assert events[0]["action"] == action and events[0]["solver"] == "forward", events
        assert all(f > 1.0 for f in events[0]["factors"]), events
        if action != "warn":
            assert any(e.get("applied") == action for e in events), events
    return hist


def check_nonfinite_state_named():
    """A NaN weight in layer 5: FloatingPointError on every rank (solver or state check)."""
    comm = MPI.COMM_WORLD
    from mgrit.training.guard import check_finite_states
    net, opt = build(comm, "inexact")
    for j, s in enumerate(net.resnet.steps):
        if net.resnet.first + j == 5:
            with torch.no_grad():
                s.linear.bias.fill_(float("nan"))
    x, y = make_data()
    try:
        net(x[:BATCH])
    except FloatingPointError as exc:
        msg = str(exc)
    else:
        raise AssertionError("no FloatingPointError")
    assert "NaN" in msg or "nan" in msg, msg
    try:
        check_finite_states(_Res(net.resnet), "forward", 3,
                            comm, N_LAYERS)
    except FloatingPointError as exc:
        msg2 = str(exc)
    else:
        raise AssertionError("no state error")
    assert "x_6" in msg2 and "step 3" in msg2, msg2
    return msg2


class _Res:
    def __init__(self, resnet):
        self.states, self.lo = solver_states(resnet, "forward")
        self.iterations = 1


# -- acceptance 3: kill -9 during a checkpoint write (child process, one rank) ---------------
def kill_child(path):
    """Train 1 step, save ``path``, train 1 more, then start saving again with a writer that
    stalls half-way (the parent SIGKILLs this process there)."""
    x, y = make_data()
    net, opt = build(MPI.COMM_SELF, "exact")
    train_steps(net, opt, 1, x, y)
    _save(path, net, opt, {"step": 1})
    print("saved", flush=True)
    train_steps(net, opt, 1, x, y)

    def slow_dump(obj, fh):
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        fh.write(data[:len(data) // 2])
        fh.flush()
        os.fsync(fh.fileno())
        print("writing", flush=True)
        time.sleep(120)
        fh.write(data[len(data) // 2:])

    checkpoint_io._dump = slow_dump
    _save(path, net, opt, {"step": 2})
    sys.exit(3)  # not reached when killed


def params_after_one_step_loaded(path):
    """(params after 1 uninterrupted step, params loaded from ``path``, extra)."""
    x, y = make_data()
    net, opt = build(MPI.COMM_SELF, "exact")
    train_steps(net, opt, 1, x, y)
    want = [p.detach().clone() for p in net.parameters()]
    net2, opt2 = build(MPI.COMM_SELF, "exact", seed=3)
    extra = _load(path, net2, opt2)
    return want, [p.detach().clone() for p in net2.parameters()], extra
