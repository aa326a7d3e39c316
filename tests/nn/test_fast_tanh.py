"""The batched kernels' tanh (``mgrit.nn.steps.basic._tanh_``, issue 34 item 1): round-off
against ``torch.tanh`` (float32 and float64, ``|z|`` from 1e-6 to 30, infinities, NaN), the
plain ``tanh_`` where it must be (small tensors, autograd), and a network big enough to take it
(every batched call and the adjoint's linearization) against serial PyTorch autograd in
float64 (exact solves, 1e-10) and against the per-layer modules (1e-14)."""
import pytest
import torch

from mgrit.nn import DenseStep, LayerParallelResNet
from mgrit.nn.steps import basic
from mgrit.options import MGRITOptions


def _z(dtype):
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(20000, generator=g, dtype=dtype) * s for s in (1e-6, 1e-3, 1, 5, 30)]
    return torch.cat(parts + [torch.tensor([0.0, float("inf"), -float("inf")], dtype=dtype)])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2.5e-7), (torch.float64, 1e-15)])
def test_fast_tanh_is_tanh_to_round_off(dtype, tol):
    z = _z(dtype)
    assert z.numel() >= basic._FAST_TANH_MIN
    fast = basic._tanh_(z.clone())
    ref = torch.tanh(z.double())
    assert float((fast.double() - ref).abs().max()) <= tol
    assert not torch.equal(fast, torch.tanh(z))  # the fast sequence ran (not tanh_)
    assert torch.isnan(basic._tanh_(torch.full((5000,), float("nan"), dtype=dtype))).all()


def test_plain_tanh_where_the_fast_one_may_not_run():
    small = torch.randn(basic._FAST_TANH_MIN - 1)
    assert torch.equal(basic._tanh_(small.clone()), torch.tanh(small))  # one layer's step
    w = torch.randn(8192, requires_grad=True)
    z = w * 1.0  # a fresh non-leaf that autograd records
    y = basic._tanh_(z)
    assert torch.equal(y, torch.tanh(w))
    (g,) = torch.autograd.grad(y.sum(), w)
    assert torch.allclose(g, 1 - torch.tanh(w) ** 2, rtol=0, atol=1e-6)


def test_big_batched_network_equals_serial_autograd():
    """N = 64, batch 16, width 8, 2 levels with m = 2: batched calls of 32 intervals (4096
    elements) and the linearization of all 64 layers take the fast tanh; float64 exact solves
    give serial autograd's output and gradients (1e-10), and a batched call equals the
    per-layer modules (1e-14)."""
    torch.manual_seed(5)
    ex = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=80)
    lp = LayerParallelResNet.build(lambda k: DenseStep(8), 64, (8,), forward=ex,
                                   backward=ex).double()
    x = torch.randn(16, 8, dtype=torch.float64)
    ser = lp.to_serial()
    y_ref = ser(x)
    (y_ref ** 2).sum().backward()
    y = lp(x)
    (y ** 2).sum().backward()
    assert float((y - y_ref).detach().norm() / y_ref.detach().norm()) <= 1e-10
    for p, q in zip(lp.parameters(), ser.parameters()):
        assert float((p.grad - q.grad).norm() / q.grad.norm()) <= 1e-10
    chain = lp._chain
    with torch.no_grad():
        chain.refresh()
        u = torch.randn(32, 16, 8, dtype=torch.float64)
        batched = chain.step_batch(u, range(0, 64, 2), range(1, 65, 2), 0)
        per_layer = torch.stack([u[i] + lp.h * lp.steps[2 * i](u[i]) for i in range(32)])
    assert u.numel() >= basic._FAST_TANH_MIN
    assert float((batched - per_layer).norm() / per_layer.norm()) <= 1e-14
