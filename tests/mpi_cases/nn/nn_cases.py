"""Layer-parallel ResNet checks run on k ranks by tests/nn/test_nn_mpi.py (float64).

Every rank builds the same serial reference (``serial_resnet`` with the same seeds) and
asserts on its own part: output / loss on the last layer rank, the input gradient on the
first, the parameter gradients of its own layers everywhere.
"""
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.grid import Partition
from mgrit.nn import (ConvStep, DenseStep, LayerParallelNet, LayerParallelResNet, TwoConvStep,
                      serial_resnet)
from mgrit.options import MGRITOptions

COMM = MPI.COMM_WORLD
DT = torch.float64
WIDTH, CH, HW, BATCH = 3, 2, 5, 4
EXACT = dict(tol=1e-13, max_iter=80)


def _maker(kind, act):
    if kind == "dense":
        return lambda k: DenseStep(WIDTH, act).double()
    if kind == "conv":
        return lambda k: ConvStep(CH, 3, act).double()
    if kind == "twoconv":
        return lambda k: TwoConvStep(CH, 3, act).double()
    raise ValueError(kind)


def _shape(kind):
    return (WIDTH,) if kind == "dense" else (CH, HW, HW)


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _opts(levels, cfactor, **kw):
    return MGRITOptions(max_levels=levels, cfactor=cfactor, **kw)


def _build(kind, act, n, levels=2, cfactor=4, adjoint="mgrit", T=2.0, seed=0, comm=COMM,
           fwd=None, bwd=None, **kw):
    fwd = fwd or _opts(levels, cfactor, **EXACT)
    bwd = bwd or _opts(levels, cfactor, **EXACT)
    return LayerParallelResNet.build(_maker(kind, act), n, _shape(kind), comm=comm, seed=seed,
                                     T=T, forward=fwd, backward=bwd, adjoint=adjoint, **kw)


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _serial_run(kind, act, n, T, seed, x, w):
    """Serial autograd: (output, loss, input grad, serial model with .grad)."""
    ser = serial_resnet(_maker(kind, act), n, T, seed)
    xs = x.clone().requires_grad_(True)
    y = ser(xs)
    loss = (y * w).sum()
    loss.backward()
    return y.detach(), loss.detach(), xs.grad, ser


def _lp_run(model, x, w):
    """Layer-parallel forward + backward on every rank; returns (output, loss, input grad)."""
    xs = x.clone().requires_grad_(True) if model.is_first else None
    out = model(xs, batch_size=x.shape[0])
    loss = (out * w).sum() if model.is_last else out.sum()
    loss.backward()
    return out.detach(), loss.detach(), (xs.grad if model.is_first else None)


def _param_errors(model, ser):
    """Relative error of each local parameter gradient vs the serial model's (list)."""
    errs = []
    for j, s in enumerate(model.steps):
        k = model.first + j
        for (name, p), (name_s, q) in zip(s.named_parameters(), ser[k].F.named_parameters()):
            assert name == name_s
            assert p.grad is not None, f"layer {k} {name}: no gradient"
            errs.append((k, name, _rel(p.grad, q.grad)))
    return errs


def _global_max(v):
    return COMM.allreduce(float(v), op=MPI.MAX)


# -- 1. exact mode ------------------------------------------------------------------------------
def check_exact(kind, act, n, levels, cfactor, adjoint, tol=1e-10):
    torch.set_default_dtype(DT)
    T, seed = 2.0, 3
    x = _rand(BATCH, *_shape(kind), seed=11)
    w = _rand(BATCH, *_shape(kind), seed=12)
    y_ref, loss_ref, gx_ref, ser = _serial_run(kind, act, n, T, seed, x, w)
    model = _build(kind, act, n, levels, cfactor, adjoint, T=T, seed=seed)
    out, loss, gx = _lp_run(model, x, w)
    worst = 0.0
    if model.is_last:
        e = _rel(out, y_ref)
        assert e <= tol, f"output rel err {e}"
        e2 = abs((loss - loss_ref).item()) / abs(loss_ref.item())
        assert e2 <= tol, f"loss rel err {e2}"
        worst = max(worst, e, e2)
    else:
        assert out.numel() == 0
    if model.is_first:
        e = _rel(gx, gx_ref)
        assert e <= tol, f"input grad rel err {e}"
        worst = max(worst, e)
    for k, name, e in _param_errors(model, ser):
        assert e <= tol, f"layer {k} {name}: grad rel err {e}"
        worst = max(worst, e)
    return _global_max(worst)


def _net_parts(kind, seed=21):
    torch.manual_seed(seed)
    if kind == "dense":
        opening, closing = nn.Linear(2, WIDTH), nn.Linear(WIDTH, 5)
    else:
        opening = nn.Conv2d(1, CH, 3, padding=1)
        closing = nn.Sequential(nn.Flatten(), nn.Linear(CH * HW * HW, 5))
    return opening.double(), closing.double()


def _net_input(kind, seed=31):
    x = _rand(BATCH, 2, seed=seed) if kind == "dense" else _rand(BATCH, 1, HW, HW, seed=seed)
    y = torch.randint(0, 5, (BATCH,), generator=torch.Generator().manual_seed(seed + 1))
    return x, y


def _build_net(kind, act, n, levels, cfactor, adjoint="mgrit", seed=3, comm=COMM, **kw):
    opening, closing = _net_parts(kind)
    resnet = _build(kind, act, n, levels, cfactor, adjoint, seed=seed, comm=comm, **kw)
    return LayerParallelNet(opening, resnet, closing)


def _serial_net(kind, act, n, seed=3, T=2.0):
    opening, closing = _net_parts(kind)
    return nn.Sequential(opening, *serial_resnet(_maker(kind, act), n, T, seed), closing)


def check_net_exact(kind, act, n, levels, cfactor, adjoint, tol=1e-10):
    torch.set_default_dtype(DT)
    x, y = _net_input(kind)
    ser = _serial_net(kind, act, n)
    xs = x.clone().requires_grad_(True)
    out_ref = ser(xs)
    loss_ref = F.cross_entropy(out_ref, y)
    loss_ref.backward()

    net = _build_net(kind, act, n, levels, cfactor, adjoint)
    xl = x.clone().requires_grad_(True)
    out = net(xl)
    loss = net.loss(out, y)
    loss.backward()
    worst = 0.0
    if net.is_last:
        e = _rel(out, out_ref)
        e2 = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
        assert e <= tol and e2 <= tol, f"output rel err {e}, loss rel err {e2}"
        for (nm, p), q in zip(net.closing.named_parameters(), ser[-1].parameters()):
            e3 = _rel(p.grad, q.grad)
            assert e3 <= tol, f"closing {nm}: grad rel err {e3}"
            worst = max(worst, e3)
        worst = max(worst, e, e2)
    if net.resnet.is_first:
        e = _rel(xl.grad, xs.grad)
        assert e <= tol, f"input grad rel err {e}"
        worst = max(worst, e)
        for (nm, p), q in zip(net.opening.named_parameters(), ser[0].parameters()):
            e3 = _rel(p.grad, q.grad)
            assert e3 <= tol, f"opening {nm}: grad rel err {e3}"
            worst = max(worst, e3)
    else:
        assert xl.grad is None or float(xl.grad.abs().max()) == 0.0
    layers = nn.Sequential(*list(ser)[1:-1])
    for k, name, e in _param_errors(net.resnet, layers):
        assert e <= tol, f"layer {k} {name}: grad rel err {e}"
        worst = max(worst, e)
    return _global_max(worst)


# -- 2. one level: bitwise ----------------------------------------------------------------------
def check_one_level_bitwise(kind, act, n):
    torch.set_default_dtype(DT)
    T, seed = 2.0, 4
    x = _rand(BATCH, *_shape(kind), seed=13)
    w = _rand(BATCH, *_shape(kind), seed=14)
    y_ref, _, gx_ref, ser = _serial_run(kind, act, n, T, seed, x, w)
    one = MGRITOptions(max_levels=1)
    model = _build(kind, act, n, T=T, seed=seed, fwd=one, bwd=one)
    out, _, gx = _lp_run(model, x, w)
    if model.is_last:
        assert torch.equal(out, y_ref), f"output differs by {(out - y_ref).abs().max().item()}"
    if model.is_first:
        assert torch.equal(gx, gx_ref), f"input grad differs by {(gx - gx_ref).abs().max().item()}"
    for j, s in enumerate(model.steps):
        k = model.first + j
        for (nm, p), q in zip(s.named_parameters(), ser[k].F.parameters()):
            assert torch.equal(p.grad, q.grad), \
                f"layer {k} {nm}: grad differs by {(p.grad - q.grad).abs().max().item()}"


# -- 3. inexact mode and finite differences ---------------------------------------------------
def _grad_error(model, x, w, gx_ref, ser):
    _, _, gx = _lp_run(model, x, w)
    errs = [e for _, _, e in _param_errors(model, ser)]
    if model.is_first:
        errs.append(_rel(gx, gx_ref))
    return _global_max(max(errs, default=0.0))


def check_inexact_converges(kind, act, n, levels, cfactor, relax="F"):
    torch.set_default_dtype(DT)
    T, seed = 4.0, 5
    x = _rand(BATCH, *_shape(kind), seed=15)
    w = _rand(BATCH, *_shape(kind), seed=16)
    _, _, gx_ref, ser = _serial_run(kind, act, n, T, seed, x, w)
    errors = []
    for it in (1, 2, 4, 8):
        fwd = _opts(levels, cfactor, tol=0.0, max_iter=it, relax=relax)
        bwd = _opts(levels, cfactor, tol=0.0, max_iter=it, relax=relax)
        model = _build(kind, act, n, T=T, seed=seed, fwd=fwd, bwd=bwd, warm_start=False)
        errors.append(_grad_error(model, x, w, gx_ref, ser))
    assert errors[0] > 1e-6, f"1 iteration is already exact ({errors}): the check would not discriminate"
    assert errors[-1] < 1e-3 * errors[0], f"errors do not fall: {errors}"
    assert errors[-1] < 1e-6, f"8 iterations still far: {errors}"
    for a, b in zip(errors, errors[1:]):
        assert b <= 1.5 * a, f"error grew with more iterations: {errors}"
    return errors


def _directions(model, seed):
    return [[_rand(*p.shape, seed=seed * 1000 + 37 * (model.first + j) + i)
             for i, p in enumerate(s.parameters())] for j, s in enumerate(model.steps)]


def _loss_at(model, x, w):
    with torch.no_grad():
        out = model(x if model.is_first else None, batch_size=x.shape[0])
    val = (out * w).sum().item() if model.is_last else None
    return COMM.bcast(val, root=model.partition.owner(model.n_layers - 1))


def check_finite_difference(kind, act, n, levels, cfactor, adjoint, eps=1e-6, tol=1e-6):
    torch.set_default_dtype(DT)
    x = _rand(BATCH, *_shape(kind), seed=17)
    w = _rand(BATCH, *_shape(kind), seed=18)
    model = _build(kind, act, n, levels, cfactor, adjoint, seed=6)
    _lp_run(model, x, w)
    dirs = _directions(model, seed=7)
    local = sum(float((p.grad * d).sum()) for s, ds in zip(model.steps, dirs)
                for p, d in zip(s.parameters(), ds))
    dd = COMM.allreduce(local, op=MPI.SUM)

    def shift(c):
        with torch.no_grad():
            for s, ds in zip(model.steps, dirs):
                for p, d in zip(s.parameters(), ds):
                    p.add_(c * d)

    shift(eps)
    lp = _loss_at(model, x, w)
    shift(-2 * eps)
    lm = _loss_at(model, x, w)
    shift(eps)
    fd = (lp - lm) / (2 * eps)
    rel = abs(fd - dd) / abs(dd)
    assert rel < tol, f"adjoint directional derivative {dd!r} vs central FD {fd!r}: rel {rel}"
    return rel


# -- 4. to_serial and state dicts ----------------------------------------------------------------
def _expect(exc, fn, *words):
    try:
        fn()
    except exc as e:
        msg = str(e)
        for wd in words:
            assert wd in msg, f"{exc.__name__} message {msg!r} does not mention {wd!r}"
        return msg
    raise AssertionError(f"no {exc.__name__} raised (expected one mentioning {words})")


def check_construction_errors():
    torch.set_default_dtype(DT)
    n = 7
    part = Partition.even(n, COMM.size)
    a, b = part.block(COMM.rank)
    nl = min(b, n) - a

    def steps(m, bad=None):
        out = [DenseStep(WIDTH) for _ in range(m)]
        if bad is not None and m:
            out[-1] = nn.Sequential(nn.Linear(WIDTH, WIDTH), bad)
        return out

    def make(s, **kw):
        return LayerParallelResNet(s, n, (WIDTH,), comm=COMM, **kw)

    for bad, name in [(nn.SyncBatchNorm(WIDTH), "SyncBatchNorm"), (nn.Dropout(0.1), "Dropout")]:
        _expect(ValueError, lambda: make(steps(nl, bad)), name, f"layer {a + nl - 1}")
    _expect(ValueError, lambda: make(steps(nl + 1)), str(nl + 1))
    _expect(ValueError, lambda: make(steps(nl), adjoint="reverse"), "reverse")
    _expect(ValueError, lambda: make(steps(nl), T=0.0), "T=")
    _expect(ValueError, lambda: make(steps(nl), T=-1.0), "T=")
    model = make(steps(nl))
    if model.is_first:
        _expect(ValueError, lambda: model(None, batch_size=3), "x0")
    else:
        _expect(ValueError, lambda: model(None), "batch_size")
    COMM.Barrier()


# -- 6. warm start ------------------------------------------------------------------------------
def check_warm_start(kind, act, n, levels, cfactor):
    torch.set_default_dtype(DT)
    x = _rand(BATCH, *_shape(kind), seed=23)
    opts = _opts(levels, cfactor, tol=0.0, max_iter=1)
    model = _build(kind, act, n, T=4.0, seed=11, fwd=opts, bwd=opts)
    assert model.warm_start, "inexact mode should warm-start by default"
    model(x if model.is_first else None, batch_size=BATCH)  # a training forward (grad enabled)
    cold = list(model.last_forward.residuals)
    with torch.no_grad():  # an evaluation forward neither uses up nor replaces the warm state
        model(x.flip(0) if model.is_first else None, batch_size=BATCH)
    model(x if model.is_first else None, batch_size=BATCH)
    warm = list(model.last_forward.residuals)
    assert warm[-1] < 0.5 * cold[-1], f"warm residual {warm} not below cold {cold}"
    cold_model = _build(kind, act, n, T=4.0, seed=11, fwd=opts, bwd=opts, warm_start=False)
    with torch.no_grad():
        cold_model(x if cold_model.is_first else None, batch_size=BATCH)
        cold_model(x if cold_model.is_first else None, batch_size=BATCH)
    assert cold_model.last_forward.residuals == cold, "warm_start=False should restart cold"
    return cold[-1], warm[-1]


# -- 7. optimizer integration -------------------------------------------------------------------
def check_sgd_training(kind, act, n, levels, cfactor, steps=3, tol=1e-10):
    torch.set_default_dtype(DT)
    x, y = _net_input(kind, seed=41)
    ser = _serial_net(kind, act, n)
    net = _build_net(kind, act, n, levels, cfactor)
    opt_s = torch.optim.SGD(ser.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt_s.zero_grad()
        F.cross_entropy(ser(x), y).backward()
        opt_s.step()
        opt_p.zero_grad()
        out = net(x)
        net.loss(out, y).backward()
        opt_p.step()
    worst = 0.0
    pairs = [(p, q) for s, j in zip(net.resnet.steps, range(len(net.resnet.steps)))
             for p, q in zip(s.parameters(), ser[1 + net.resnet.first + j].F.parameters())]
    if net.resnet.is_first:
        pairs += list(zip(net.opening.parameters(), ser[0].parameters()))
    if net.is_last:
        pairs += list(zip(net.closing.parameters(), ser[-1].parameters()))
    for p, q in pairs:
        e = _rel(p, q)
        assert e <= tol, f"parameter rel err {e} after {steps} SGD steps"
        worst = max(worst, e)
    # training actually moved the parameters
    fresh = _serial_net(kind, act, n)
    moved = max(_rel(p, q) for p, q in zip(ser.parameters(), fresh.parameters()))
    assert moved > 1e-3, "SGD did not move the parameters"
    return _global_max(worst)


def check_warm_start_adjoint(n=32):
    """warm_start_adjoint=True: repeated backward solves on the same batch start from the previous
    adjoints, so the (1-cycle) adjoint residual falls; off, it stays at the cold level."""
    torch.set_default_dtype(DT)
    o = MGRITOptions(max_levels=2, cfactor=4, tol=0.0, max_iter=1)
    x = _rand(3, WIDTH, seed=5)
    out = {}
    for wa in (False, True):
        m = LayerParallelResNet.build(lambda k: DenseStep(WIDTH, "tanh"), n, (WIDTH,), comm=COMM,
                                      forward=o, backward=o, warm_start_adjoint=wa, T=4.0, seed=3)
        r = []
        for _ in range(3):
            y = m(x if m.is_first else None, batch_size=3)
            (y.square().sum() if m.is_last else y.sum()).backward()
            r.append(m.last_backward.residuals[-1])
        out[wa] = r
    assert out[True][0] == out[False][0], out
    assert out[True][-1] < 0.5 * out[False][-1], out
    return out
