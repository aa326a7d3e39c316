"""Independent references for the main job (``experiments/train.py``): the same training
written as plain loops here -- model construction as the job documents it (opening seeded
with ``seed``, closing with ``seed + 7919``, layer ``k`` with ``layer_seed(seed, k)``), the
global-batch schedule ``default_rng([seed, epoch]).permutation(n)`` sharded with
``np.array_split``, zero_grad / forward / loss / backward / weighted gradient averaging /
step -- without :class:`mgrit.training.Trainer`, :mod:`mgrit.models` or the job's
code. Each returns per-epoch ``[loss, train_acc, test_acc, test_loss]``."""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from data import load_dataset
from layerwise import DecoupledModel, DecoupledPipeline, global_batches
from mgrit.nn import LayerParallelNet, LayerParallelResNet, ResidualStep, layer_seed, make_step
from mgrit.nn import serial_resnet
from mgrit.options import MGRITOptions
from mgrit.parallel import GradientBuckets, ProcessGrid


def _data(seed, limit_train, limit_test, dtype):
    train, test = load_dataset("digits", seed=seed, test_fraction=0.2, normalize=True,
                               flatten=False)
    cut = lambda a, n: np.asarray(a)[:n]  # noqa: E731
    return (torch.as_tensor(cut(train.x, limit_train), dtype=dtype),
            torch.as_tensor(cut(train.y, limit_train), dtype=torch.long),
            torch.as_tensor(cut(test.x, limit_test), dtype=dtype),
            torch.as_tensor(cut(test.y, limit_test), dtype=torch.long))


def _ends(seed, width, num_classes=10, d_in=64):
    torch.manual_seed(seed)
    opening = nn.Sequential(nn.Flatten(), nn.Linear(d_in, width), nn.Tanh())
    torch.manual_seed(seed + 7919)
    closing = nn.Sequential(nn.Flatten(), nn.Linear(width, num_classes))
    return opening, closing


def reference_end_to_end(method, seed=1, layers=8, width=8, levels=2, cfactor=2, epochs=2,
                         batch_size=48, limit_train=200, limit_test=100, lr=0.01,
                         momentum=0.9, eval_batch_size=500, dtype="float32"):
    """``--method mgrit`` (P_L = world, dp 1, inexact 2/1 cycles, warm start) or
    ``--method serial`` (dp = world) of the main job, as a plain loop."""
    dt = torch.float64 if dtype == "float64" else torch.float32
    torch.set_default_dtype(dt)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    x, y, tx, ty = _data(seed, limit_train, limit_test, dt)
    opening, closing = _ends(seed, width)
    make = lambda k: make_step("dense", width, "tanh", 3)  # noqa: E731
    if method == "mgrit":
        grid = ProcessGrid(comm, data_parallel=1)
        common = dict(max_levels=levels, cfactor=cfactor, relax=["F", "FCF"])
        resnet = LayerParallelResNet.build(
            make, layers, (width,), comm=grid.layer_comm, seed=seed, T=1.0,
            forward=MGRITOptions(tol=0, max_iter=2, **common),
            backward=MGRITOptions(tol=0, max_iter=1, **common))
        net = LayerParallelNet(opening, resnet, closing)
        is_last, share = net.is_last, net.from_last
        loss_of = lambda out, yb: net.loss(out, yb)  # noqa: E731
    else:
        grid = ProcessGrid(comm, data_parallel=comm.Get_size())
        net = nn.Sequential(opening, *serial_resnet(make, layers, T=1.0, seed=seed), closing)
        is_last, share, loss_of = True, (lambda v: v), F.cross_entropy
    net = net.to(dt)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    R, r = grid.data_size, grid.data_rank
    buckets = GradientBuckets(list(net.parameters()), grid.data_comm) if R > 1 else None

    def evaluate():
        idx = np.array_split(np.arange(len(ty)), R)[r]
        tot = np.zeros(3)
        with torch.no_grad():
            for s in range(0, len(idx), eval_batch_size):
                j = torch.as_tensor(idx[s:s + eval_batch_size])
                out = net(tx[j])
                if is_last:
                    yj = ty[j]
                    tot += [F.cross_entropy(out, yj, reduction="sum").item(),
                            (out.argmax(1) == yj).sum().item(), len(yj)]
        tot = grid.data_comm.allreduce(np.asarray(share(tot)))
        return tot[1] / tot[2], tot[0] / tot[2]

    evaluate()  # the job evaluates before training (no effect on the training numbers)
    history = []
    n = len(y)
    for epoch in range(epochs):
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        tot = np.zeros(3)
        for s in range(0, n, batch_size):
            batch = perm[s:s + batch_size]
            mine = np.array_split(batch, R)[r]
            if buckets is None:
                opt.zero_grad(set_to_none=True)
            else:
                buckets.zero_grad()
            if len(mine):
                j = torch.as_tensor(mine)
                out = net(x[j])
                loss = loss_of(out, y[j])
                loss.backward()
            if buckets is not None:
                buckets.average(weight=len(mine) / len(batch))
            opt.step()
            if len(mine):
                stats = ([loss.item() * len(mine), (out.argmax(1) == y[j]).sum().item(),
                          len(mine)] if is_last else None)
                tot += share(stats)
        tot = grid.data_comm.allreduce(tot)
        test_acc, test_loss = evaluate()
        history.append([tot[0] / tot[2], tot[1] / tot[2], test_acc, test_loss])
    grid.free()
    return [[float(v) for v in h] for h in history]


def reference_decoupled(seed=1, layers=8, width=8, epochs=2, batch_size=48, limit_train=200,
                        limit_test=100, lr=0.01, momentum=0.9, eval_batch_size=500):
    """``--method decoupled`` on P_L = world ranks (one stage per rank, dp 1): the DGL pipeline
    of ``layerwise`` driven epoch by epoch here. Returns ``[loss, train_acc, test_acc]``."""
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    x, y, tx, ty = _data(seed, limit_train, limit_test, torch.float32)
    opening, _ = _ends(seed, width)
    blocks = [opening]
    for k in range(layers):
        torch.manual_seed(layer_seed(seed, k))
        blocks.append(ResidualStep(make_step("dense", width, "tanh", 3), 1.0 / layers))
    grid = ProcessGrid(comm, data_parallel=1)
    model = DecoupledModel(blocks, 10, tuple(x.shape[1:]), num_stages=grid.layer_size,
                           head="linear", seed=seed)
    pipe = DecoupledPipeline(model, grid, stages_per_rank=1, optimizer="sgd", lr=lr,
                             momentum=momentum, weight_decay=0.0, seed=seed)
    history = []
    for e in range(epochs):
        rec = pipe.train_epoch(x, y, global_batches(len(x), batch_size, seed, e, 1))
        ev = pipe.evaluate(tx, ty, batch_size=eval_batch_size)
        history.append([float(rec["loss"]), float(rec["train_acc"]), float(ev["acc"])])
    grid.free()
    return history
