"""Issue 34 item 1: the bound of an MGRIT training step (:mod:`mgrit.perf.trace.bound`) prices
exactly the operations the solver counted (its own ``SolverStats``, an independent tally), and
the adjoint's closed-form fast path is decided with the batching proof and follows the
fingerprint (a replaced activation or a subclass loses it; gradients stay serial-equal)."""
import math

import pytest
import torch
from torch import nn

from mgrit.nn import DenseStep, LayerParallelResNet
from mgrit.options import MGRITOptions
from mgrit.perf.model import CommCost, StepCost
from mgrit.perf.trace import Tracer
from mgrit.perf.trace.bound import step_bound


def _traced_step(m=4, N=16):
    def o(it):
        return MGRITOptions(max_levels=2, cfactor=m, tol=0, max_iter=it, relax="F")
    lp = LayerParallelResNet.build(lambda k: DenseStep(3), N, (3,), forward=o(2), backward=o(1))
    tr = Tracer()
    tr.attach(lp._fsolver, "forward")
    tr.attach(lp._bsolver, "adjoint")
    (lp(torch.randn(5, 3)) ** 2).mean().backward()
    return lp, tr.gather(lp.comm)


def test_bound_prices_the_solvers_own_counts():
    lp, trace = _traced_step()
    fs, bs = lp.last_forward.stats, lp.last_backward.stats
    per_item = StepCost(1.0, 0.0, 1.0)  # every state advanced costs 1
    b = step_bound(trace, {"forward": per_item, "adjoint": per_item})
    assert b.per_label == {"forward": fs.steps_single + fs.steps_batched_items,
                           "adjoint": bs.steps_single + bs.steps_batched_items}
    per_call = StepCost(1.0, 1.0, 0.0)  # every call costs 1
    b = step_bound(trace, {"forward": StepCost(0.0, 0.0, 0.0), "adjoint": per_call},
                   CommCost(0.0, math.inf), extra=0.5)
    assert b.total == bs.steps_single + bs.steps_batched_calls + 0.5
    assert b.counts["forward"][0]["steps_batched_calls"] == fs.steps_batched_calls > 0


def test_bound_refuses_missing_costs_and_bad_extra():
    _, trace = _traced_step()
    with pytest.raises(ValueError, match="adjoint"):
        step_bound(trace, {"forward": StepCost(1.0, 0.0, 1.0)})
    for bad in (-1.0, math.nan, True):
        with pytest.raises(ValueError, match="extra"):
            step_bound(trace, {"forward": StepCost(1, 0, 1), "adjoint": StepCost(1, 0, 1)},
                       extra=bad)


class _Cube(nn.Module):
    def forward(self, z):
        return z ** 3 / 3


class _Shifted(DenseStep):
    def forward(self, x):
        return super().forward(x) + 0.1


def _grads_vs_serial(lp, x):
    ser = lp.to_serial()
    (ser(x) ** 2).sum().backward()
    ref = [p.grad for p in ser.parameters()]
    for p in lp.parameters():
        p.grad = None
    (lp(x) ** 2).sum().backward()
    live = [p.requires_grad for p in lp.parameters()]
    got = [p.grad for p in lp.parameters()]
    assert all((g is None) == (not w) for g, w in zip(got, live))  # frozen: None, as serial
    return max(float((a - b).norm() / b.norm()) for a, b, w in zip(got, ref, live) if w)


@pytest.mark.parametrize("change", ["activation", "subclass"])
def test_closed_form_adjoint_follows_the_fingerprint(change):
    """Float64, exact solves: the closed-form adjoint runs for DenseStep (decided once per
    proof) and is dropped when every layer's activation is replaced after build (the
    fingerprint rebuilds the stack) or for a subclass overriding ``forward``; the gradients
    equal serial autograd (<= 1e-10) in every case."""
    torch.manual_seed(0)
    ex = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=60)
    make = (lambda k: _Shifted(3)) if change == "subclass" else (lambda k: DenseStep(3))
    lp = LayerParallelResNet.build(make, 8, (3,), forward=ex, backward=ex).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    if change == "activation":
        assert lp._chain._stack.closed_form_vjp
        assert _grads_vs_serial(lp, x) <= 1e-10
        for s in lp.steps:
            s.act = _Cube()
        lp(x)  # the fingerprint sees the replaced submodules and rebuilds the stack
    stack = lp._chain._stack
    assert stack is not None and not stack.closed_form_vjp
    assert _grads_vs_serial(lp, x) <= 1e-10


@pytest.mark.parametrize("frozen", [False, True])
def test_closed_form_adjoint_on_and_off_agree(frozen):
    """The same model and batch with the closed-form adjoint and parameter-gradient kernel
    (on) and with the general batched path (autograd through ``forward_batched``: off, forced
    by clearing the stack's decision) give the same gradients to round-off (float64, exact
    solves, 1e-12), both equal to serial autograd (1e-10); a frozen weight gets no gradient
    on either path, as in serial."""
    torch.manual_seed(1)
    ex = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=60)
    lp = LayerParallelResNet.build(lambda k: DenseStep(3), 8, (3,), forward=ex,
                                   backward=ex).double()
    if frozen:
        lp.steps[3].linear.weight.requires_grad_(False)
    x = torch.randn(4, 3, dtype=torch.float64)
    grads = {}
    for on in (True, False):
        lp._chain._stack._closed = on
        assert _grads_vs_serial(lp, x) <= 1e-10
        grads[on] = [p.grad for p in lp.parameters()]
    assert lp._fingerprint.same()  # nothing rebuilt the stack in between
    for a, b in zip(grads[True], grads[False]):
        assert (a is None) == (b is None)
        if a is not None:
            assert float((a - b).norm() / b.norm()) <= 1e-12
    assert (grads[True][6] is None) == frozen  # steps[3].linear.weight
