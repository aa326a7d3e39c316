"""Serial (in-process, no mpiexec) tests of mgrit.nn: step modules, SmoothReLU, the serial
reference ``serial_resnet`` and the construction errors of :class:`LayerParallelResNet` on
``COMM_SELF``. The rank-parallel acceptance checks are in tests/nn/test_nn_mpi.py."""
import pytest
import torch
from torch import nn

from mgrit.nn import (ConvStep, DenseStep, LayerParallelNet, LayerParallelResNet, ResidualStep,
                      SmoothReLU, TwoConvStep, layer_seed, make_step, serial_resnet)
from mgrit.options import MGRITOptions

DT = torch.float64


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(DT)
    yield
    torch.set_default_dtype(old)


# -- SmoothReLU ---------------------------------------------------------------------------------
def test_smoothrelu_pieces():
    eps = 0.1
    f = SmoothReLU(eps)
    x = torch.tensor([-1.0, -0.1, -0.05, 0.0, 0.05, 0.1, 0.3, 2.0])
    expected = torch.where(x >= eps, x, torch.where(x <= -eps, torch.zeros_like(x),
                                                    (x + eps) ** 2 / (4 * eps)))
    assert torch.equal(f(x), expected)
    assert f(torch.tensor(0.0)).item() == pytest.approx(eps / 4)
    assert f(torch.tensor(-5.0)).item() == 0.0 and f(torch.tensor(5.0)).item() == 5.0


def test_smoothrelu_continuous_and_c1():
    eps = 0.2
    f = SmoothReLU(eps)
    d = 1e-9
    for x0 in (-eps, eps):
        lo, hi = f(torch.tensor(x0 - d)), f(torch.tensor(x0 + d))
        assert abs((hi - lo).item()) < 1e-8
    # derivative (x + eps)/(2 eps) matches 0 at -eps and 1 at eps
    x = torch.tensor([-eps - 1e-7, -eps + 1e-7, eps - 1e-7, eps + 1e-7], requires_grad=True)
    g, = torch.autograd.grad(f(x).sum(), x)
    assert torch.allclose(g, torch.tensor([0.0, 0.0, 1.0, 1.0]), atol=1e-5)
    xs = torch.linspace(-0.5, 0.5, 41).requires_grad_(True)
    assert torch.autograd.gradcheck(f, (xs,))


def test_smoothrelu_any_shape_and_bad_eps():
    x = torch.randn(2, 3, 4, 5)
    assert SmoothReLU()(x).shape == x.shape
    assert SmoothReLU().eps == 0.1
    for bad in (0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            SmoothReLU(bad)


# -- steps --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,shape", [("dense", (3, 4)), ("conv", (3, 2, 5, 5)),
                                        ("twoconv", (3, 2, 5, 5))])
@pytest.mark.parametrize("act", ["tanh", "relu", "smoothrelu"])
def test_steps_keep_shape_and_dtype(kind, shape, act):
    step = make_step(kind, shape[1], act).double()
    x = torch.randn(*shape)
    y = step(x)
    assert y.shape == x.shape and y.dtype == DT
    assert all(p.dtype == DT for p in step.parameters())


def test_step_definitions():
    torch.manual_seed(0)
    d = DenseStep(4, "tanh")
    x = torch.randn(3, 4)
    assert torch.equal(d(x), torch.tanh(x @ d.linear.weight.T + d.linear.bias))
    c = ConvStep(2, 3, "relu")
    xc = torch.randn(2, 2, 5, 5)
    assert torch.equal(c(xc), torch.relu(nn.functional.conv2d(xc, c.conv.weight, c.conv.bias,
                                                              padding=1)))
    t = TwoConvStep(2)
    assert t.conv1.bias is None and t.conv2.bias is None
    ref = torch.relu(nn.functional.conv2d(torch.relu(nn.functional.conv2d(xc, t.conv1.weight,
                                                                          padding=1)),
                                          t.conv2.weight, padding=1))
    assert torch.equal(t(xc), ref)
    assert isinstance(make_step("dense", 3, "smoothrelu").act, SmoothReLU)
    assert isinstance(make_step("conv", 2, "relu", kernel=5), ConvStep)
    assert make_step("conv", 2, "relu", kernel=5).conv.kernel_size == (5, 5)


def test_step_errors():
    with pytest.raises(ValueError, match="sigmoid"):
        DenseStep(3, "sigmoid")
    for bad in (0, -1, 2.0, "3"):
        with pytest.raises(ValueError, match="width"):
            DenseStep(bad)
        with pytest.raises(ValueError, match="channels"):
            ConvStep(bad)
        with pytest.raises(ValueError, match="channels"):
            TwoConvStep(bad)
    for bad in (0, 2, 4, -3):
        with pytest.raises(ValueError, match="kernel"):
            ConvStep(2, bad)
        with pytest.raises(ValueError, match="kernel"):
            TwoConvStep(2, bad)
    with pytest.raises(ValueError, match="resblock"):
        make_step("resblock", 3, "tanh")


# -- serial reference ----------------------------------------------------------------------------
def test_residual_step():
    torch.manual_seed(1)
    F = DenseStep(3)
    r = ResidualStep(F, 0.25)
    x = torch.randn(2, 3)
    assert torch.equal(r(x), x + 0.25 * F(x))


def test_serial_resnet_structure_and_seeds():
    mk = lambda k: DenseStep(3, "tanh").double()  # noqa: E731
    a = serial_resnet(mk, 6, T=3.0, seed=4)
    assert len(a) == 6 and all(isinstance(m, ResidualStep) for m in a)
    assert all(m.h == 0.5 for m in a)
    b = serial_resnet(mk, 6, T=3.0, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # layer k's weights depend on (seed, k) only, not on N
    c = serial_resnet(mk, 9, T=3.0, seed=4)
    for k in range(6):
        assert all(torch.equal(p, q) for p, q in zip(a[k].parameters(), c[k].parameters()))
    torch.manual_seed(layer_seed(4, 2))
    assert all(torch.equal(p, q) for p, q in zip(mk(2).parameters(), a[2].F.parameters()))
    d = serial_resnet(mk, 6, T=3.0, seed=5)
    assert not torch.equal(a[0].F.linear.weight, d[0].F.linear.weight)
    assert not torch.equal(a[0].F.linear.weight, a[1].F.linear.weight)
    x = torch.randn(2, 3)
    y = x
    for m in a:
        y = y + 0.5 * m.F(y)
    assert torch.equal(a(x), y)


# -- construction errors (COMM_SELF, one rank) ---------------------------------------------------
def _steps(n, width=3):
    return [DenseStep(width).double() for _ in range(n)]


@pytest.mark.parametrize("bad", [nn.SyncBatchNorm(3), nn.Dropout(0.2), nn.Dropout2d(0.2),
                                 nn.AlphaDropout(0.2)])
def test_unsupported_layers_named(bad):
    steps = _steps(5)
    steps[3] = nn.Sequential(nn.Linear(3, 3), bad)
    with pytest.raises(ValueError, match=rf"layer 3 contains {type(bad).__name__}"):
        LayerParallelResNet(steps, 5, (3,))


def test_construction_errors():
    with pytest.raises(ValueError, match="4"):
        LayerParallelResNet(_steps(4), 5, (3,))
    with pytest.raises(ValueError, match="6"):
        LayerParallelResNet(_steps(6), 5, (3,))
    with pytest.raises(ValueError, match="adjoint"):
        LayerParallelResNet(_steps(5), 5, (3,), adjoint="backprop")
    for T in (0, 0.0, -1.0):
        with pytest.raises(ValueError, match="T="):
            LayerParallelResNet(_steps(5), 5, (3,), T=T)
    for n in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="n_layers"):
            LayerParallelResNet(_steps(5), n, (3,))
    model = LayerParallelResNet(_steps(5), 5, (3,))
    with pytest.raises(ValueError, match="x0"):
        model(None, batch_size=2)


def test_comm_self_matches_serial():
    """One-rank sanity check without mpiexec: exact solve == serial autograd."""
    mk = lambda k: DenseStep(3, "tanh").double()  # noqa: E731
    opts = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=50)
    model = LayerParallelResNet.build(mk, 7, (3,), seed=2, T=2.0, forward=opts, backward=opts)
    ser = serial_resnet(mk, 7, T=2.0, seed=2)
    x = torch.randn(4, 3)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = model(xa), ser(xb)
    assert torch.allclose(ya, yb, rtol=0, atol=1e-12)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.allclose(xa.grad, xb.grad, rtol=0, atol=1e-11)
    for p, q in zip(model.parameters(), ser.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-11)
    net = LayerParallelNet(None, model, None)
    assert isinstance(net.opening, nn.Identity) and isinstance(net.closing, nn.Identity)


# -- closed-form batched VJP of dense steps ------------------------------------------------------
@pytest.mark.parametrize("act", ["tanh", "relu", "smoothrelu"])
def test_dense_vjp_batched_equals_autograd(act):
    """DenseStep.vjp_batched (used by the adjoint MGRIT's batched steps and parameter sweep)
    == autograd through forward_batched, float64, to 1e-13 relative; inputs straddle the
    activations' kinks (SmoothReLU's +-eps, ReLU's 0)."""
    torch.manual_seed(3)
    step = DenseStep(6, act)
    assert step.closed_form_vjp
    B, n, w = 5, 7, 6
    p = {"linear.weight": torch.randn(B, w, w), "linear.bias": torch.randn(B, w)}
    x = torch.randn(B, n, w) * 0.3
    v = torch.randn(B, n, w)
    xr = x.clone().requires_grad_(True)
    pr = {k: t.clone().requires_grad_(True) for k, t in p.items()}
    gx, gw, gb = torch.autograd.grad(step.forward_batched(pr, xr), [xr, *pr.values()], v)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    assert rel(step.vjp_batched(p, x, v), gx) <= 1e-13
    g = step.vjp_batched(p, x, v, params=True)
    assert rel(g["linear.weight"], gw) <= 1e-13 and rel(g["linear.bias"], gb) <= 1e-13
    assert g["linear.weight"].shape == (B, w, w) and g["linear.bias"].shape == (B, w)


def test_adjoint_chain_closed_form_matches_autograd_fallback():
    """The adjoint chain's batched steps and parameter gradients are the same with the
    closed-form VJP and with the autograd fallback (an activation without a closed form)."""
    from mgrit.nn.chains import AdjointChain, ForwardChain

    class Tanh2(nn.Tanh):  # same function, but not the built-in type: no closed form
        pass

    torch.manual_seed(4)
    N, n, w = 12, 5, 4
    steps = [DenseStep(w, "tanh") for _ in range(N)]
    fb = [DenseStep(w, "tanh") for _ in range(N)]
    for s, t in zip(steps, fb):
        t.load_state_dict(s.state_dict())
        t.act = Tanh2()
    states = torch.randn(N + 1, n, w)
    chains = [AdjointChain(ForwardChain(st, 0, 0.1), N, states) for st in (steps, fb)]
    assert chains[0].fwd._stack.closed_form_vjp and not chains[1].fwd._stack.closed_form_vjp
    for c in chains:
        c.fwd.refresh()
    mu = torch.randn(3, n, w)
    a, b = (c.step_batch(mu, range(1, 10, 4), range(3, 12, 4), 0) for c in chains)
    assert torch.allclose(a, b, rtol=0, atol=1e-14)
    lam = torch.randn(N, n, w)
    ga, gb = (c.parameter_gradients(lam, True) for c in chains)
    loop = chains[0].parameter_gradients(lam, False)
    assert len(ga) == len(gb) == len(loop) == 2 * N
    for x, y, z in zip(ga, gb, loop):
        assert x.shape == z.shape
        assert torch.allclose(x, y, rtol=0, atol=1e-14) and torch.allclose(x, z, rtol=0, atol=1e-14)


def test_heterogeneous_steps_are_not_batched_and_act_swaps_fall_back():
    """Review findings: layers that differ in a non-parameter setting (tanh vs relu, SmoothReLU
    eps) must not be batched with the first layer's settings; an activation replaced after
    build() makes the adjoint fall back to autograd instead of failing. Exact mode vs serial
    autograd, float64."""
    from mgrit.nn.chains import _Stacked

    assert not _Stacked([DenseStep(4, "tanh"), DenseStep(4, "relu")]).ok
    a, b = DenseStep(4, "smoothrelu"), DenseStep(4, "smoothrelu")
    b.act.eps = 0.25
    assert not _Stacked([a, b]).ok and _Stacked([a, DenseStep(4, "smoothrelu")]).ok
    opts = MGRITOptions(max_levels=3, cfactor=2, tol=1e-13, max_iter=80)

    def compare(mk, swap=None):
        torch.manual_seed(0)
        lp = LayerParallelResNet.build(mk, 16, (4,), forward=opts, backward=opts)
        ser = serial_resnet(mk, 16)
        if swap is not None:
            for s in list(lp.steps) + [r.F for r in ser]:
                s.act = swap()
        x = torch.randn(5, 4)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = lp(xa), ser(xb)
        assert ((ya - yb).norm() / yb.norm()).item() <= 1e-12
        ya.square().sum().backward()
        yb.square().sum().backward()
        for p, q in zip(lp.parameters(), ser.parameters()):
            assert ((p.grad - q.grad).norm() / q.grad.norm()).item() <= 1e-10

    compare(lambda k: DenseStep(4, ["tanh", "relu"][k % 2]))

    class Sin(nn.Module):
        def forward(self, z):
            return torch.sin(z)

    compare(lambda k: DenseStep(4, "tanh"), swap=Sin)


@pytest.mark.parametrize("bias", [False, True])
def test_twoconv_bias_batched_equals_per_layer(bias):
    """TwoConvStep(bias=...) : forward_batched over 3 layers == the per-layer forwards (float64,
    1e-13), and the bias option reaches both convolutions."""
    torch.manual_seed(1)
    steps = [TwoConvStep(2, 3, "relu", bias=bias).double() for _ in range(3)]
    assert (steps[0].conv1.bias is not None) == bias and (steps[0].conv2.bias is not None) == bias
    p = {n: torch.stack([s.get_parameter(n) for s in steps]).detach()
         for n, _ in steps[0].named_parameters()}
    x = torch.randn(3, 4, 2, 5, 5, dtype=DT)
    ref = torch.stack([s(x[b]) for b, s in enumerate(steps)])
    out = steps[0].forward_batched(p, x)
    assert (out - ref).norm() <= 1e-13 * ref.norm()
    with pytest.raises(ValueError, match="bias"):
        TwoConvStep(2, bias=1)


def test_single_level_warning_once_per_segment():
    """A cfactor too coarse for N: one warning per segment (its forward and adjoint solvers
    share the propagator), a second segment warns again."""
    import warnings as _w
    mk = lambda k: DenseStep(3, "tanh").double()  # noqa: E731
    opts = MGRITOptions(max_levels=2, cfactor=100, tol=1e-13, max_iter=50)
    for _ in range(2):
        with _w.catch_warnings(record=True) as got:
            _w.simplefilter("always")
            LayerParallelResNet.build(mk, 8, (3,), seed=2, forward=opts, backward=opts)
        single = [w for w in got if "has a single level" in str(w.message)]
        assert len(single) == 1, [str(w.message) for w in got]
        assert "cfactor=100" in str(single[0].message)


@pytest.mark.parametrize("kind", ["conv", "twoconv"])
def test_conv_steps_3d_batched_and_exact_vs_serial(kind):
    """dims=3 conv steps (voxel states (batch, C, D, H, W), nn.Conv3d): forward_batched over 3
    layers == the per-layer forwards (float64, 1e-13); a layer-parallel ResNet of them (3
    levels, exact mode) equals serial autograd in output and gradients (1e-10); dims 1 or 4
    are refused naming the value."""
    torch.manual_seed(2)
    mk = lambda k: make_step(kind, 2, "tanh", 3, dims=3)  # noqa: E731
    steps = [mk(k) for k in range(3)]
    assert type(steps[0].get_submodule("conv" if kind == "conv" else "conv1")) is nn.Conv3d
    assert steps[0].kernel_obstacle() is None
    p = {n: torch.stack([s.get_parameter(n) for s in steps]).detach()
         for n, _ in steps[0].named_parameters()}
    x = torch.randn(3, 2, 2, 5, 4, 3, dtype=DT)
    ref = torch.stack([s(x[b]) for b, s in enumerate(steps)])
    assert (steps[0].forward_batched(p, x) - ref).norm() <= 1e-13 * ref.norm()
    opts = MGRITOptions(max_levels=3, cfactor=2, tol=1e-13, max_iter=80)
    lp = LayerParallelResNet.build(mk, 8, (2, 5, 4, 3), seed=3, forward=opts, backward=opts)
    ser = serial_resnet(mk, 8, seed=3)
    x0 = torch.randn(2, 2, 5, 4, 3)
    xa, xb = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    ya, yb = lp(xa), ser(xb)
    assert ((ya - yb).norm() / yb.norm()).item() <= 1e-12
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert ((xa.grad - xb.grad).norm() / xb.grad.norm()).item() <= 1e-10
    for a, b in zip(lp.parameters(), ser.parameters()):
        assert ((a.grad - b.grad).norm() / b.grad.norm()).item() <= 1e-10
    for bad in (1, 4, True):
        with pytest.raises(ValueError, match=f"dims={bad!r}"):
            make_step(kind, 2, "tanh", 3, dims=bad)
