"""Rank-side checks of the training loop (mgrit.training.Trainer): data-parallel replicas with
empty shards, resume after an interruption, NaN layer naming, checkpoint failures and
mismatches. float64 throughout; references are plain PyTorch loops written here."""
from __future__ import annotations

import os
import resource
import time

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, serial_resnet
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid
import mgrit.training.checkpoint as ck
from mgrit.training import Trainer
from mgrit.training.checkpoint import CheckpointError
from tests.mpi_cases.training.interrupt import Stop, StopAt

WIDTH, D_IN, CLASSES = 4, 3, 3


def data(n=41, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, D_IN, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (n,), generator=g))


def _ends():
    torch.manual_seed(1000)
    return nn.Linear(D_IN, WIDTH), nn.Linear(WIDTH, CLASSES)


def serial_net(n_layers=6):
    torch.set_default_dtype(torch.float64)
    layers = serial_resnet(lambda k: DenseStep(WIDTH, "tanh"), n_layers, seed=0)
    opening, closing = _ends()
    return nn.Sequential(opening, *layers, closing)


def mgrit_net(comm, n_layers=6, tol=1e-14, levels=2, warm=None):
    torch.set_default_dtype(torch.float64)
    o = MGRITOptions(max_levels=levels, cfactor=2, tol=tol, max_iter=60 if tol else 2)
    ob = MGRITOptions(max_levels=levels, cfactor=2, tol=tol, max_iter=60 if tol else 1)
    resnet = LayerParallelResNet.build(lambda k: DenseStep(WIDTH, "tanh"), n_layers, (WIDTH,),
                                       comm=comm, seed=0, forward=o, backward=ob, warm_start=warm)
    opening, closing = _ends()
    return LayerParallelNet(opening, resnet, closing)


def _params(net) -> list:
    """Global state of a serial or layer-parallel net, on every rank, as float64 tensors."""
    if isinstance(net, LayerParallelNet):
        sd = net.comm.bcast(net.gather_state_dict(), root=0)
    else:
        sd = net.state_dict()
    return [sd[k].detach().clone() for k in sorted(sd)]


def _max_rel(a, b) -> float:
    return max(float((x - y).abs().max() / max(float(y.abs().max()), 1e-30)) for x, y in zip(a, b))


# -- issue 13 item 5: a last batch smaller than the replica count ------------------------------
def check_dp_small_last_batch(kind):
    """41 samples, batch 20: the last global batch has 1 sample for 2 replicas (replica 1's
    shard is empty). 2 epochs on P_D = 2 equal the single-replica run (COMM_SELF) to 1e-12,
    and the epoch loss counts all 41 samples."""
    comm = MPI.COMM_WORLD
    x, y = data()
    make = (lambda c: serial_net()) if kind == "serial" else (lambda c: mgrit_net(c))
    ref_net = make(MPI.COMM_SELF)
    ref = Trainer(ref_net, torch.optim.SGD(ref_net.parameters(), lr=0.1, momentum=0.9))
    want = ref.fit((x, y), epochs=2, batch_size=20, seed=3)
    grid = ProcessGrid(comm, data_parallel=comm.Get_size())
    net = make(grid.layer_comm)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), grid)
    got = trainer.fit((x, y), epochs=2, batch_size=20, seed=3)
    err = _max_rel(_params(net), _params(ref_net))
    assert err <= 1e-12, err
    for k in ("loss", "train_acc"):
        assert abs(got.final[k] - want.final[k]) <= 1e-12, (k, got.final, want.final)
    assert trainer.steps_done == 6, trainer.steps_done  # 3 batches per epoch, none dropped
    grid.free()
    return err


# -- resume after an interruption --------------------------------------------------------------
def check_resume_after_interruption(kind, ckpt_dir):
    """Interrupted at step 5 (checkpoint every 2 steps, 3 epochs of 3 batches) and resumed
    with a fresh network and optimizer: the history equals the uninterrupted fit bit for bit
    (serial with 2 replicas; inexact MGRIT with warm start on 2 layer ranks)."""
    comm = MPI.COMM_WORLD
    x, y = data()
    tx, ty = data(17, seed=9)
    if kind == "serial":
        grid = ProcessGrid(comm, data_parallel=comm.Get_size())
        make = lambda: serial_net()  # noqa: E731
    else:
        grid = ProcessGrid(comm, data_parallel=1)
        make = lambda: mgrit_net(grid.layer_comm, tol=0.0)  # noqa: E731
    path = os.path.join(ckpt_dir, f"resume-{kind}-P{comm.Get_size()}.pt")

    def trainer(callbacks=()):
        net = make()
        return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), grid,
                       callbacks=list(callbacks), checkpoint=path, checkpoint_every=2)

    fit = dict(epochs=3, batch_size=16, seed=4, test=(tx, ty))
    want = trainer().fit((x, y), **fit)
    try:
        trainer([StopAt(5)]).fit((x, y), **fit)
    except Stop:
        pass
    resumed = trainer()
    got = resumed.fit((x, y), **fit, resume=path)
    assert got.plan.start_epoch == 1 and got.plan.start_batch == 1, got.plan
    for k in ("loss", "train_acc", "test_acc", "test_loss", "fwd_residual_mean"):
        assert got.history[k] == want.history[k], (k, got.history[k], want.history[k])
    assert resumed.steps_done == want.steps == 9
    return got.history["loss"]


# -- issue 13 item 8: a NaN residual names the layer -----------------------------------------
def check_nan_names_layer():
    """NaN bias in layer 5 of 8: trainer.step raises FloatingPointError on every rank naming
    x_6, the output of layer 5 (the input of layer 6)."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm)
    net = mgrit_net(grid.layer_comm, n_layers=8, tol=0.0)
    for j, s in enumerate(net.resnet.steps):
        if net.resnet.first + j == 5:
            with torch.no_grad():
                s.linear.bias.fill_(float("nan"))
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), grid)
    x, y = data(8)
    try:
        trainer.step(x, y)
    except FloatingPointError as exc:
        err = exc
    else:
        raise AssertionError("no FloatingPointError")
    msg = str(err)
    assert "x_6 (input of layer 6)" in msg and "forward" in msg, msg
    assert getattr(err, "layerpar_phase", None) == "forward relaxation", err.__dict__
    everyone = comm.allgather(msg)
    assert len(set(everyone)) == 1, everyone
    return msg


# -- issue 13 item 6: failures while saving ----------------------------------------------------
def _trained(grid):
    net = mgrit_net(grid.layer_comm, tol=0.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(net, opt, grid)
    x, y = data()
    trainer.step(x[:10], y[:10])
    return trainer


def check_save_failure(where, ckpt_dir):
    """A good checkpoint, one more step, then a save that fails on one rank: on rank 0 in
    torch's writer (file-size limit: RuntimeError, not OSError), or on rank 1 while preparing
    its part. Every rank raises CheckpointError naming the failing rank within seconds; the
    previous checkpoint still loads and holds the weights of the first save."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm)
    path = os.path.join(ckpt_dir, f"fail-{where}-P{comm.Get_size()}.pt")
    trainer = _trained(grid)
    trainer.save(path)
    saved = _params(trainer.net)
    x, y = data()
    trainer.step(x[10:20], y[10:20])
    failing = 0 if where == "write" else 1
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    original = ck.rng_state

    def broken():
        raise RuntimeError("simulated failure while collecting the RNG state")

    if comm.Get_rank() == failing:
        if where == "write":
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, old_limit[1]))
        else:
            ck.rng_state = broken
    t0 = time.time()
    try:
        trainer.save(path)
    except CheckpointError as exc:
        msg = str(exc)
    else:
        raise AssertionError("the failing save raised nothing")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        ck.rng_state = original
    elapsed = time.time() - t0
    assert elapsed < 10, elapsed
    assert f"rank {failing}:" in msg and "previous checkpoint" in msg, msg
    if where == "write":
        assert "RuntimeError" in msg or "OSError" in msg, msg
    assert len(set(comm.allgather(msg))) == 1
    assert not os.path.exists(path + ".tmp")
    net = mgrit_net(grid.layer_comm, tol=0.0)
    fresh = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), grid)
    fresh.load(path)
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh.net), saved))
    return msg


# -- issue 13 item 6: resuming into something else ---------------------------------------------
def check_mismatch_messages(ckpt_dir):
    """SGD checkpoint into Adam; other training data; another layer count; another width:
    one clear ValueError each, the same on every rank, naming what differs."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm)
    path = os.path.join(ckpt_dir, f"mismatch-P{comm.Get_size()}.pt")
    x, y = data()
    net = mgrit_net(grid.layer_comm, tol=0.0)
    Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), grid,
            checkpoint=path).fit((x, y), epochs=1, batch_size=20, seed=0)
    cases = []

    def expect(label, fn, *texts):
        try:
            fn()
        except ValueError as exc:
            msg = str(exc)
        else:
            raise AssertionError(f"{label}: no ValueError")
        assert all(t in msg for t in texts), (label, msg)
        assert len(set(comm.allgather(msg))) == 1, (label, msg)
        cases.append(msg)

    def fit_with(net, opt, data_xy):
        Trainer(net, opt, grid).fit(data_xy, epochs=2, batch_size=20, seed=0, resume=path)

    n2 = mgrit_net(grid.layer_comm, tol=0.0)
    expect("adam", lambda: fit_with(n2, torch.optim.Adam(n2.parameters()), (x, y)),
           "optimizer: SGD in the checkpoint, Adam in this run")
    n3 = mgrit_net(grid.layer_comm, tol=0.0)
    x2, y2 = data(41, seed=6)
    expect("data", lambda: fit_with(n3, torch.optim.SGD(n3.parameters(), lr=0.1), (x2, y2)),
           "training data: 41 samples of shape (3,), checksum")
    n4 = mgrit_net(grid.layer_comm, n_layers=8, tol=0.0)
    expect("layers", lambda: fit_with(n4, torch.optim.SGD(n4.parameters(), lr=0.1), (x, y)),
           "residual layers: [6] in the checkpoint, [8] in the model")
    return cases


# -- checkpoints of serial and layer-parallel networks load into each other --------------------
def check_serial_checkpoint_into_mgrit(ckpt_dir):
    """A serial network on 2 replicas saves after epoch 1; a layer-parallel network on 2 layer
    ranks (exact MGRIT) resumes from that file and ends epoch 2 where the uninterrupted serial
    run ends (1e-12): same global keys, optimizer state and schedule."""
    comm = MPI.COMM_WORLD
    x, y = data()
    path = os.path.join(ckpt_dir, f"cross-P{comm.Get_size()}.pt")
    replicas = ProcessGrid(comm, data_parallel=comm.Get_size())
    net = serial_net()
    Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), replicas,
            checkpoint=path).fit((x, y), epochs=1, batch_size=16, seed=2)
    net = serial_net()
    want = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                   replicas).fit((x, y), epochs=2, batch_size=16, seed=2)
    layers = ProcessGrid(comm, data_parallel=1)
    lp = mgrit_net(layers.layer_comm)
    got = Trainer(lp, torch.optim.SGD(lp.parameters(), lr=0.1, momentum=0.9),
                  layers).fit((x, y), epochs=2, batch_size=16, seed=2, resume=path)
    assert any("serial network loaded into a layer-parallel" in n for n in got.plan.notes), \
        got.plan.notes
    err = _max_rel(_params(lp), _params(net))
    assert err <= 1e-12, err
    assert abs(got.final["loss"] - want.final["loss"]) <= 1e-12, (got.final, want.final)
    return err
