"""BatchNorm and Dropout/DropPath inside layer-parallel steps, run on k ranks by
tests/nn/test_stateful_steps.py (float64, exact mode: solves to 1e-13).

Reference: an independently built serial ``nn.Sequential`` (``serial_resnet``, same seeds,
same ordinary modules) trained by plain autograd and SGD on the same batches; with dropout the
serial layers draw the same masks from the same ``torch.manual_seed``. Several optimizer
steps; 7 layers (not divisible by 2, 3, 4 ranks); every rank checks what it holds.
"""
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import LayerParallelNet, LayerParallelResNet, TransformerStep, serial_resnet
from mgrit.nn.steps.stochastic import Dropout, DropPath
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid, ReplicaSync

COMM = MPI.COMM_WORLD
DT = torch.float64
N, T, W, C = 7, 1.0, 3, 2


class BNDense(nn.Module):
    """``tanh(BN(W x + b))`` with the cumulative-average BatchNorm (``momentum=None``)."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(W, W), nn.BatchNorm1d(W, momentum=None)

    def forward(self, x):
        return torch.tanh(self.bn(self.lin(x)))


class BNConv(nn.Module):
    """``conv-BN-tanh-conv-BN`` (a basic block's branch; momentum 0.1 and 0.3)."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C)
        self.c2, self.b2 = nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C, momentum=0.3)

    def forward(self, x):
        return self.b2(self.c2(torch.tanh(self.b1(self.c1(x)))))


class BNVariants(nn.Module):
    """``tanh(BN_a(BN_b(W x + b)))``: ``affine=False`` and ``track_running_stats=False`` (batch
    statistics in evaluation mode too)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.a = nn.BatchNorm1d(W, affine=False, momentum=0.5)
        self.b = nn.BatchNorm1d(W, track_running_stats=False)

    def forward(self, x):
        return torch.tanh(self.a(self.b(self.lin(x))))


class DropDense(nn.Module):
    """``DropPath(Dropout(tanh(W x + b)))``: two stochastic modules per layer (slots 0, 1)."""

    def __init__(self):
        super().__init__()
        self.lin, self.drop, self.path = nn.Linear(W, W), Dropout(0.3), DropPath(0.25)

    def forward(self, x):
        return self.path(self.drop(torch.tanh(self.lin(x))))


def _vit_block():
    return TransformerStep(4, 2, 8, dropout=0.2, drop_path=0.15)


STEPS = {"dense": (BNDense, (W,)), "bnvar": (BNVariants, (W,)), "conv": (BNConv, (C, 4, 4)), "dropout": (DropDense, (W,)),
         "vit": (_vit_block, (3, 4))}


def _split(sizes):
    """This rank's communicator when the world is split into groups of ``sizes`` ranks (in
    order); each group runs the check on its own, concurrently."""
    assert sum(sizes) == COMM.size, f"sizes {sizes} do not add up to {COMM.size} ranks"
    bounds = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return COMM.Split(next(i for i, b in enumerate(bounds) if COMM.rank < b), COMM.rank)


def _opts(levels=2):
    return MGRITOptions(max_levels=levels, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80)


def _ends(kind):
    torch.manual_seed(5)
    shape = STEPS[kind][1]
    if kind == "conv":
        return nn.Conv2d(1, C, 3, padding=1).double(), nn.Sequential(
            nn.Flatten(), nn.Linear(C * 16, 4)).double(), (1, 4, 4)
    if kind == "vit":
        return nn.Linear(2, 4).double(), nn.Sequential(nn.Flatten(), nn.Linear(12, 4)).double(), \
            (3, 2)
    return nn.Linear(2, W).double(), nn.Linear(W, 4).double(), (2,)


def _nets(kind, comm, levels=2):
    make = lambda k: STEPS[kind][0]().double()  # noqa: E731
    opening, closing, _ = _ends(kind)
    ser = nn.Sequential(opening, *serial_resnet(make, N, T, seed=3), closing)
    opening, closing, in_shape = _ends(kind)
    seg = LayerParallelResNet.build(make, N, STEPS[kind][1], comm=comm, seed=3, T=T,
                                    forward=_opts(levels), backward=_opts(levels))
    return LayerParallelNet(opening, seg, closing), ser, in_shape


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _batches(in_shape, n, steps, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, *in_shape, dtype=DT, generator=g) * 2 + 0.5,
             torch.randint(0, 4, (n,), generator=g)) for _ in range(steps)]


def _compare_state(net, ser, tol, what, comm=COMM):
    """Every parameter's gradient and every buffer (running statistics included) by its
    global key against the serial network; returns the worst relative error."""
    worst = 0.0
    ref = dict(ser.named_parameters())
    for key, p in net.named_global_parameters():
        g, r = p.grad, ref[key].grad  # (a bias before BatchNorm has a zero gradient: absolute)
        e = ((g - r).norm() / r.norm().clamp_min(1e-4)).item()
        assert e <= tol, f"{what}: grad of {key} rel err {e}"
        worst = max(worst, e)
    sd = net.gather_state_dict()
    if comm.rank == 0:
        rsd = ser.state_dict()
        assert set(sd) == set(rsd), sorted(set(sd) ^ set(rsd))[:4]
        for key, v in rsd.items():
            if key.endswith("num_batches_tracked"):
                assert int(sd[key]) == int(v), f"{what}: {key} {int(sd[key])} != {int(v)}"
            else:
                e = ((sd[key] - v).norm() / v.norm().clamp_min(1e-4)).item()  # ~0: absolute
                assert e <= tol, f"{what}: {key} rel err {e}"
                worst = max(worst, e)
    return worst


def check_train_exact(kind, sizes=None, levels=2, steps=3, tol=1e-10):
    """On groups of ``sizes`` ranks (default: all), ``levels`` (1: the pipelined one-level
    path), ``steps`` SGD steps, layer-parallel vs serial, batch 6: output, loss, every gradient,
    every running statistic and ``num_batches_tracked`` after each step; with dropout the
    same ``torch.manual_seed`` before each forward; then an evaluation forward."""
    torch.set_default_dtype(DT)
    comm = COMM if sizes is None else _split(sizes)
    net, ser, in_shape = _nets(kind, comm, levels)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ser.parameters(), lr=0.1)
    worst = 0.0
    for i, (x, y) in enumerate(_batches(in_shape, 6, steps)):
        for o in (opt, ropt):
            o.zero_grad(set_to_none=True)
        torch.manual_seed(100 + i)
        lr_ = F.cross_entropy(ser(x), y)
        lr_.backward()
        torch.manual_seed(100 + i)
        out = net(x)
        loss = net.loss(out, y)
        loss.backward()
        if net.is_last:
            e = abs(loss.item() - lr_.item()) / lr_.item()
            assert e <= tol, f"step {i}: loss rel err {e}"
        worst = max(worst, _compare_state(net, ser, tol, f"step {i}", comm))
        opt.step()
        ropt.step()
    net.eval()
    ser.eval()
    x = _batches(in_shape, 5, 1, seed=99)[0][0]
    with torch.no_grad():
        out, ref = net(x), ser(x)
    if net.is_last:
        e = _rel(out, ref)
        assert e <= tol, f"evaluation output rel err {e}"
    return COMM.allreduce(worst, op=MPI.MAX)


def check_dropout_semantics():
    """Same seed -> same output (reproducible); next forward -> new masks; eval -> no dropout
    (equals the serial network in eval); ``torch.utils.checkpoint`` -> the same gradients."""
    torch.set_default_dtype(DT)
    net, ser, in_shape = _nets("dropout", COMM)
    x, y = _batches(in_shape, 6, 1)[0]
    torch.manual_seed(7)
    a = net(x)
    b = net(x)  # next forward: new masks
    torch.manual_seed(7)
    c = net(x)
    if net.is_last:
        assert torch.equal(a, c), "torch.manual_seed(s) did not reproduce the forward"
        assert not torch.allclose(a, b), "the next forward drew the same masks"
    twin = net.to_serial()  # draws the segment's masks from the same seed
    torch.manual_seed(7)
    t = twin(x)
    if net.is_last:
        assert _rel(a, t) <= 1e-10, f"to_serial() drew other masks: rel err {_rel(a, t)}"
    net.eval()
    ser.eval()
    with torch.no_grad():
        e_out, e_ref = net(x), ser(x)
    if net.is_last:
        assert _rel(e_out, e_ref) <= 1e-10, "evaluation mode applied dropout"
    net.train()
    # checkpointed segment: the recomputation in the backward sees the forward's masks
    seg = net.segments[0]
    grads = []
    for ckpt in (False, True):
        net.zero_grad(set_to_none=True)
        torch.manual_seed(8)
        h = net.stages["0"](x) if seg.is_first else None
        if ckpt:
            s = torch.utils.checkpoint.checkpoint(seg, h, 6, use_reentrant=False)
        else:
            s = seg(h, 6)
        (s.pow(2).sum() if seg.is_last else s.sum()).backward()
        grads.append([p.grad.clone() for p in seg.parameters()])
    e = max(_rel(g1, g0) for g0, g1 in zip(*grads))
    assert e <= 1e-10, f"checkpointed gradients differ, rel err {e}"
    return True


def check_dp_batchnorm(kind, levels=2, steps=2, tol=1e-10):
    """``data_parallel=2`` replicas, each with half of a batch of 8 (ReplicaSync: the global
    batch's statistics inside the solves; gradients averaged), equal the single-process serial
    network on the whole batch: loss, every gradient and running statistic, ``steps`` steps."""
    torch.set_default_dtype(DT)
    grid = ProcessGrid(COMM, data_parallel=2)
    net, ser, in_shape = _nets(kind, grid.layer_comm, levels)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ser.parameters(), lr=0.1)
    r = grid.data_comm.Get_rank()
    worst = 0.0
    with ReplicaSync([net], grid.data_comm):
        for i, (x, y) in enumerate(_batches(in_shape, 8, steps)):
            for o in (opt, ropt):
                o.zero_grad(set_to_none=True)
            lr_ = F.cross_entropy(ser(x), y)
            lr_.backward()
            out = net(x[4 * r:4 * r + 4])
            loss = net.loss(out, y[4 * r:4 * r + 4])
            loss.backward()
            for p in net.parameters():  # plain mean over the replicas
                p.grad = torch.as_tensor(grid.data_comm.allreduce(p.grad.numpy(), op=MPI.SUM)) / 2
            worst = max(worst, _compare_state(net, ser, tol, f"dp step {i}",
                                              grid.layer_comm))
            opt.step()
            ropt.step()
    return COMM.allreduce(worst, op=MPI.MAX)


def check_errors():
    """Bad steps raise the same ValueError on every rank, naming the layer and the fix."""
    torch.set_default_dtype(DT)
    cases = [(lambda k: nn.Sequential(nn.Linear(W, W), nn.Dropout(0.1)), "Dropout", "mgrit.nn"),
             (lambda k: nn.Sequential(nn.Linear(W, W), nn.SyncBatchNorm(W)), "SyncBatchNorm",
              "BatchNorm1d")]
    for make, *words in cases:
        try:
            LayerParallelResNet.build(make, N, (W,), comm=COMM)
        except ValueError as e:
            assert all(w in str(e) for w in words), str(e)
            assert "layer" in str(e)
        else:
            raise AssertionError(f"no ValueError for {words[0]}")

    class Hidden(nn.Module):  # dropout the library cannot see: F.dropout in forward
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(W, W)

        def forward(self, x):
            return F.dropout(torch.tanh(self.lin(x)), 0.2, self.training)

    seg = LayerParallelResNet.build(lambda k: Hidden(), N, (W,), comm=COMM,
                                    forward=_opts(), backward=_opts())
    x = torch.randn(4, W) if seg.is_first else None
    out = seg(x, 4)
    try:
        out.sum().backward()
    except RuntimeError as e:  # the backward's agreement: the same error on every rank
        assert "default generator" in str(e) and "Dropout" in str(e), str(e)
    else:
        raise AssertionError("no error for F.dropout inside a step")
    return True
