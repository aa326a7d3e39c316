"""MPI checks of the one training loop for layer-wise methods and of synchronized BatchNorm in
:class:`mgrit.training.Trainer` (run through tests/mpi_cases/training/layerwise_cases.py:check_many).

References are plain loops written here with torch and mpi4py only (no ``layerwise`` trainer,
no Trainer): the global-batch schedule ``default_rng([seed, epoch]).permutation(n)`` split
with ``np.array_split`` over the replicas, each replica's loss its share of the global mean
loss, gradients summed over the replicas and scaled by ``1 / R``, one optimizer per stage,
frozen-layer features computed once per stage, evaluation in chunks. Regression
(``loss="mse"``): each replica's share ``F.mse_loss(out, y, reduction="sum") / D * R / B``
(the plain mean for equal shards), test metric the MSE over samples and outputs, no
accuracy."""
from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from layerwise import build_method, make_head, train_layerwise
from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid
from mgrit.training import Trainer
from tests.mpi_cases.training.interrupt import Stop, StopAt


def _layers(seed=0, depth=3, width=10, d_in=12):
    torch.manual_seed(seed)
    dims = [d_in] + [width] * depth
    return [nn.Sequential(nn.Linear(a, b), nn.Tanh()).double() for a, b in zip(dims, dims[1:])]


def _data(n, seed, d=12, classes=4, mse=False):
    """Inputs and int64 labels, or (``mse``) float64 targets ``(n, classes)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if mse:
        return x, torch.randn(n, classes, generator=g, dtype=torch.float64)
    return x, torch.randint(0, classes, (n,), generator=g)


def _share_loss(logits, y, global_batch, R):
    """This replica's share of the global mean cross-entropy or MSE (float targets) -- its
    mean for equal shards."""
    mse = y.is_floating_point()
    if len(y) * R == global_batch:
        return F.mse_loss(logits, y) if mse else F.cross_entropy(logits, y)
    if mse:  # the sum over samples of each sample's mean over its D outputs
        return F.mse_loss(logits, y, reduction="sum") / logits.shape[1] * (R / global_batch)
    return F.cross_entropy(logits, y, reduction="sum") * (R / global_batch)


def _correct(logits, y):
    """Correct argmax predictions; NaN for regression targets (no accuracy)."""
    return float("nan") if y.is_floating_point() else (logits.argmax(1) == y).sum().item()


def _mean_over_replicas(params, comm):
    for p in params:
        if comm.Get_size() > 1:
            g = p.grad.detach().numpy()
            comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            p.grad.mul_(1.0 / comm.Get_size())


def _test_acc(forward, tx, ty, comm, chunk):
    """Accuracy of ``forward`` on this replica's contiguous share of the test set, summed
    (regression targets: the MSE over samples and outputs)."""
    idx = np.array_split(np.arange(len(ty)), comm.Get_size())[comm.Get_rank()]
    tot = np.zeros(2)
    with torch.no_grad():
        for s in range(0, len(idx), chunk):
            j = torch.as_tensor(idx[s:s + chunk])
            out = forward(tx[j])
            if ty.is_floating_point():
                tot += [(F.mse_loss(out, ty[j], reduction="sum") / out.shape[1]).item(), len(j)]
            else:
                tot += [(out.argmax(1) == ty[j]).sum().item(), len(j)]
    tot = comm.allreduce(tot)
    return tot[0] / tot[1]


def _acc(total, count):
    return None if np.isnan(total) else total / count


def _plain_sequential(comm, x, y, tx, ty, epl, head_epochs, B, lr, seed, chunk):
    """Sequential layer-wise training (grow at the top, SGD momentum 0.9) as a plain loop."""
    R, r = comm.Get_size(), comm.Get_rank()
    layers = _layers()
    heads = []
    for k in range(len(layers)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 7919 * k)
            heads.append(make_head("linear", (10,), 4, dtype=torch.float64))
    stages = [([layers[k], heads[k]], epl) for k in range(len(layers))] + \
        [([heads[-1]], head_epochs)]
    feats, tfeats, e, hist = x, tx, 0, []
    for k, (mods, epochs) in enumerate(stages):
        net = nn.Sequential(*mods)
        params = list(net.parameters())
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
        for _ in range(epochs):
            perm = np.random.default_rng([seed, e]).permutation(len(y))
            tot = np.zeros(3)
            net.train()
            for s in range(0, len(y), B):
                batch = perm[s:s + B]
                mine = torch.as_tensor(np.array_split(batch, R)[r])
                logits = net(feats[mine])
                loss = _share_loss(logits, y[mine], len(batch), R)
                opt.zero_grad()
                loss.backward()
                _mean_over_replicas(params, comm)
                opt.step()
                value = loss.item() if len(mine) * R == len(batch) else \
                    loss.item() * (len(batch) / R) / max(len(mine), 1)
                if len(mine):
                    tot += [value * len(mine), _correct(logits, y[mine]), len(mine)]
            tot = comm.allreduce(tot)
            net.eval()
            hist.append([tot[0] / tot[2], _acc(tot[1], tot[2]),
                         _test_acc(net, tfeats, ty, comm, chunk)])
            e += 1
        if k < len(layers):  # freeze layer k: its outputs are the next stage's inputs
            with torch.no_grad():
                layers[k].eval()
                feats = torch.cat([layers[k](feats[i:i + chunk]) for i in range(0, len(feats), chunk)])
                tfeats = torch.cat([layers[k](tfeats[i:i + chunk]) for i in range(0, len(tfeats), chunk)])
    return hist


def _plain_dgl(x, y, tx, ty, K, epochs, B, lr, seed, chunk):
    """DGL with K stages (one per layer), SGD momentum 0.9, one process (every stage here)."""
    layers = _layers()[:K]
    heads = []
    for k in range(K):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 7919 * k)
            heads.append(make_head("linear", (10,), 4, dtype=torch.float64))
    opts = [torch.optim.SGD([*layers[k].parameters(), *heads[k].parameters()], lr=lr,
                            momentum=0.9) for k in range(K)]
    hist = []
    for e in range(epochs):
        perm = np.random.default_rng([seed, e]).permutation(len(y))
        tot = np.zeros(3)
        for m in (*layers, *heads):
            m.train()
        for s in range(0, len(y), B):
            j = torch.as_tensor(perm[s:s + B])
            h, yb = x[j], y[j]
            for k in range(K):
                out = layers[k](h)
                logits = heads[k](out)
                loss = F.mse_loss(logits, yb) if yb.is_floating_point() else \
                    F.cross_entropy(logits, yb)
                opts[k].zero_grad()
                loss.backward()
                opts[k].step()
                h = out.detach()
            tot += [loss.item() * len(j), _correct(logits, yb), len(j)]
        for m in (*layers, *heads):
            m.eval()

        def forward(t):
            for layer in layers:
                t = layer(t)
            return heads[-1](t)
        hist.append([tot[0] / tot[2], _acc(tot[1], tot[2]),
                     _test_acc(forward, tx, ty, MPI.COMM_SELF, chunk)])
    return hist


def check_layerwise_loop_equals_plain_loop(method, n=45, B=8, loss="cross_entropy"):
    """train_layerwise (the Trainer) equals the plain loops above bit for bit: per-epoch loss,
    train and test accuracy (``loss="mse"``: train accuracy None, test MSE; float64;
    sequential on comm-size replicas with an unequal last batch, decoupled one stage per
    layer rank)."""
    comm = MPI.COMM_WORLD
    mse = loss == "mse"
    x, y = _data(n, 1, mse=mse)
    tx, ty = _data(23, 2, mse=mse)
    if method == "sequential":
        grid = ProcessGrid(comm, data_parallel=comm.Get_size())
        want = _plain_sequential(grid.data_comm, x, y, tx, ty, 2, 1, B, 0.05, 4, 7)
        res = train_layerwise("sequential", _layers(), 4, x, y, tx, ty, grid=grid, epochs=2,
                              head_epochs=1, batch_size=B, lr=0.05, seed=4, eval_batch_size=7,
                              progress=False, loss=loss)
    else:
        grid = ProcessGrid(comm, data_parallel=1)
        want = _plain_dgl(x, y, tx, ty, grid.layer_size, 3, B, 0.05, 4, 7)
        res = train_layerwise("decoupled", _layers()[:grid.layer_size], 4, x, y, tx, ty,
                              grid=grid, epochs=3, batch_size=B, lr=0.05, seed=4,
                              eval_batch_size=7, progress=False, loss=loss)
    got = [[a, b, c] for a, b, c in zip(res["loss"], res["train_acc"],
                                        res["test_loss" if mse else "test_acc"])]
    if mse:
        assert all(a is None for a in res["test_acc"]) and res["final"]["acc"] is None
        assert abs(res["final"]["loss"] - got[-1][2]) <= 1e-12, (res["final"], got[-1])
    assert got == want, (got, want)
    grid.free()
    return len(got)


def check_layerwise_resume(method, stop=11, every=4, n=45, B=8):
    """A layer-wise run interrupted after step ``stop`` (inside an epoch and, sequential, inside
    a stage) and resumed from its last checkpoint (step ``every * (stop // every)``) ends with
    the metrics of the uninterrupted run, bit for bit (same grid)."""
    comm = MPI.COMM_WORLD
    x, y = _data(n, 1)
    tx, ty = _data(23, 2)
    dp = comm.Get_size() if method == "sequential" else 1
    kw = dict(epochs=2, head_epochs=1) if method == "sequential" else {}
    path = comm.bcast(os.path.join(tempfile.mkdtemp(), "ckpt.pt") if comm.Get_rank() == 0
                      else None)

    def run(stop_at=None, resume=None):
        grid = ProcessGrid(comm, data_parallel=dp)  # a fresh communicator per run
        layers = _layers()[:3 if method == "sequential" else grid.layer_size]
        m = build_method(method, layers, 4, (12,), grid=grid, lr=0.05, seed=4, **kw)
        epochs = len(m.plan) if method == "sequential" else 3
        t = Trainer(m, None, grid, checkpoint=path, checkpoint_every=every, eval_batch_size=7,
                    callbacks=[] if stop_at is None else [StopAt(stop_at)])
        try:
            return t.fit((x, y), epochs=epochs, batch_size=B, seed=4, test=(tx, ty),
                         resume=resume).history
        except Stop:
            return None

    full = run()
    assert run(stop_at=stop) is None
    resumed = run(resume=path)
    keys = ("loss", "train_acc", "test_acc", "test_loss")
    assert all(resumed[k] == full[k] for k in keys), (resumed, full)
    return len(full["loss"])


# -- synchronized BatchNorm in the Trainer (end to end) -------------------------------------------
def _bn_net(kind, comm):
    """float64: Linear-BatchNorm opening, dense residual layers, BatchNorm-Linear closing;
    ``kind="serial"`` an nn.Sequential, ``"mgrit"`` a LayerParallelNet on ``comm`` (exact)."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1000)
    opening = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh())
    closing = nn.Sequential(nn.BatchNorm1d(4, momentum=None), nn.Linear(4, 3))
    if kind == "serial":
        torch.manual_seed(0)
        return nn.Sequential(opening, nn.Linear(4, 4), nn.Tanh(), closing)
    o = MGRITOptions(max_levels=2, cfactor=2, tol=1e-14, max_iter=60)
    resnet = LayerParallelResNet.build(lambda k: DenseStep(4, "tanh"), 4, (4,), comm=comm,
                                       seed=0, forward=o, backward=o)
    return LayerParallelNet(opening, resnet, closing)


def check_trainer_batchnorm_replicas(kind="serial", layer_parallel=1, n=38, B=7):
    """BatchNorm in the Trainer with replicas (statistics of the global batch) equals one
    replica: per-epoch losses/accuracies, parameters and running statistics <= 1e-12 (float64;
    unequal shards, and an empty one when the last batch has fewer samples than replicas);
    replicas hold bitwise equal running statistics. Returns the largest difference."""
    comm = MPI.COMM_WORLD
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)

    def fit(net, grid):
        t = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), grid)
        return t.fit((x, y), epochs=2, batch_size=B, seed=3, test=(x[:9], y[:9])).history

    ref_net = _bn_net(kind, MPI.COMM_SELF)
    want = fit(ref_net, None)
    grid = ProcessGrid(comm, data_parallel=comm.Get_size() // layer_parallel)
    net = _bn_net(kind, grid.layer_comm)
    got = fit(net, grid)
    diff = max(abs(a - b) for k in ("loss", "train_acc", "test_acc", "test_loss")
               for a, b in zip(got[k], want[k]))
    if kind == "serial":
        mine, ref = net.state_dict(), ref_net.state_dict()
    else:
        mine = net.comm.bcast(net.gather_state_dict(), root=0)
        ref = ref_net.gather_state_dict()
    for k in ref:
        diff = max(diff, float((mine[k].double() - ref[k].double()).abs().max()))
    assert diff <= 1e-12, diff
    bn = np.concatenate([b.double().numpy().ravel() for name, b in net.named_buffers()
                         if "running" in name])
    everyone = grid.data_comm.allgather(bn)
    assert all(np.array_equal(e, everyone[0]) for e in everyone), "replicas' statistics differ"
    grid.free()
    return diff
