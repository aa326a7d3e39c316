"""Depth transfer and MG/Opt checks run on k ranks by tests/multilevel/test_multilevel_mpi.py (float64).

Every rank builds the serial reference itself (same seeds) and compares: gathered weights
bitwise, outputs and gradients to the stated tolerances, errors raised on every rank.
"""
import math

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.grid import Partition
from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, ResidualStep
from mgrit.nn.depth import DepthTransfer, prolong, restrict, transfer_weights
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid
from mgrit.multilevel.mgopt import MGOpt, MGOptOptions

COMM = MPI.COMM_WORLD
DT = torch.float64
W = 3
EXACT = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=60)


def _lp(n, T=1.0, seed=0, width=None, partition=None, comm=COMM):
    width = width or (lambda k: W)
    return LayerParallelResNet.build(lambda k: DenseStep(width(k), "tanh").to(DT), n, (W,),
                                     comm=comm, seed=seed, T=T, forward=EXACT, backward=EXACT,
                                     partition=partition)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _gathered(model):
    """Global state dict on every rank."""
    return COMM.bcast(model.gather_state_dict(), root=0)


def _serial_dict(seq):
    return {f"{k}.{n}": t for k, s in enumerate(seq) for n, t in s.F.state_dict().items()}


def check_depth_transfer():
    """Prolongation/restriction of a layer-parallel ResNet equal the serial operators bitwise,
    round trips are exact, and differently partitioned networks exchange weights."""
    coarse = _lp(6, T=1.5, seed=4)
    ser = coarse.to_serial()
    for method in ("constant", "linear"):
        fine = prolong(coarse, method=method)
        assert fine.n_layers == 12 and fine.h == 1.5 / 12
        got = _gathered(fine)
        assert _same(got, _serial_dict(prolong(ser, method=method))), method
        for k in range(6):  # by hand
            for n in ("linear.weight", "linear.bias"):
                c0 = _serial_dict(ser)[f"{k}.{n}"]
                assert torch.equal(got[f"{2 * k}.{n}"], c0)
                c1 = _serial_dict(ser)[f"{min(k + 1, 5)}.{n}"]
                mid = c0 if method == "constant" or k == 5 else (c0 + c1) * 0.5
                assert torch.equal(got[f"{2 * k + 1}.{n}"], mid)
        for r in ("injection", "average") if method == "constant" else ("injection",):
            back = restrict(fine, method=r)
            assert _same(_gathered(back), _serial_dict(ser)), (method, r)
    # destination with an uneven partition; serial <-> layer-parallel both ways
    P = COMM.Get_size()
    sizes = [12 - (P - 1)] + [1] * (P - 1)
    odd = _lp(12, T=1.5, seed=9, partition=Partition(12, sizes))
    transfer_weights(coarse, odd, "linear")
    assert _same(_gathered(odd), _serial_dict(prolong(ser, method="linear")))
    back = _lp(6, T=1.5, seed=10)
    transfer_weights(odd, back, "injection")
    assert _same(_gathered(back), _serial_dict(ser))
    seq = prolong(ser, method="linear")
    to_serial = restrict(seq, method="average")
    lp_from_serial = _lp(6, T=1.5, seed=11)
    transfer_weights(seq, lp_from_serial, "average")
    assert _same(_gathered(lp_from_serial), _serial_dict(to_serial))
    serial_from_lp = restrict(seq, method="average")
    transfer_weights(odd, serial_from_lp, "average")
    assert _same(_serial_dict(serial_from_lp), _serial_dict(to_serial))
    # DepthTransfer adjoint across ranks: <P u, g> = <u, P^T g> (global sums)
    Pop = DepthTransfer(coarse, odd, "linear")
    g = torch.Generator().manual_seed(100 + COMM.rank)
    u = [torch.randn(p.shape, dtype=DT, generator=g) for p in coarse.parameters()]
    v = [torch.randn(p.shape, dtype=DT, generator=g) for p in odd.parameters()]
    lhs = COMM.allreduce(sum(float((a * b).sum()) for a, b in zip(Pop(u), v)))
    rhs = COMM.allreduce(sum(float((a * b).sum()) for a, b in zip(u, Pop.adjoint()(v))))
    assert abs(lhs - rhs) <= 1e-13 * abs(lhs), (lhs, rhs)
    # a network of two segments with ordinary modules around and between them
    torch.manual_seed(5)
    net = LayerParallelNet(nn.Linear(2, W).to(DT), _lp(4, T=1.0, seed=1), nn.Tanh(),
                           _lp(6, T=2.0, seed=2), nn.Linear(W, 2).to(DT))
    ser = net.to_serial()
    for method in ("constant", "linear"):
        fine = prolong(net, 2, method)
        assert [s.n_layers for s in fine.segments] == [8, 12]
        got = COMM.bcast(fine.gather_state_dict(), root=0)
        assert _same(got, prolong(ser, 2, method).state_dict()), method
        back = COMM.bcast(restrict(fine, 2, "injection").gather_state_dict(), root=0)
        assert _same(back, ser.state_dict())
    return "ok"


def _smooth(n, T=1.0):
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(W, W, generator=g, dtype=DT), torch.randn(W, W, generator=g, dtype=DT)
    a, b = torch.randn(W, generator=g, dtype=DT), torch.randn(W, generator=g, dtype=DT)
    model = _lp(n, T)
    with torch.no_grad():
        for j, s in enumerate(model.steps):
            t = (model.first + j) * T / n
            s.linear.weight.copy_(A * math.cos(2 * t) + B * t)
            s.linear.bias.copy_(a + b * math.sin(3 * t))
    return model


def check_depth_order(method):
    """A prolonged layer-parallel network reproduces the coarse one's output to O(h): error
    ratios for N = 8, 16, 32, 64 in [1.6, 2.4], equal to the serial errors to 1e-9."""
    x = torch.randn(8, W, dtype=DT, generator=torch.Generator().manual_seed(1))
    errs, serial_errs = [], []
    for n in (8, 16, 32, 64):
        coarse = _smooth(n)
        fine = prolong(coarse, method=method)
        with torch.no_grad():
            yc = coarse(x if coarse.is_first else None, batch_size=8)
            yf = fine(x if fine.is_first else None, batch_size=8)
        e = ((yf - yc).norm() / yc.norm()).item() if fine.is_last else None
        errs.append(COMM.bcast(e, root=COMM.Get_size() - 1))
        cs = coarse.to_serial()
        fs = prolong(cs, method=method)
        with torch.no_grad():
            serial_errs.append(((fs(x) - cs(x)).norm() / cs(x).norm()).item())
    ratios = [errs[i] / errs[i + 1] for i in range(3)]
    assert all(1.6 <= r <= 2.4 for r in ratios), (errs, ratios)
    assert all(abs(a - b) <= 1e-9 * b for a, b in zip(errs, serial_errs)), (errs, serial_errs)
    return [round(e, 8) for e in errs]


def check_depth_errors():
    """Errors found on one rank are raised on every rank, before any weight moves."""
    P, rank = COMM.Get_size(), COMM.Get_rank()
    coarse = _lp(4)
    # only the last rank's layers are wider: that rank alone sees the mismatch
    wide = _lp(8, width=lambda k: W + 1 if k >= 8 - 8 // P else W)
    try:
        transfer_weights(coarse, wide, "constant")
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("no error")
    assert "differ in class, structure or parameter shapes" in msg, msg
    msgs = COMM.allgather(msg)
    assert len(set(msgs)) == 1, msgs
    try:
        restrict(_lp(2 * P - 2 if P > 2 else 2), factor=2)
    except ValueError as e:
        assert "cannot be split over" in str(e), str(e)
    else:
        raise AssertionError("no error restricting below one layer per rank")
    return "ok"


# -- MG/Opt ----------------------------------------------------------------------------------
def _data(n=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, dtype=DT, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return x, y


def _net(n, comm=COMM):
    torch.manual_seed(7)
    opening, closing = nn.Linear(2, W).to(DT), nn.Linear(W, 4).to(DT)
    return LayerParallelNet(opening, _lp(n, seed=2, comm=comm), closing)


def _lp_closure(x, y):
    def closure(net, backward):
        out = net(x)
        loss = net.loss(out, y)
        if backward:
            loss.backward()
        return net.from_last(loss.item() if net.is_last else None)
    return closure


def _serial_closure(x, y):
    def closure(model, backward):
        loss = F.cross_entropy(model(x), y)
        if backward:
            loss.backward()
        return loss.item()
    return closure


def _sgd(ps, level):
    return torch.optim.SGD(ps, lr=0.3, momentum=0.5)


def check_mgopt_coherence():
    """grad F_H(R x) = R_g grad f_h(x) with a fresh layer-parallel coarse evaluation, 1e-12."""
    x, y = _data()
    net = _net(8)
    mg = MGOpt.from_fine(net, 2, _sgd)
    close = _lp_closure(x, y)
    mg.evaluate(0, close)
    g = mg._grads(0)
    v = mg.coarse_shift(0, close, g, reuse=False)
    mg.evaluate(1, close, shift=v)
    got, ref = [p.grad for p in mg.params[1]], mg.Rg[0](g)
    num = COMM.allreduce(sum(float((a - b).pow(2).sum()) for a, b in zip(got, ref)))
    den = COMM.allreduce(sum(float(b.pow(2).sum()) for b in ref))
    rel = math.sqrt(num / den)
    assert rel <= 1e-12, rel
    # against the serial driver on the same weights
    ser = net.to_serial()
    smg = MGOpt.from_fine(ser, 2, _sgd)
    sclose = _serial_closure(x, y)
    smg.evaluate(0, sclose)
    sv = smg.coarse_shift(0, sclose, smg._grads(0), reuse=False)
    svd = dict(zip([n for n, _ in smg.models[1].named_parameters()], sv))
    name_of = {id(p): n for n, p in mg.models[1].named_global_parameters()}
    names = [name_of[id(p)] for p in mg.models[1].parameters()]  # the order of v
    worst = max(((a - svd[n]).norm() / svd[n].norm().clamp_min(1e-300)).item()
                for n, a in zip(names, v))
    worst = COMM.allreduce(worst, op=MPI.MAX)
    assert worst <= 1e-9, worst
    return rel


def check_mgopt_layer_parallel(n, levels, cycles=3):
    """MG/Opt on a layer-parallel net equals MG/Opt on its serial copy (exact MGRIT): the
    records, and every local parameter to 1e-9 relative."""
    x, y = _data()
    net = _net(n)
    ser = net.to_serial()
    opts = MGOptOptions(prolong="linear", restrict="injection")
    mg = MGOpt.from_fine(net, levels, _sgd, opts)
    smg = MGOpt.from_fine(ser, levels, _sgd, opts)
    for _ in range(cycles):
        r = mg.step(_lp_closure(x, y))
        s = smg.step(_serial_closure(x, y))
        assert abs(r.loss - s.loss) <= 1e-10 * abs(s.loss) and r.alphas == s.alphas
        assert r.gradients == s.gradients and r.values == s.values
    ref = dict(ser.named_parameters())
    worst = max(((p - ref[k]).norm() / ref[k].norm()).item()
                for k, p in net.named_global_parameters())
    worst = COMM.allreduce(worst, op=MPI.MAX)
    assert worst <= 1e-9, worst
    return [round(r.loss, 10), worst < 1e-9]


def check_mgopt_data_parallel(cycles=3):
    """Data-parallel MG/Opt (every rank a replica, half a batch each) equals serial MG/Opt on the
    whole batch to 1e-12."""
    grid = ProcessGrid(COMM, data_parallel=COMM.Get_size())
    x, y = _data(n=12 * COMM.Get_size())
    per = x.shape[0] // grid.data_size
    xs, ys = x[grid.data_rank * per:(grid.data_rank + 1) * per], y[grid.data_rank * per:][:per]

    def serial_net():
        torch.manual_seed(7)
        steps = [ResidualStep(DenseStep(W, "tanh").to(DT), 1 / 8) for _ in range(8)]
        return nn.Sequential(nn.Linear(2, W).to(DT), *steps, nn.Linear(W, 4).to(DT))

    a, b = serial_net(), serial_net()
    mg = MGOpt.from_fine(a, 2, _sgd, grid=grid)
    smg = MGOpt.from_fine(b, 2, _sgd)
    for _ in range(cycles):
        r = mg.step(_serial_closure(xs, ys))
        s = smg.step(_serial_closure(x, y))
        assert abs(r.loss - s.loss) <= 1e-12 * abs(s.loss), (r.loss, s.loss)
        assert r.alphas == s.alphas
    worst = max(((p - q).norm() / q.norm()).item() for p, q in zip(a.parameters(), b.parameters()))
    assert worst <= 1e-12, worst
    # replicas stay identical
    digests = COMM.allgather([p.detach().clone() for p in a.parameters()])
    assert all(torch.equal(p, q) for d in digests for p, q in zip(d, digests[0]))
    grid.free()
    return worst


def check_mgopt_bad_closure():
    """A closure returning each rank's own loss tensor (not the last rank's value) raises the same
    ValueError on every rank instead of desynchronizing the line search."""
    x, y = _data()
    net = _net(8)
    mg = MGOpt.from_fine(net, 2, _sgd)

    def local_value(model, backward):
        loss = model.loss(model(x), y)
        if backward:
            loss.backward()
        return loss.item()  # a placeholder 0.0 away from the last rank

    try:
        mg.step(local_value)
    except ValueError as e:
        msg = str(e)
    else:
        raise AssertionError("no error")
    assert "ranks disagree on the objective value returned by the closure" in msg, msg
    assert len(set(COMM.allgather(msg))) == 1
    return "ok"


def check_mgopt_lbfgs_refused():
    net = _net(8)
    try:
        MGOpt.from_fine(net, 2, lambda ps, l: torch.optim.LBFGS(ps))
    except ValueError as e:
        assert "LBFGS is not allowed under a layer communicator" in str(e), str(e)
        return "ok"
    raise AssertionError("L-BFGS under layer parallelism was accepted")
