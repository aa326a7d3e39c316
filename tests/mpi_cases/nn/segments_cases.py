"""Networks of several layer-parallel segments, run on k ranks by tests/nn/test_segments_mpi.py
(float64, exact mode: forward and adjoint solves to 1e-13).

Every rank builds the same independent serial reference (an ``nn.Sequential`` of the same
ordinary modules and ``serial_resnet`` layers, same seeds) and checks its own part against
serial autograd: output and loss on the last layer rank, the input gradient on the first,
every parameter it holds by its global key (the keys of the serial network).
"""
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import (ConvStep, DenseStep, LayerParallelNet, LayerParallelResNet, ResidualStep,
                      serial_resnet)
from mgrit.grid import Partition
from mgrit.options import MGRITOptions

COMM = MPI.COMM_WORLD
DT = torch.float64
W, BATCH, T = 3, 4, 1.5


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _opts(levels):
    return MGRITOptions(max_levels=levels, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80)


def _expect(exc, fn, *words):
    try:
        fn()
    except exc as e:
        msg = str(e)
        for wd in words:
            assert wd in msg, f"{exc.__name__} message {msg!r} does not mention {wd!r}"
        return msg
    raise AssertionError(f"no {exc.__name__} raised (expected one mentioning {words})")


# -- the two architectures ------------------------------------------------------------------------
# Each: ordinary modules (made under one seed, on every rank: same weights for any rank count)
# and segment specs (make_step, n_layers, state_shape, seed); "S" marks a segment's place.
def _staged_conv():
    """Staged conv ResNet: stem, 3 segments of 5 / 7 / 5 layers, 2 strided transitions, head."""
    torch.manual_seed(101)
    mods = [nn.Conv2d(1, 2, 3, padding=1), "S", nn.Conv2d(2, 3, 3, stride=2, padding=1), "S",
            nn.Conv2d(3, 4, 3, stride=2, padding=1), "S",
            nn.Sequential(nn.Flatten(), nn.Linear(4 * 2 * 2, 5))]
    segs = [(lambda k: ConvStep(2, 3, "tanh"), 5, (2, 8, 8), 11),
            (lambda k: ConvStep(3, 3, "smoothrelu"), 7, (3, 4, 4), 12),
            (lambda k: ConvStep(4, 3, "tanh"), 5, (4, 2, 2), 13)]
    x = _rand(BATCH, 1, 8, 8, seed=7)
    return mods, segs, x


def _buffered():
    """Decoder-style: lift, two serial buffer layers, one segment of 11 layers, a buffer, head."""
    torch.manual_seed(102)
    mods = [nn.Linear(2, W), ResidualStep(DenseStep(W, "tanh"), 0.5),
            ResidualStep(DenseStep(W, "relu"), 0.5), "S", ResidualStep(DenseStep(W, "tanh"), 0.5),
            nn.Linear(W, 5)]
    segs = [(lambda k: DenseStep(W, "smoothrelu"), 11, (W,), 14)]
    x = _rand(BATCH, 2, seed=8)
    return mods, segs, x


def _two_dense():
    """Two dense segments of widths 3 and 4 (7 and 6 layers) with a transition."""
    torch.manual_seed(103)
    mods = [nn.Linear(2, W), "S", nn.Sequential(nn.Linear(W, W + 1), nn.Tanh()), "S",
            nn.Linear(W + 1, 5)]
    segs = [(lambda k: DenseStep(W, "tanh"), 7, (W,), 15),
            (lambda k: DenseStep(W + 1, "tanh"), 6, (W + 1,), 16)]
    x = _rand(BATCH, 2, seed=9)
    return mods, segs, x


ARCHS = {"staged_conv": _staged_conv, "buffered": _buffered, "two_dense": _two_dense}


def _parallel(arch, levels, comm=COMM, reverse=()):
    """The layer-parallel network; segments listed in ``reverse`` get the reversed even
    partition (their layer 0 on the last rank: no transfer after an even segment)."""
    mods, segs, x = ARCHS[arch]()
    mods = [m.double() if isinstance(m, nn.Module) else m for m in mods]
    it = iter(segs)
    parts = []
    for m in mods:
        if isinstance(m, str):
            make, n, shape, seed = next(it)
            part = Partition.even(n, comm.Get_size())
            k = sum(isinstance(q, LayerParallelResNet) for q in parts)
            part = part.reversed() if k in reverse else part
            parts.append(LayerParallelResNet.build(lambda k, make=make: make(k).double(), n, shape,
                                                   comm=comm, seed=seed, T=T, partition=part,
                                                   forward=_opts(levels), backward=_opts(levels)))
        else:
            parts.append(m)
    return LayerParallelNet(*parts), x


def _serial(arch):
    mods, segs, x = ARCHS[arch]()
    it = iter(segs)
    layers = []
    for m in mods:
        if isinstance(m, str):
            make, n, shape, seed = next(it)
            layers.extend(serial_resnet(lambda k, make=make: make(k).double(), n, T, seed))
        else:
            layers.append(m.double())
    return nn.Sequential(*layers), x


def _global_max(v):
    return COMM.allreduce(float(v), op=MPI.MAX)


def _target(n):
    return torch.arange(n) % 5


def _check_grads(net, ser, tol):
    """Every local parameter's gradient vs the serial one of the same global key; every serial
    parameter is held by exactly one rank."""
    ref = dict(ser.named_parameters())
    worst, keys = 0.0, []
    for key, p in net.named_global_parameters():
        assert p.grad is not None, f"{key}: no gradient"
        e = _rel(p.grad, ref[key].grad)
        assert e <= tol, f"{key}: grad rel err {e}"
        worst = max(worst, e)
        keys.append(key)
    everyone = COMM.allgather(keys)
    flat = [k for ks in everyone for k in ks]
    assert len(flat) == len(set(flat)), "a parameter lives on more than one rank"
    assert set(flat) == set(ref), f"parameters missing: {sorted(set(ref) - set(flat))[:5]}"
    return worst


# -- 1. exact mode == serial autograd -------------------------------------------------------------
def check_exact(arch, levels, tol=1e-10):
    torch.set_default_dtype(DT)
    ser, x = _serial(arch)
    y = _target(BATCH)
    xs = x.clone().requires_grad_(True)
    out_ref = ser(xs)
    loss_ref = F.cross_entropy(out_ref, y)
    loss_ref.backward()

    net, _ = _parallel(arch, levels)
    xl = x.clone().requires_grad_(True)
    out = net(xl)
    loss = net.loss(out, y)
    loss.backward()
    worst = 0.0
    if net.is_last:
        e, e2 = _rel(out, out_ref), abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
        assert e <= tol and e2 <= tol, f"output rel err {e}, loss rel err {e2}"
        worst = max(e, e2)
    else:
        assert out.numel() == 0
    if COMM.rank == net.first_rank:
        e = _rel(xl.grad, xs.grad)
        assert e <= tol, f"input grad rel err {e}"
        worst = max(worst, e)
    else:
        assert float(xl.grad.abs().max()) == 0.0, "the input gradient belongs to the first rank"
    worst = max(worst, _check_grads(net, ser, tol))
    # to_serial: same outputs, the serial network's keys and weights
    s2 = net.to_serial()
    sd, sd_ref = s2.state_dict(), ser.state_dict()
    assert list(sd) == list(sd_ref), "to_serial() keys differ from the serial network's"
    assert all(torch.equal(sd[k], sd_ref[k]) for k in sd), "to_serial() weights differ"
    with torch.no_grad():
        e = _rel(s2(x), out_ref)
    assert e <= 1e-13, f"to_serial output rel err {e}"
    return _global_max(worst)


# -- 2. several forwards before one backward ------------------------------------------------------
def check_several_forwards(levels, tol=1e-10):
    """Two forwards (batches of 4 and 3) through a 2-segment net, then (a) one backward of
    l1 + 2 l2, (b) backward of l1, then of l2 (oldest first); (c) as (a) with the second
    segment partitioned in reverse (no transfer; the output on rank 0)."""
    torch.set_default_dtype(DT)
    ser, x1 = _serial("two_dense")
    x2 = _rand(3, 2, seed=33)
    y1, y2 = _target(4), _target(3).flip(0)
    nets = {"sum": _parallel("two_dense", levels)[0]}
    nets["separate"] = nets["sum"]
    nets["reversed"] = _parallel("two_dense", levels, reverse=(1,))[0]
    worst = 0.0
    for mode, net in nets.items():
        ser.zero_grad(set_to_none=True)
        net.zero_grad(set_to_none=True)
        l1 = F.cross_entropy(ser(x1), y1)
        l2 = 2 * F.cross_entropy(ser(x2), y2)
        (l1 + l2).backward()
        o1, o2 = net(x1), net(x2)
        p1, p2 = net.loss(o1, y1), 2 * net.loss(o2, y2)
        if mode == "separate":
            p1.backward()
            p2.backward()
        else:
            (p1 + p2).backward()
        if net.is_last:
            e = max(abs(p1.item() - l1.item()) / l1.item(), abs(p2.item() - l2.item()) / l2.item())
            assert e <= tol, f"{mode}: loss rel err {e}"
        worst = max(worst, _check_grads(net, ser, tol))
    if COMM.size > 1:  # one state and one gradient per forward; 2 modes x 2 forwards
        sent = COMM.allreduce(nets["sum"].transfer_stats.messages)
        assert sent == 2 * 2 * 2, f"{sent} transfer messages"
        rev = nets["reversed"]
        assert rev.last_rank == 0 and COMM.allreduce(rev.transfer_stats.messages) == 0
    return _global_max(worst)


# -- 3. global state dicts -------------------------------------------------------------------------
def check_state_dicts():
    """gather == serial state dict; a perturbed serial network's state loads (any P); strict
    errors on every rank; a serial network loads the gathered dict."""
    torch.set_default_dtype(DT)
    ser, x = _serial("staged_conv")
    net, _ = _parallel("staged_conv", 2)
    sd = net.gather_state_dict(root=0)
    ref = ser.state_dict()
    if COMM.rank == 0:
        assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    else:
        assert sd is None
    with torch.no_grad():
        for i, p in enumerate(ser.parameters()):
            p.add_(0.1 * _rand(*p.shape, seed=500 + i))
    net.load_global_state_dict(ser.state_dict() if COMM.rank == 0 else None)
    with torch.no_grad():
        out, out_ref = net(x), ser(x)
    if net.is_last:
        e = _rel(out, out_ref)
        assert e <= 1e-12, f"loaded weights: output rel err {e}"
    back = net.gather_state_dict(root=COMM.size - 1)
    if COMM.rank == COMM.size - 1:
        fresh, _ = _serial("staged_conv")
        fresh.load_state_dict(back)  # strict: the gathered keys are exactly the serial ones
        with torch.no_grad():
            assert _rel(fresh(x), out_ref) <= 1e-12
    full = ser.state_dict()
    missing = {k: v for k, v in full.items() if k != "3.F.conv.weight"}
    _expect(KeyError, lambda: net.load_global_state_dict(missing if COMM.rank == 0 else None),
            "3.F.conv.weight")
    extra = dict(full, **{"99.weight": torch.zeros(1)})
    _expect(KeyError, lambda: net.load_global_state_dict(extra if COMM.rank == 0 else None),
            "99.weight")
    net.load_global_state_dict(extra if COMM.rank == 0 else None, strict=False)
    wrong = dict(full, **{"0.weight": torch.zeros(3, 3)})
    _expect(ValueError, lambda: net.load_global_state_dict(wrong if COMM.rank == 0 else None),
            "0.weight")
    COMM.Barrier()


# -- 4. bad input: the same error on every rank, before any message -------------------------------
def _seg(make, n, shape, comm=COMM):
    return LayerParallelResNet.build(make, n, shape, comm=comm, forward=_opts(2), backward=_opts(2))


def check_errors():
    torch.set_default_dtype(DT)
    P = COMM.size
    dense = lambda k: DenseStep(W, "tanh")  # noqa: E731
    _expect(ValueError, lambda: LayerParallelNet(), "at least one part")
    _expect(ValueError, lambda: LayerParallelNet(nn.Linear(2, W), nn.Linear(W, 5)), "segment")
    _expect(ValueError, lambda: LayerParallelNet([_seg(dense, 5, (W,))]), "*parts")
    s = _seg(dense, 5, (W,))
    _expect(ValueError, lambda: LayerParallelNet(s, s), "same module object")
    # an empty segment / fewer layers than ranks: LayerParallelResNet.build refuses
    _expect(ValueError, lambda: _seg(dense, 0, (W,)), "=0")
    if P > 1:
        _expect(ValueError, lambda: _seg(dense, P - 1, (W,)), f"={P - 1}")
        # segments on different communicators
        other = _seg(dense, 5, (W,), comm=MPI.COMM_SELF)
        _expect(ValueError, lambda: LayerParallelNet(_seg(dense, 5, (W,)), other), "communicator")
    # steps that change the state shape (bad on the last rank only: agreed everywhere)
    grow = lambda k: nn.Linear(W, W + 1) if k == 6 else DenseStep(W, "tanh")  # noqa: E731
    _expect(ValueError, lambda: LayerParallelNet(_seg(grow, 7, (W,))), "segment 0 layer 6",
            "keep the state shape")
    # a transition whose output does not fit the next segment
    _expect(ValueError, lambda: LayerParallelNet(_seg(dense, 5, (W,)), nn.Linear(W, W + 1),
                                                 _seg(dense, 6, (W,))),
            "part 1 (Linear)", "segment 1 has state_shape (3,)")
    wide = lambda k: DenseStep(W + 1, "tanh")  # noqa: E731
    _expect(ValueError, lambda: LayerParallelNet(_seg(dense, 5, (W,)), _seg(wide, 6, (W + 1,))),
            "segment 0's state", "(4,)")
    # a segment state the steps do not accept
    _expect(ValueError, lambda: LayerParallelNet(_seg(dense, 5, (W + 1,))), "segment 0 layer",
            "fails on its state")
    _expect(ValueError, lambda: LayerParallelNet(_seg(dense, 5, (W,)), nn.Linear(W + 2, 5)),
            "part 1 (Linear)", "fails")
    # forward: opening output, dtype of a transition, batch size per rank
    net = LayerParallelNet(nn.Linear(2, W + 1).double(), _seg(dense, 5, (W,)))
    _expect(ValueError, lambda: net(torch.zeros(BATCH, 2)), "part 0 (Linear)", "(3,)")
    net = LayerParallelNet(nn.Linear(2, W).double(), _seg(dense, 5, (W,)), nn.Linear(W, W).float(),
                           _seg(dense, 4, (W,)))
    _expect(ValueError, lambda: net(torch.zeros(BATCH, 2)), "part 2 (Linear)", "float64",
            "same dtype")
    net = LayerParallelNet(nn.Linear(2, W).double(), _seg(dense, 5, (W,)))
    _expect(ValueError, lambda: net(torch.zeros(BATCH, 2, dtype=torch.float32)), "part 0 (Linear)",
            "float32")
    net = LayerParallelNet(_seg(dense, 5, (W,)))
    _expect(ValueError, lambda: net(torch.zeros(BATCH, W, dtype=torch.float32)), "the input is",
            "float32", "segment 0")
    net = LayerParallelNet(nn.Linear(2, W).double(), _seg(dense, 5, (W,)))
    if P > 1:
        _expect(ValueError, lambda: net(torch.zeros(BATCH + COMM.rank, 2)), "batch size")
    with torch.no_grad():  # the failed calls left nothing behind: a good call works
        net(torch.zeros(BATCH, 2))
    COMM.Barrier()


# -- 5. the documented example of mgrit/nn/__init__.py, run literally -----------------------------
def check_docstring_example():
    """Exec the example of ``mgrit.nn.__doc__`` as written (default dtype float32); returns the
    losses it prints."""
    import mgrit.nn
    text = mgrit.nn.__doc__.split("::\n", 1)[1]
    lines = text.split("\n")
    body = [ln[4:] if ln.startswith("    ") else ln for ln in lines]
    end = next((i for i, ln in enumerate(lines) if ln and not ln.startswith(" ")), len(lines))
    code = "\n".join(body[:end])
    printed = []
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        exec(compile(code, "mgrit/nn/__init__.py (docstring example)", "exec"),
             {"print": lambda *a: printed.append(a), "__name__": "__example__"})
    finally:
        torch.set_default_dtype(prev)
    assert len(printed) == 3 and all(len(p) == 2 for p in printed), printed
    return [float(p[1]) for p in printed]


# -- 6. the transfers: exact bytes both ways ------------------------------------------------------
def check_p2p_exact():
    """send/recv between the first and the last rank: float64 values that float32 cannot hold
    and bfloat16 arrive bit for bit, and so do their gradients on the way back."""
    from mgrit.nn._p2p import recv, send
    from mgrit.stats import SolverStats
    src, dst = 0, COMM.size - 1
    for i, dtype in enumerate((torch.float64, torch.bfloat16, torch.float32)):
        x = (torch.arange(12, dtype=torch.float64).reshape(3, 4) / 3 + 1e-12).to(dtype)
        w = (torch.arange(12, dtype=torch.float64).reshape(3, 4) / 7 - 0.5).to(dtype)
        stats, tag = SolverStats(), 20_000 + 2 * (100 + i)
        if src == dst:
            continue
        if COMM.rank == src:
            xs = x.clone().requires_grad_(True)
            p = send(xs, COMM, dst, tag, stats)
            assert p.numel() == 0 and p.requires_grad
            p.sum().backward()
            assert torch.equal(xs.grad, w), f"{dtype}: gradient changed in transit"
            assert stats.messages == 1 and stats.bytes_sent == x.numel() * x.element_size()
        elif COMM.rank == dst:
            link = torch.zeros(0, dtype=dtype, requires_grad=True)
            got = recv(link, COMM, src, tag, x.shape, dtype, "cpu", stats)
            assert got.dtype == dtype and torch.equal(got, x), f"{dtype}: value changed in transit"
            (got * w).sum().backward()
            assert link.grad is not None and link.grad.numel() == 0
    COMM.Barrier()
