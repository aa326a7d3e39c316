"""Issue 22 items 1, 2, 3, 7, 8: what a PyTorch user may do to step modules after build, on k
ranks, against serial PyTorch autograd on the same weights (``serial_resnet``, every rank builds
it; float64, MGRIT with 2 levels solved to 1e-13, compared at ``TOL = 1e-9`` relative; autocast
in float32 at the tolerance stated in :func:`check_autocast`). Run by ``tests/nn/test_contract.py``.

Each comparison: the output on the last layer rank, the input gradient on the first and the
parameter gradients of every local layer (``None`` where serial's is ``None``).
"""
import warnings

import torch
from torch import nn

from mgrit.nn import (ConvStep, DenseStep, LayerParallelNet, LayerParallelResNet,
                      TransformerStep, serial_resnet)
from mgrit.nn.chains.compiled import plain_module
from mgrit.nn.chains.contract import kernel
from mgrit.options import MGRITOptions
from tests.mpi_cases.nn.nn_cases import COMM, _global_max, _rand, _rel

TOL = 1e-9
EXACT = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=80)
N, B, T, SEED = 8, 3, 2.0, 5


# -- step classes a user writes ---------------------------------------------------------------
class HalfDense(DenseStep):
    """Overrides forward only: DenseStep's kernels must not run for it."""

    def forward(self, x):
        return 0.5 * super().forward(x)


class ScaledDense(DenseStep):
    """Per-layer state in a registered buffer (the documented way), used by forward."""

    def __init__(self, width, k):
        super().__init__(width)
        self.register_buffer("scale", torch.tensor(0.5 + 0.25 * k))

    def forward(self, x):
        return self.scale * super().forward(x)


class HalfConv(ConvStep):
    def forward(self, x):
        return 0.5 * super().forward(x)


class HalfTransformer(TransformerStep):
    def forward(self, x):
        return 0.5 * super().forward(x)


class UserStep(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.sin(self.lin(x))


MAKERS = {  # name: (make_step(k), state_shape, layers)
    "dense_subclass": (lambda k: HalfDense(3).double(), (3,), N),
    "dense_buffer_subclass": (lambda k: ScaledDense(3, k).double(), (3,), N),
    "conv_subclass": (lambda k: HalfConv(2, 3, "tanh").double(), (2, 3, 3), 4),
    "transformer_subclass": (lambda k: HalfTransformer(4, 2, 8).double(), (2, 4), 4),
    "user_step": (lambda k: UserStep(3).double(), (3,), N),
    "dense": (lambda k: DenseStep(3).double(), (3,), N),
}


def _pair(name, **kw):
    make, shape, n = MAKERS[name]
    kw.setdefault("forward", EXACT)
    kw.setdefault("backward", EXACT)
    lp = LayerParallelResNet.build(make, n, shape, comm=COMM, seed=SEED, T=T, **kw)
    return lp, serial_resnet(make, n, T, SEED), shape


def _local(lp, ser):
    """The serial reference's step modules of this rank's layers."""
    return [ser[lp.first + j].F for j in range(len(lp.steps))]


def _everywhere(lp, ser, change):
    """``change(step, k)`` on this rank's layer-parallel steps and on every serial layer."""
    for j, s in enumerate(lp.steps):
        change(s, lp.first + j)
    for k, r in enumerate(ser):
        change(r.F, k)


def _step_errors(lp, ser, x, w, loss=lambda y, w: (y * w).sum()):
    """One forward + backward on both sides (grads zeroed first); max relative error."""
    for m in (lp, ser):
        m.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_(True)
    y = ser(xs)
    loss(y, w).backward()
    xl = x.clone().requires_grad_(True) if lp.is_first else None
    out = lp(xl, batch_size=x.shape[0])
    (loss(out, w) if lp.is_last else out.sum()).backward()
    errs = []
    if lp.is_last:
        errs.append(_rel(out, y))
    if lp.is_first:
        errs.append(_rel(xl.grad, xs.grad))
    for s, r in zip(lp.steps, _local(lp, ser)):
        for (n, p), (_, q) in zip(plain_module(s).named_parameters(), r.named_parameters()):
            if q.grad is None:
                assert p.grad is None, f"{n}: a gradient where serial has none"
                continue
            assert p.grad is not None, f"{n}: no gradient where serial has one"
            errs.append(_rel(p.grad, q.grad))
    return _global_max(max(errs))


# -- item 1: subclasses of the shipped steps, user steps ----------------------------------------
def check_subclasses(names=tuple(MAKERS)):
    """Every subclass in ``names`` that overrides forward (also with a per-layer buffer), a
    user step and the plain DenseStep equal serial; the shipped kernels are refused to the
    subclasses."""
    assert kernel(HalfDense(3), "forward_batched") is None
    assert kernel(HalfDense(3), "vjp_batched") is None
    assert kernel(HalfConv(2), "forward_batched") is None
    assert kernel(HalfTransformer(4, 2), "forward_batched") is None
    assert kernel(DenseStep(3), "forward_batched") is not None
    out = {}
    for name in names:
        lp, ser, shape = _pair(name)
        x, w = _rand(B, *shape, seed=1), _rand(B, *shape, seed=2)
        err = _step_errors(lp, ser, x, w)
        assert err <= TOL, f"{name}: {err:.2e}"
        out[name] = err
    return out


def check_replaced_activation():
    """``step.act`` replaced after build by a module with per-layer parameters (PReLU): the
    next forward sees it (DenseStep's kernels refuse it) and equals serial."""
    lp, ser, shape = _pair("dense")
    x, w = _rand(B, *shape, seed=3), _rand(B, *shape, seed=4)
    def change(m, k):
        m.act = nn.PReLU(3, init=0.1 + 0.05 * k).double()
    _everywhere(lp, ser, change)
    err = _step_errors(lp, ser, x, w)
    assert err <= TOL, f"{err:.2e}"
    return err


# -- item 2: module hooks ------------------------------------------------------------------------
def check_hooks():
    """Forward hooks (changing the output), pre-hooks on a submodule and a global hook,
    registered after build: they fire once per layer per forward on LP as in serial, and the
    results equal serial with the same hooks; removed, MGRIT's batched path is back."""
    lp, ser, shape = _pair("dense")
    x, w = _rand(B, *shape, seed=5), _rand(B, *shape, seed=6)
    counts = {"lp": [0] * N, "ser": [0] * N}
    handles = []
    for side, steps in (("lp", list(lp.steps)), ("ser", [r.F for r in ser])):
        first = lp.first if side == "lp" else 0
        for j, s in enumerate(steps):
            def hook(m, args, out, k=first + j, side=side):
                counts[side][k] += 1
                return out * (1.0 + 0.1 * k)
            handles.append(s.register_forward_hook(hook))
            handles.append(s.linear.register_forward_pre_hook(lambda m, a: (a[0] * 0.9,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rep in range(2):  # two forward + backward rounds
            err = _step_errors(lp, ser, x, w)
            assert err <= TOL, f"round {rep}: {err:.2e}"
    mine = slice(lp.first, lp.first + len(lp.steps))
    assert counts["ser"] == [2] * N and counts["lp"][mine] == [2] * len(lp.steps), counts
    assert sum(counts["lp"]) == 2 * len(lp.steps), counts
    seen = []
    mine = {id(s) for s in lp.steps}
    g = nn.modules.module.register_module_forward_hook(
        lambda m, a, o: seen.append(1) if id(m) in mine else None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            err = max(err, _step_errors(lp, ser, x, w))
        assert any("hooks" in str(c.message) for c in caught), [str(c.message) for c in caught]
    finally:
        g.remove()
    assert len(seen) == len(lp.steps), len(seen)
    for h in handles:
        h.remove()
    err = max(err, _step_errors(lp, ser, x, w))
    assert lp.batching_obstacle is None or len(lp.steps) < 2, lp.batching_obstacle
    assert err <= TOL, f"{err:.2e}"
    return err


# -- item 3: parameters replaced after build -----------------------------------------------------
def check_replaced_parameters():
    """``step.linear.weight = nn.Parameter(...)`` then ``load_state_dict(sd, assign=True)``: the
    next forward uses the new tensors, they receive .grad, and training with a new optimizer
    (SGD, momentum, weight decay) follows serial step by step."""
    lp, ser, shape = _pair("dense")
    x, w = _rand(B, *shape, seed=7), _rand(B, *shape, seed=8)
    errs = []

    def replace(m, k):
        m.linear.weight = nn.Parameter(_rand(3, 3, seed=100 + k) * 0.7)
    _everywhere(lp, ser, replace)
    errs.append(_step_errors(lp, ser, x, w))
    for s in lp.steps:
        assert s.linear.weight.grad is not None, "a replaced parameter got no gradient"

    def load(m, k):
        sd = {n: _rand(*v.shape, seed=200 + k) * 0.5 for n, v in m.state_dict().items()}
        m.load_state_dict(sd, assign=True)
    _everywhere(lp, ser, load)
    opt_lp = torch.optim.SGD(lp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    opt_ser = torch.optim.SGD(ser.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for _ in range(3):
        errs.append(_step_errors(lp, ser, x, w))
        opt_lp.step()
        opt_ser.step()
        for s, r in zip(lp.steps, _local(lp, ser)):
            for p, q in zip(s.parameters(), r.parameters()):
                errs.append(_rel(p, q))
    err = _global_max(max(errs))
    assert err <= TOL, f"{err:.2e}"
    return err


def check_changed_between_forward_and_backward():
    """A parameter replaced between an MGRIT forward and its backward: a RuntimeError on every
    rank (never an adjoint of other modules)."""
    lp, ser, shape = _pair("dense")
    x = _rand(B, *shape, seed=9)
    out = lp(x.clone().requires_grad_(True) if lp.is_first else None, batch_size=B)
    lp.steps[0].linear.bias = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    try:
        out.sum().backward()
    except RuntimeError as exc:
        assert "changed between a forward and its backward" in str(exc), str(exc)
        return "raised"
    raise AssertionError("no error")


# -- item 7: autocast ----------------------------------------------------------------------------
def check_autocast():
    """``torch.autocast("cpu", bfloat16)`` around a float32 segment with 2 levels: the forward
    and backward equal serial autocast (measured: bitwise; asserted <= 1e-6 relative), with a
    warning that names autocast; a LayerParallelNet whose opening returns bfloat16 under
    autocast is refused with a message naming autocast (the same on every rank)."""
    make = lambda k: DenseStep(3)  # noqa: E731 - float32: autocast does not touch float64
    opts = MGRITOptions(max_levels=2, cfactor=2, tol=1e-6, max_iter=20)
    lp = LayerParallelResNet.build(make, N, (3,), comm=COMM, seed=SEED, T=T, forward=opts,
                                   backward=opts)
    ser = serial_resnet(make, N, T, SEED)
    x, w = _rand(B, 3, seed=10).float(), _rand(B, 3, seed=11).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            err = _step_errors(lp, ser, x, w)
    assert any("autocast" in str(c.message) for c in caught), [str(c.message) for c in caught]
    assert err <= 1e-6, f"{err:.2e}"
    err_plain = _step_errors(lp, ser, x, w)  # and without autocast: MGRIT again (float32)
    assert err_plain <= 1e-4, f"{err_plain:.2e}"
    net = LayerParallelNet(nn.Linear(3, 3), LayerParallelResNet.build(
        make, N, (3,), comm=COMM, seed=SEED, T=T, forward=opts, backward=opts), nn.Linear(3, 2))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(x)
    except ValueError as exc:
        assert "autocast" in str(exc), str(exc)
    else:
        raise AssertionError("no error for a bfloat16 state under autocast")
    return err


# -- item 8: torch.compile'd steps ----------------------------------------------------------------
def check_compiled_state_dict():
    """Steps wrapped in ``torch.compile`` (backend "eager"): state-dict keys (module,
    ``gather_state_dict``, a LayerParallelNet's global keys) equal the plain run's; each run's
    state dict loads into the other; the compiled run equals serial."""
    make = MAKERS["dense"][0]
    compiled = lambda k: torch.compile(make(k), backend="eager")  # noqa: E731
    opts = dict(forward=EXACT, backward=EXACT, comm=COMM, T=T)
    a = LayerParallelResNet.build(compiled, 4, (3,), seed=SEED, **opts)
    b = LayerParallelResNet.build(make, 4, (3,), seed=SEED + 1, **opts)
    assert list(a.state_dict()) == list(b.state_dict()), list(a.state_dict())
    a.load_state_dict(b.state_dict())
    for s, t in zip(a.steps, b.steps):
        for p, q in zip(s.parameters(), t.parameters()):
            assert torch.equal(p, q)
    b2 = LayerParallelResNet.build(make, 4, (3,), seed=SEED + 2, **opts)
    a.load_state_dict(b2.state_dict())  # compiled <- plain again, then plain <- compiled
    b.load_state_dict(a.state_dict())
    ga, gb = a.gather_state_dict(), b.gather_state_dict()
    if COMM.Get_rank() == 0:
        assert list(ga) == list(gb) and all(torch.equal(ga[k], gb[k]) for k in ga), list(ga)
    ser = serial_resnet(make, 4, T, SEED + 2)
    x = _rand(B, 3, seed=12)
    with torch.no_grad():
        y = a(x if a.is_first else None, batch_size=B)
        err = _global_max(_rel(y, ser(x)) if a.is_last else 0.0)
    assert err <= TOL, f"{err:.2e}"
    na = LayerParallelNet(torch.compile(nn.Linear(3, 3).double(), backend="eager"), a)
    nb = LayerParallelNet(nn.Linear(3, 3).double(), b)
    assert list(na.state_dict()) == list(nb.state_dict())
    assert [k for k, _ in na.named_global_parameters()] == \
        [k for k, _ in nb.named_global_parameters()]
    nb.load_state_dict(na.state_dict())
    na.load_state_dict(nb.state_dict())
    return err
