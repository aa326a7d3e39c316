"""Rank-side checks of the gradient-bias monitor (mgrit.training.bias): the estimator against
plain gathering of the inexact gradients and serial autograd on the same weights (float64),
the same decisions on every rank, no trace on training when it never acts, and resume with
its state. References are computed here from ``to_serial()`` copies and ``.grad`` values."""
from __future__ import annotations

import os

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid
from mgrit.training import Trainer
from mgrit.training.bias import BiasMonitor, measure_bias
from tests.mpi_cases.training.interrupt import Stop, StopAt

WIDTH, D_IN, CLASSES, N_LAYERS = 3, 3, 3, 7


def data(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, D_IN, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (n,), generator=g))


def make_net(comm, levels=2, iters=(1, 1), warm=False):
    """7 tanh layers, T = 4 (large steps: one F-relaxation cycle is far from exact), float64
    (the caller's default dtype is left alone)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _build(comm, levels, iters, warm)
    finally:
        torch.set_default_dtype(old)


def _build(comm, levels, iters, warm):
    o = MGRITOptions(max_levels=levels, cfactor=2, tol=0.0, max_iter=iters[0], relax="F")
    ob = MGRITOptions(max_levels=levels, cfactor=2, tol=0.0, max_iter=iters[1], relax="F")
    resnet = LayerParallelResNet.build(lambda k: DenseStep(WIDTH, "tanh"), N_LAYERS, (WIDTH,),
                                       comm=comm, seed=0, T=4.0, forward=o, backward=ob,
                                       warm_start=warm)
    torch.manual_seed(1000)
    return LayerParallelNet(nn.Linear(D_IN, WIDTH), resnet, nn.Linear(WIDTH, CLASSES))


def _shards(n_total, dp):
    """Unequal shard sizes (tests the sample weights): 13 -> [13] or [7, 6]."""
    sizes = [n_total - (n_total // dp) * (dp - 1)] + [n_total // dp] * (dp - 1)
    bounds = [sum(sizes[:r]) for r in range(dp + 1)]
    return [(bounds[r], bounds[r + 1]) for r in range(dp)]


def _reference(net, grid, x, y, shards, M):
    """(bias, noise, |G|) from gathered ``.grad`` (the inexact replica gradients, weighted by
    shard size) and serial autograd on a ``to_serial()`` copy, micro-batch by micro-batch."""
    N = len(y)
    lo, hi = shards[grid.data_rank]
    w = (hi - lo) / N
    mine = {k: w * p.grad.detach().clone() for k, p in net.named_global_parameters()}
    g = {}
    for part in grid.comm.allgather(mine):
        for k, v in part.items():
            g[k] = g[k] + v if k in g else v
    serial = net.to_serial()
    micro = []
    for a, b in shards:
        for idx in torch.arange(b - a).tensor_split(min(M, b - a)):
            serial.zero_grad()
            F.cross_entropy(serial(x[a:b][idx]), y[a:b][idx]).backward()
            micro.append((len(idx), {k: p.grad.clone() for k, p in serial.named_parameters()}))
    keys = sorted(g)
    vec = lambda d: torch.cat([d[k].reshape(-1) for k in keys])  # noqa: E731
    G = sum(n_j / N * vec(d) for n_j, d in micro)
    b = float((vec(g) - G).norm())
    s2 = sum(n_j * float(((vec(d) - G) ** 2).sum()) for n_j, d in micro) / ((len(micro) - 1) * N)
    return b, s2 ** 0.5, float(G.norm())


def check_estimator(dp, levels=2):
    """measure_bias on P_L = world/dp layer ranks x dp replicas (13 samples, shards 7/6,
    3 micro-batches each) equals the reference to 1e-10 relative; the bias is far from zero
    (the inexact gradient really is inexact); the ``"converged"`` reference (tol 1e-13) agrees
    with the serial one to 1e-8; ``.grad`` tensors, options and warm flags are unchanged."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm, data_parallel=dp)
    net = make_net(grid.layer_comm, levels=levels)
    x, y = data(13)
    shards = _shards(len(y), dp)
    lo, hi = shards[grid.data_rank]
    net.zero_grad()
    net.loss(net(x[lo:hi]), y[lo:hi]).backward()
    params = [p for p in net.parameters()]
    objs, vals = [p.grad for p in params], [p.grad.clone() for p in params]
    seg = net.resnet
    opts = (seg.fwd_opts, seg.bwd_opts, seg.warm_start, seg.last_forward)
    est = measure_bias(net, x[lo:hi], y[lo:hi], grid, micro_batches=3)
    assert all(p.grad is o and torch.equal(o, v) for p, o, v in zip(params, objs, vals))
    assert (seg.fwd_opts, seg.bwd_opts, seg.warm_start, seg.last_forward) == opts
    assert seg.fwd_opts is opts[0] and seg.bwd_opts is opts[1]
    conv = measure_bias(net, x[lo:hi], y[lo:hi], grid, micro_batches=3, reference="converged",
                        reference_tol=1e-13, reference_max_iter=60)
    b, s, gn = _reference(net, grid, x, y, shards, 3)
    errs = [abs(est.bias - b) / b, abs(est.noise - s) / s, abs(est.grad_norm - gn) / gn]
    assert max(errs) <= 1e-10, (errs, est, (b, s, gn))
    assert b > 1e-3 * gn, (b, gn)  # a real bias, not round-off
    assert est.micro_batches == 3 * dp and est.samples == 13, est
    assert abs(conv.bias - b) / b <= 1e-8 and abs(conv.noise - s) / s <= 1e-8, (conv, b, s)
    assert conv.reference_residual is not None and conv.reference_residual <= 1e-13, conv
    everyone = comm.allgather((est.bias, est.noise, est.grad_norm))
    assert len(set(everyone)) == 1, everyone
    return max(errs)


def _quiet(**kw):
    return BiasMonitor(print_fn=lambda s: None, **kw)


def check_same_decisions(dp, log_dir):
    """Trainer with a monitor that acts at once (every step, window 1, tiny ratio, caps 2):
    step 0 raises 1/1 -> 2/2 cycles, step 1 (caps reached) switches to serial, step 2 is not
    checked; every rank logs the same numbers and takes the same actions, and the network's
    solvers end one-level. Rank 0 of the grid writes the log."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm, data_parallel=dp)
    net = make_net(grid.layer_comm, warm=None)
    log = os.path.join(log_dir, f"decisions-{comm.Get_size()}-{dp}.jsonl")
    if comm.Get_rank() == 0 and os.path.exists(log):
        os.remove(log)
    comm.Barrier()
    mon = _quiet(action="raise", every=1, ratio=1e-6, window=1, micro_batches=2,
                 max_fwd_iters=2, max_bwd_iters=2, log_path=log)
    tr = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), grid,
                 callbacks=[mon])
    x, y = data(24)
    tr.fit((x, y), epochs=1, batch_size=8, seed=1)
    mine = [(e["step"], e["action"], e["bias"], e["noise"], e["options"]) for e in mon.events]
    everyone = comm.allgather(mine)
    assert all(m == everyone[0] for m in everyone), everyone
    assert [m[1] for m in mine] == ["raise", "serial"], mine
    assert mine[0][4] == [{"fwd_iters": 2, "bwd_iters": 2, "levels": 2}], mine
    assert net.resnet.fwd_opts.max_levels == net.resnet.bwd_opts.max_levels == 1
    comm.Barrier()
    if comm.Get_rank() == 0:
        with open(log) as fh:
            assert len(fh.readlines()) == 2
    return [m[1] for m in mine]


def check_no_trace(log_dir):
    """A monitor checking every step that never acts (ratio 1e9) leaves a warm-started
    inexact fit bit for bit unchanged (history and final weights)."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm)
    x, y = data(24)
    runs = []
    for cbs in ([], [_quiet(action="raise", every=1, ratio=1e9, micro_batches=2)]):
        net = make_net(grid.layer_comm, warm=None)
        tr = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), grid,
                     callbacks=cbs)
        res = tr.fit((x, y), epochs=2, batch_size=8, seed=1, test=data(9, seed=7))
        runs.append((res.history, [p.detach().clone() for p in net.parameters()]))
        if cbs:
            assert cbs[0].checks == 6 and all(e["action"] == "none" for e in cbs[0].events)
    (h0, w0), (h1, w1) = runs
    for k in ("loss", "train_acc", "test_acc", "test_loss", "fwd_residual_mean"):
        assert h0[k] == h1[k], (k, h0[k], h1[k])
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    return h1["loss"]


def check_resume(ckpt_dir):
    """Interrupted at step 5 (checkpoint every 2 steps) and resumed with a fresh network and
    monitor: the history, the monitor's state and the solver options equal the uninterrupted
    fit's (checks at steps 1, 3, 5: cycles 1/1 -> 2/2 -> 2/3 before the checkpoint at step 4,
    the switch to serial after it)."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm)
    x, y = data(41)
    path = os.path.join(ckpt_dir, f"bias-resume-P{comm.Get_size()}.pt")

    def trainer(extra=()):
        net = make_net(grid.layer_comm, warm=None)
        mon = _quiet(action="raise", every=2, ratio=1e-6, window=1, micro_batches=2,
                     max_fwd_iters=2, max_bwd_iters=3)
        tr = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), grid,
                     callbacks=[mon, *extra], checkpoint=path, checkpoint_every=2)
        return tr, mon

    fit = dict(epochs=3, batch_size=16, seed=4, test=data(17, seed=9))
    tr, mon = trainer()
    want = tr.fit((x, y), **fit)
    want_state, want_opts = mon.state_dict(), (tr.net.resnet.fwd_opts, tr.net.resnet.bwd_opts)
    try:
        trainer([StopAt(5)])[0].fit((x, y), **fit)
    except Stop:
        pass
    tr, mon = trainer()
    got = tr.fit((x, y), **fit, resume=path)
    for k in ("loss", "train_acc", "test_acc", "test_loss", "fwd_residual_mean"):
        assert got.history[k] == want.history[k], (k, got.history[k], want.history[k])
    assert mon.state_dict() == want_state, (mon.state_dict(), want_state)
    assert (tr.net.resnet.fwd_opts, tr.net.resnet.bwd_opts) == want_opts
    assert want_state["options"] == [[2, 3]] and want_state["serial"] is True, want_state
    return got.history["loss"]
