"""User step modules and parameters in :class:`LayerParallelResNet`, run on k ranks by
tests/nn/test_nn_usage.py (float64, exact mode), each against serial PyTorch autograd on the same
weights (``serial_resnet``, or an ``nn.Sequential`` of ``ResidualStep`` for shared modules).

Issue 13 item 2 (batching never changes what a module computes): per-layer private attributes,
tensor attributes, closures, a time-dependent step ``F(x, t_k)``, per-layer hooks; identical
layers still batch. Item 3 (parameters as in serial autograd): unused parameters keep
``.grad = None``, frozen parameters, shared modules. Item 8: ``build`` leaves the caller's RNG
state as it was, on any number of ranks.
"""
import copy
import hashlib

import torch
from torch import nn

from mgrit.grid import Partition
from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, ResidualStep, serial_resnet
from mgrit.options import MGRITOptions
from tests.mpi_cases.nn.nn_cases import COMM, DT, _global_max, _rel
from tests.mpi_cases.nn.nn_usage_cases import (B, N, SEED, TOL, W, Side, build, compare, dense,
                                            inputs)


# -- step modules with per-layer state --------------------------------------------------------
class Scaled(nn.Module):
    """``scale_k * tanh(W x + b)``; ``kind`` says where ``scale_k`` lives."""

    def __init__(self, k, kind):
        super().__init__()
        self.lin = nn.Linear(W, W)
        s = 1.0 + 0.5 * k
        if kind == "private":
            self._scale = s
        elif kind == "tensor":  # a plain tensor attribute: neither parameter nor buffer
            self.scale = torch.full((W,), s)
        elif kind == "closure":
            self.fn = lambda z: s * torch.tanh(z)
        elif kind == "buffer":  # per-layer state kept batchable
            self.register_buffer("scale", torch.full((W,), s))
        elif kind == "same":  # equal on every layer: batched
            self._scale = 1.5
        self.kind = kind

    def forward(self, x):
        z = self.lin(x)
        if self.kind == "closure":
            return self.fn(z)
        s = self._scale if self.kind in ("private", "same") else self.scale
        return s * torch.tanh(z)


class TimeStep(nn.Module):
    """A time-dependent step ``F(x, t_k) = tanh(W x + b + sin(t_k))``, ``t_k`` stored privately."""

    def __init__(self, k, h):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self._t = k * h

    def forward(self, x):
        return torch.tanh(self.lin(x) + torch.sin(torch.tensor(self._t)))


def _doubling_hook(module, args, out):
    return 2.0 * out


def _hooked(k):
    step = DenseStep(W, "tanh").double()
    if k % 3 == 1:
        step.register_forward_hook(_doubling_hook)
    return step


def _maker(kind):
    if kind == "dense":
        return dense
    if kind == "time":
        return lambda k: TimeStep(k, 2.0 / N).double()
    if kind == "hook":
        return _hooked
    return lambda k: Scaled(k, kind).double()


def check_per_layer_state(kind, batched_expected):
    """Forward output and all gradients equal serial autograd; the chain is batched exactly
    when it may be (``kind`` "buffer" and "same"), and the exact solve converges."""
    torch.set_default_dtype(DT)
    model, ser = build(_maker(kind))
    lp, ref = Side(model), Side(model, ser)
    a, b = inputs(1), inputs(1)
    (xa, wa), (xb, wb) = a[0], b[0]
    oa, ob = lp(xa), ref(xb)
    worst = 0.0
    if model.is_last:
        worst = _rel(oa, ob)
        assert worst <= TOL, f"output rel err {worst}"
    lp.loss(oa, wa).backward()
    ref.loss(ob, wb).backward()
    worst = max(_global_max(worst), compare(lp, ref, [xa], [xb]))
    for res in (model.last_forward, model.last_backward):
        assert res.converged, f"exact solve did not converge: {res.residuals}"
    calls = model.last_forward.stats.steps_batched_calls
    assert (calls > 0) == batched_expected == model._chain.batched, \
        f"{calls} batched calls: {model.batching_obstacle}"
    return worst


# -- parameters: unused, frozen, shared ---------------------------------------------------------
class WithSpare(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.spare = nn.Linear(W, W)  # never used in forward

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _sgd_step(params):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.5)
    opt.step()


def check_unused_and_frozen(kind, batched):
    """Weights of every third layer frozen after build (``requires_grad=False``): they get no
    gradient and an SGD step leaves them; with ``kind="spare"`` every step also has a module
    that does not reach the output, whose ``.grad`` stays ``None`` and which an SGD step with
    momentum and weight decay leaves unchanged. The rest equals serial autograd. ``batched``:
    the solver's batched paths (``"dense"``: the closed-form VJP; ``"spare"``: vmap)."""
    torch.set_default_dtype(DT)
    opts = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=80, batched=batched)
    maker = dense if kind == "dense" else (lambda k: WithSpare().double())
    model, ser = build(maker, forward=opts, backward=opts)
    assert model._chain.batched == batched
    lp, ref = Side(model), Side(model, ser)
    for side in (lp, ref):
        for j, s in enumerate(side.steps):
            if (model.first + j) % 3 == 0:
                next(s.parameters()).requires_grad_(False)
    before = [p.detach().clone() for p in lp.params]
    (xa, wa), = inputs(1)
    (xb, wb), = inputs(1)
    lp.loss(lp(xa), wa).backward()
    ref.loss(ref(xb), wb).backward()
    if kind == "spare":
        for s in lp.steps:
            assert s.spare.weight.grad is None and s.spare.bias.grad is None
    assert sum(p.grad is None for p in ref.params) > 0, "the check would not discriminate"
    worst = compare(lp, ref, [xa], [xb])
    _sgd_step(lp.params)
    _sgd_step(ref.params)
    for p, q, p0 in zip(lp.params, ref.params, before):
        e = _rel(p, q)
        assert e <= TOL, f"after SGD: parameter rel err {e}"
        if q.grad is None:
            assert torch.equal(p, p0), "a parameter without gradient moved"
    return worst


def check_frozen_resnet_before_head(input_grad):
    """A fully frozen resnet in front of a trainable head (``LayerParallelNet``): the head's
    gradients equal serial autograd; with ``input_grad`` the input gradient too. Without it no
    rank needs anything from the resnet: no adjoint solve runs."""
    torch.set_default_dtype(DT)
    model, ser = build()
    torch.manual_seed(5)
    head = nn.Linear(W, 2).double()
    shead = copy.deepcopy(head)
    for p in list(model.parameters()) + list(ser.parameters()):
        p.requires_grad_(False)
    net = LayerParallelNet(None, model, head)
    full = nn.Sequential(*ser, shead)
    x = inputs(1)[0][0].detach().requires_grad_(input_grad)
    xs = x.detach().clone().requires_grad_(input_grad)
    y = torch.tensor([0, 1, 1, 0])
    out = net(x)
    net.loss(out, y).backward()
    nn.functional.cross_entropy(full(xs), y).backward()
    assert all(p.grad is None for p in model.parameters())
    assert (model.last_backward is not None) == input_grad
    worst = 0.0
    if net.is_last:
        for p, q in zip(head.parameters(), shead.parameters()):
            worst = max(worst, _rel(p.grad, q.grad))
    if input_grad and model.is_first:
        worst = max(worst, _rel(x.grad, xs.grad))
    assert worst <= TOL, f"rel err {worst}"
    return _global_max(worst)


def check_shared_parameters(pattern):
    """One module for every layer (``"all"``) or one ``nn.Linear`` in layers 2 and 5
    (``"some"``): on one rank the gradient is the sum over the layers, as serial autograd
    (also after two SGD steps); with P > 1 ``build`` refuses on every rank."""
    torch.set_default_dtype(DT)
    torch.manual_seed(7)
    shared_step, shared_lin = DenseStep(W, "tanh").double(), nn.Linear(W, W).double()

    def make(k):
        if pattern == "all":
            return shared_step
        step = DenseStep(W, "tanh").double()
        if k in (2, 5):
            step.linear = shared_lin
        return step

    if COMM.size > 1:  # refused by build and by the constructor, on every rank
        try:
            build(make)
        except ValueError as exc:
            assert "not created by make_step" in str(exc) and "P = 1" in str(exc), str(exc)
        else:
            raise AssertionError("build accepted parameters shared across layer ranks")
        if pattern == "some":  # layers 2 and 5 are on different ranks: only build can tell
            return None
        a, b = Partition.even(N, COMM.size).block(COMM.rank)
        try:
            LayerParallelResNet([make(k) for k in range(a, min(b, N))], N, (W,), comm=COMM)
        except ValueError as exc:
            assert "share the parameter" in str(exc) and "P = 1" in str(exc), str(exc)
            return None
        raise AssertionError("shared parameters across layer ranks were accepted")
    model, _ = build(make)
    ser = copy.deepcopy(nn.Sequential(*[ResidualStep(s, T_H) for s in model.steps]))  # ties kept
    n_unique = len(list(ser.parameters()))
    assert n_unique == (2 if pattern == "all" else 2 * N - 2)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(ser.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    for it in range(2):
        (x, w), = inputs(1, seed=50 + it)
        for m, opt in ((model, opt_a), (ser, opt_b)):
            opt.zero_grad()
            ((m(x) if m is ser else m(x, batch_size=B)) * w).sum().backward()
        for p, q in zip(model.parameters(), ser.parameters()):
            e = _rel(p.grad, q.grad)
            assert e <= TOL, f"shared parameter gradient rel err {e}"
            worst = max(worst, e)
        opt_a.step()
        opt_b.step()
    return worst


T_H = 2.0 / N  # h of build()


# -- item 8: build() and the caller's RNG ---------------------------------------------------------
def check_build_keeps_rng():
    """The global RNG state after ``build`` equals the state before, on every rank and for
    every rank count (so everything created after build is rank-independent)."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    LayerParallelResNet.build(dense, N, (W,), comm=COMM, seed=SEED)
    after = torch.get_rng_state()
    assert torch.equal(before, after), "build changed the caller's RNG state"
    serial_resnet(dense, N, T_H * N, SEED)
    assert torch.equal(before, torch.get_rng_state()), "serial_resnet changed the RNG state"
    digest = hashlib.sha256(after.numpy().tobytes()).hexdigest()
    assert len(set(COMM.allgather(digest))) == 1, "RNG states differ between ranks"
    return digest[:16]
