"""The one-level exact path of :class:`LayerParallelResNet` (``mgrit.nn.resnet.pipelined``) under every
usage pattern of tests/mpi_cases/nn/nn_usage_cases.py, against serial PyTorch autograd (float64),
run by tests/nn/test_fastpaths.py on 1, 2 and 3 ranks.

The usage scenarios are those of nn_usage_cases, run with ``max_levels=1`` forward and adjoint
options (:func:`check_usage` sets the options its ``build`` uses for one call); the
checks here add bitwise equality with serial autograd, the diagnostics the path keeps, and the
per-layer state / unused / frozen parameter cases with one-level options.
"""
import torch
from torch import nn

from mgrit.nn import LayerParallelResNet, serial_resnet
from mgrit.options import MGRITOptions
from tests.mpi_cases.nn import nn_module_cases as NM
from tests.mpi_cases.nn import nn_usage_cases as U
from tests.mpi_cases.nn.nn_cases import COMM, DT, _global_max, _rel

ONE = MGRITOptions(max_levels=1)


def check_usage(check, **kwargs):
    """``nn_usage_cases.<name>(**kwargs)`` (or ``nn_module_cases``) with one-level solves."""
    fn = getattr(U, check, None) or getattr(NM, check)
    saved, U.EXACT = U.EXACT, ONE  # the default options of nn_usage_cases.build, for this call
    try:  # the job is shared with other files' checks (tests/mpi_harness.py)
        return fn(**kwargs)
    finally:
        U.EXACT = saved


def _pair(maker, n=U.N, T=U.T):
    model = LayerParallelResNet.build(maker, n, (U.W,), comm=COMM, seed=U.SEED, T=T,
                                      forward=ONE, backward=ONE)
    return model, serial_resnet(maker, n, T, U.SEED)


def check_bitwise_training(steps=3):
    """SGD with momentum for ``steps`` steps: outputs, input gradients and every parameter
    equal serial autograd bit for bit on every rank (same operations in the same order)."""
    torch.set_default_dtype(DT)
    model, ser = _pair(U.dense)
    lp, ref = U.Side(model), U.Side(model, ser)
    opts = [torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in (lp.params, ser.parameters())]
    for it in range(steps):
        (xa, w), = U.inputs(1, seed=60 + it)
        xb = xa.detach().clone().requires_grad_(True)
        outs = []
        for side, opt, x in ((lp, opts[0], xa), (ref, opts[1], xb)):
            opt.zero_grad()
            out = side(x)
            side.loss(out, w, power=3).backward()
            opt.step()
            outs.append(out)
        if model.is_last:
            assert torch.equal(outs[0], outs[1]), f"step {it}: output differs"
        if model.is_first:
            assert torch.equal(xa.grad, xb.grad), f"step {it}: input gradient differs"
        for p, q in zip(lp.params, ref.params):
            assert torch.equal(p, q), f"step {it}: parameters differ by {(p - q).abs().max()}"
    return "bitwise"


def check_diagnostics():
    """``last_forward`` holds the rank's states (equal to serial's), ``last_backward`` the
    adjoint of the rank's first input state (equal to serial autograd's gradient of it); no
    forward solve of the general path runs (its counters stay zero apart from this path's)."""
    torch.set_default_dtype(DT)
    model, ser = _pair(U.dense)
    (x, w), = U.inputs(1)
    out = model(x if model.is_first else None, batch_size=U.B)
    U.Side(model).loss(out, w).backward()
    res = model.last_forward
    a, n = model.first, len(model.steps)
    assert res.lo == a and res.hi == a + n + (1 if model.is_last else 0)
    assert res.residuals == [0.0] and res.iterations == 1 and res.converged
    assert res.stats.steps_single == n and res.stats.steps_batched_calls == 0
    xs = [x.detach()]
    with torch.no_grad():
        for layer in ser:
            xs.append(layer(xs[-1]))
    ref = torch.stack(xs[res.lo:res.hi])
    assert torch.equal(res.states, ref), "forward states differ from serial"
    # serial adjoint of x_a: gradient of the loss w.r.t. the input of layer a
    xa = xs[a].clone().requires_grad_(True)
    y = xa
    for layer in list(ser)[a:]:
        y = layer(y)
    (y * w).sum().backward()
    back = model.last_backward
    assert back.lo == U.N - a and back.states.shape == (1, U.B, U.W)
    e = _rel(back.states[0], xa.grad)
    assert e <= 1e-14, f"adjoint of the rank's input rel err {e}"
    assert model._fsolver.stats.steps_batched_calls == 0
    return _global_max(e)


def check_no_grad_and_mixed():
    """Evaluation (no_grad) forwards on the one-level path, and a model whose forward has one
    level but whose adjoint has two (the general node): both equal serial autograd."""
    torch.set_default_dtype(DT)
    model, ser = _pair(U.dense)
    (x, _), = U.inputs(1)
    with torch.no_grad():
        out = model(x if model.is_first else None, batch_size=U.B)
        ref = ser(x)
    if model.is_last:
        assert torch.equal(out, ref), "no_grad output differs"
    two = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=80)
    mixed = LayerParallelResNet.build(U.dense, U.N, (U.W,), comm=COMM, seed=U.SEED, T=U.T,
                                      forward=ONE, backward=two)
    return _mixed(mixed, ser)


def _mixed(model, ser):
    lp, ref = U.Side(model), U.Side(model, ser)
    a, b = U.inputs(2), U.inputs(2)
    U._f1_f2_b12(lp, a)
    U._f1_f2_b12(ref, b)
    return U.compare(lp, ref, [x for x, _ in a], [x for x, _ in b])


class _Spare(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(U.W, U.W)
        self.spare = nn.Linear(U.W, U.W)  # never used

    def forward(self, x):
        return torch.tanh(self.lin(x))


def check_unused_frozen_hooked(kind):
    """Unused parameters (``None`` grads), every third layer frozen, and forward hooks on
    every step (``kind="hook"``): serial autograd's gradients, ``None`` where it has ``None``."""
    torch.set_default_dtype(DT)
    maker = {"spare": lambda k: _Spare().double(), "hook": NM._hooked}[kind]
    model, ser = _pair(maker)
    lp, ref = U.Side(model), U.Side(model, ser)
    for side in (lp, ref):
        for j, s in enumerate(side.steps):
            if (model.first + j) % 3 == 0:
                next(s.parameters()).requires_grad_(False)
    (xa, wa), = U.inputs(1)
    (xb, wb), = U.inputs(1)
    lp.loss(lp(xa), wa).backward()
    ref.loss(ref(xb), wb).backward()
    assert sum(p.grad is None for p in ref.params) > 0, "the check would not discriminate"
    return U.compare(lp, ref, [xa], [xb], tol=0.0)
