"""Spatial coarsening of the coarse MGRIT levels (mgrit/spatial/): the built-in transfer
operators against independent formulas (TorchBraid's strided stencils, ``F.interpolate``,
slicing), their transposes, user operators accepted and refused, the build-time refusals, and
exactness against serial PyTorch autograd in float64 on one rank (tests/mpi_cases/nn/
spatial_cases.py; P = 2, 3 in tests/nn/test_spatial_mpi.py)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mgrit.nn import LayerParallelResNet
from mgrit.nn.resnet.seeding import serial_resnet
from mgrit.options import MGRITOptions
from mgrit.propagator import Propagator
from mgrit.solver import MGRIT
from mgrit.spatial import SpatialCoarsening, grids
from tests.mpi_cases.nn import spatial_cases as cases

DT = torch.float64


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


# -- operators ----------------------------------------------------------------------------------
def test_vertex_full_weighting_and_linear_match_torchbraid_stencils():
    """Vertex grid (2^k - 1): full weighting = strided conv with [1,2,1]x[1,2,1]/16, linear =
    transposed conv with the stencil /4 (TorchBraid's operators), in 2-D and 3-D."""
    sp = SpatialCoarsening(grid="vertex")
    s1 = torch.tensor([1.0, 2.0, 1.0], dtype=DT)
    x = _x(3, 2, 7, 7)
    k2 = torch.einsum("i,j->ij", s1, s1).expand(2, 1, 3, 3)
    ref = F.conv2d(x, k2 / 16, stride=2, groups=2)
    assert torch.allclose(sp.restrict(x, 1, (2, 7, 7)), ref, atol=1e-15, rtol=0)
    c = _x(3, 2, 3, 3, seed=1)
    ref = F.conv_transpose2d(c, k2 / 4, stride=2, groups=2)
    assert torch.allclose(sp.prolong(c, 1, (2, 7, 7)), ref, atol=1e-15, rtol=0)
    x3 = _x(2, 2, 7, 7, 7)
    k3 = torch.einsum("i,j,k->ijk", s1, s1, s1).expand(2, 1, 3, 3, 3)
    assert torch.allclose(sp.restrict(x3, 1, (2, 7, 7, 7)),
                          F.conv3d(x3, k3 / 64, stride=2, groups=2), atol=1e-15, rtol=0)


def test_full_weighting_is_the_scaled_transpose_of_the_interpolation():
    for n, grid, natural in ((7, "vertex", "linear"), (15, "vertex", "linear"),
                             (8, "cell", "constant"), (9, "vertex", "linear")):
        f = 3 if n == 9 else 2  # 9 + 1 is not divisible by 3: 8 + 1 is
        n = 8 if n == 9 else n
        R = grids.restriction(n, f, grid, "full_weighting")
        P = grids.prolongation(n, f, grid, natural)
        assert torch.equal(R, P.T / f)
    sp = SpatialCoarsening(grid="vertex")  # 2-D: R = P^T / 4 exactly, via the adjoint ops
    x = _x(2, 2, 7, 7)
    adj = sp.transposed().restrict(x, 1, (2, 7, 7))
    assert torch.allclose(sp.restrict(x, 1, (2, 7, 7)), adj / 4, atol=1e-15, rtol=0)


def test_injection_constant_and_cell_linear_against_slicing_and_interpolate():
    x = _x(2, 3, 7, 7)
    inj = SpatialCoarsening(restrict="injection", prolong="constant")
    assert torch.equal(inj.restrict(x, 1, (3, 7, 7)), x[..., 1::2, 1::2])
    y = _x(2, 3, 8, 6)
    assert torch.equal(inj.restrict(y, 1, (3, 8, 6)), y[..., ::2, ::2])
    c = _x(2, 3, 4, 3)
    assert torch.equal(inj.prolong(c, 1, (3, 8, 6)),
                       c.repeat_interleave(2, -1).repeat_interleave(2, -2))
    avg = SpatialCoarsening(grid="cell")
    assert torch.allclose(avg.restrict(y, 1, (3, 8, 6)), F.avg_pool2d(y, 2), atol=1e-15, rtol=0)
    ref = F.interpolate(c, scale_factor=2, mode="bilinear", align_corners=False)
    assert torch.allclose(avg.prolong(c, 1, (3, 8, 6)), ref, atol=1e-15, rtol=0)


def test_restrict_after_prolong():
    """Injection after linear (vertex) and averaging after constant (cell) are the identity;
    the transposed operators are adjoint: <R x, y> = <x, R^T y>."""
    c = _x(2, 2, 3, 3)
    vi = SpatialCoarsening(restrict="injection", grid="vertex")
    assert torch.allclose(vi.restrict(vi.prolong(c, 1, (2, 7, 7)), 1, (2, 7, 7)), c, atol=1e-15)
    cc = SpatialCoarsening(prolong="constant", grid="cell")
    c4 = _x(2, 2, 4, 4)
    assert torch.allclose(cc.restrict(cc.prolong(c4, 1, (2, 8, 8)), 1, (2, 8, 8)), c4, atol=1e-15)
    for sp, fine in ((SpatialCoarsening(), (2, 7, 7)), (SpatialCoarsening(restrict="injection"),
                                                         (2, 8, 8))):
        x, t = _x(2, *fine, seed=2), sp.transposed()
        y = _x(*sp.restrict(x, 1, fine).shape, seed=3)
        assert abs((sp.restrict(x, 1, fine) * y).sum() - (x * t.prolong(y, 1, fine)).sum()) < 1e-12
        assert abs((sp.prolong(y, 1, fine) * x).sum() - (y * t.restrict(x, 1, fine)).sum()) < 1e-12


def test_shapes_per_level_and_mixed_factors():
    sp = SpatialCoarsening(levels=(1, 3), factor=(2, 3))
    assert sp.level_shapes((4, 8, 17), 4) == [torch.Size(s) for s in
                                              ((4, 8, 17), (4, 4, 5), (4, 4, 5), (4, 2, 1))]
    assert SpatialCoarsening().level_shapes((2, 15), 3)[1:] == [torch.Size((2, 7))] * 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(levels=(0,)), "levels"), (dict(levels="1"), "levels"), (dict(factor=1), "factor"),
    (dict(factor=(2, 2, 2, 2)), "factor"), (dict(restrict="mean"), "restrict"),
    (dict(prolong="cubic"), "prolong"), (dict(grid="node"), "grid"),
    (dict(operators=object()), "operators")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpatialCoarsening(**kwargs)


def test_sizes_that_do_not_coarsen_are_refused():
    with pytest.raises(ValueError, match="does not coarsen"):
        SpatialCoarsening(grid="vertex").check((2, 8, 8), 2)
    with pytest.raises(ValueError, match="does not coarsen"):
        SpatialCoarsening(grid="cell").check((2, 7, 7), 2)
    with pytest.raises(ValueError, match="spatial"):
        SpatialCoarsening().check((5,), 2)


# -- user operators ------------------------------------------------------------------------------
class Pool:
    """2x2 averaging and nearest-neighbour prolongation, written with torch's own functions."""

    def restrict(self, x, level):
        return F.avg_pool2d(x, 2)

    def prolong(self, x, level):
        return F.interpolate(x, scale_factor=2, mode="nearest")

    def coarse_shape(self, shape, level):
        return (shape[0], shape[1] // 2, shape[2] // 2)


def test_user_operators_equal_the_built_in_ones_and_their_transposes():
    user, built = SpatialCoarsening(operators=Pool()), SpatialCoarsening(prolong="constant")
    x, c = _x(3, 2, 8, 8), _x(3, 2, 4, 4, seed=1)
    assert user.check((2, 8, 8), 2)[1] == torch.Size((2, 4, 4))
    for a, b in ((user, built), (user.transposed(), built.transposed())):
        assert torch.allclose(a.restrict(x, 1, (2, 8, 8)), b.restrict(x, 1, (2, 8, 8)), atol=1e-15)
        assert torch.allclose(a.prolong(c, 1, (2, 8, 8)), b.prolong(c, 1, (2, 8, 8)), atol=1e-15)


def test_user_operators_exact_against_serial():
    make = lambda k: cases.conv_step(2)  # noqa: E731
    net = LayerParallelResNet.build(make, cases.N, (2, 8, 8), T=cases.T,
                                    spatial=SpatialCoarsening(operators=Pool()),
                                    forward=cases.options(2, True), backward=cases.options(2, True))
    from mpi4py import MPI
    assert cases.compare(net, serial_resnet(make, cases.N, T=cases.T), (2, 8, 8),
                         MPI.COMM_SELF) <= cases.TOL


class BadShape(Pool):
    def prolong(self, x, level):
        return x


class BadDtype(Pool):
    def restrict(self, x, level):
        return F.avg_pool2d(x, 2).float()


class Raises(Pool):
    def restrict(self, x, level):
        raise RuntimeError("boom")


@pytest.mark.parametrize("ops,match", [(BadShape(), "prolong returned"),
                                       (BadDtype(), "restrict returned"), (Raises(), "boom")])
def test_bad_user_operators_are_refused_at_build(ops, match):
    with pytest.raises(ValueError, match=match):
        LayerParallelResNet.build(lambda k: cases.conv_step(2), 4, (2, 8, 8),
                                  spatial=SpatialCoarsening(operators=ops),
                                  forward=cases.options(2, True), backward=cases.options(2, True))


def test_f_relaxation_above_a_coarsened_level_warns():
    """F-relaxation on level 0 with level 1 coarsened in space stagnates (measured: residual
    16-137 after 29 cycles): a UserWarning names the level; FCF there gives none."""
    import dataclasses
    import warnings
    for relax, warned in ((["F", "FCF"], True), ("FCF", False)):
        o = dataclasses.replace(cases.options(2, True), relax=relax)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            LayerParallelResNet.build(lambda k: cases.conv_step(2), 4, (2, 8, 8),
                                      spatial=SpatialCoarsening(), forward=o, backward=o)
        said = [str(w.message) for w in got if "stagnates" in str(w.message)]
        assert bool(said) == warned, said
        assert not said or "level(s) [1]" in said[0]


# -- layers that cannot run at a coarse size -------------------------------------------------------
class FlatLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2 * 7 * 7, 2 * 7 * 7).to(DT)

    def forward(self, x):
        return self.lin(x.flatten(1)).view_as(x)


@pytest.mark.parametrize("make,name", [
    (lambda k: FlatLinear(), "FlatLinear"),
    (lambda k: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.LayerNorm([2, 7, 7])).to(DT),
     "Sequential")])
def test_steps_with_a_fixed_spatial_size_are_refused_naming_the_layer(make, name):
    with pytest.raises(ValueError, match=rf"layer 0 \({name}\) cannot run at the coarse spatial "
                                         rf"size \(2, 3, 3\) of MGRIT level 1"):
        LayerParallelResNet.build(make, 4, (2, 7, 7), spatial=SpatialCoarsening(),
                                  forward=cases.options(2, True), backward=cases.options(2, True))
    with pytest.raises(ValueError, match="spatial=None is not allowed|SpatialCoarsening"):
        LayerParallelResNet.build(make, 4, (2, 7, 7), spatial="2x",
                                  forward=cases.options(2, True), backward=cases.options(2, True))


# -- BatchNorm -------------------------------------------------------------------------------------
def test_batchnorm_coarse_steps_use_coarse_batch_statistics():
    """A coarse step normalizes with the batch statistics of the coarse state (checked on the
    chain directly), the solve is exact, and the running statistics are updated once per
    forward from the fine states, as serial (never from a coarse level)."""
    make = lambda k: cases.conv_step(2, bn=True)  # noqa: E731
    sp = SpatialCoarsening()
    net = LayerParallelResNet.build(make, cases.N, (2, 7, 7), T=cases.T, spatial=sp,
                                    forward=cases.options(2, False),
                                    backward=cases.options(2, False))
    serial = serial_resnet(make, cases.N, T=cases.T)
    from mpi4py import MPI
    assert cases.compare(net, serial, (2, 7, 7), MPI.COMM_SELF) <= cases.TOL
    for j, step in enumerate(net.steps):
        ref = serial[j].F[1]
        assert torch.allclose(step[1].running_mean, ref.running_mean, atol=1e-13)
        assert torch.allclose(step[1].running_var, ref.running_var, atol=1e-13)
        assert step[1].num_batches_tracked == ref.num_batches_tracked == 1
    u = _x(3, 2, 3, 3, seed=7)  # a coarse state: batch statistics of u, not of a fine state
    step = net.steps[2]
    z = step[0](u)
    mean, var = z.mean((0, 2, 3), keepdim=True), z.var((0, 2, 3), unbiased=False, keepdim=True)
    bn = step[1]
    want = torch.tanh((z - mean) / torch.sqrt(var + bn.eps) * bn.weight.view(1, -1, 1, 1)
                      + bn.bias.view(1, -1, 1, 1))
    before = bn.running_mean.clone()
    from mgrit.nn.steps.batchnorm import frozen_statistics
    with frozen_statistics(net._bns), torch.no_grad():
        got = net._chain.step(u, 2, 4, 1)
    assert torch.allclose(got, u + 2 * net.h * want, atol=1e-13)
    assert torch.equal(bn.running_mean, before)


# -- batched kernel at coarse sizes: probe and fallback ------------------------------------------
class FixedKernelStep(nn.Module):
    """A step whose (contract-breaking) batched kernel only works at the fine size 8 x 8."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1).to(DT)

    def forward(self, x):
        return torch.tanh(self.conv(x))

    def forward_batched(self, p, x):
        if x.shape[-1] != 8:
            return torch.zeros_like(x)
        return torch.stack([torch.tanh(F.conv2d(x[b], p["conv.weight"][b], p["conv.bias"][b],
                                                padding=1)) for b in range(x.shape[0])])


def test_a_batched_kernel_that_fails_at_the_coarse_size_falls_back():
    make = lambda k: FixedKernelStep()  # noqa: E731
    net = LayerParallelResNet.build(make, cases.N, (2, 8, 8), T=cases.T,
                                    spatial=SpatialCoarsening(),
                                    forward=cases.options(2, True), backward=cases.options(2, True))
    assert net._chain.batched and net._chain.plain_shapes == {(2, 4, 4)}
    from mpi4py import MPI
    assert cases.compare(net, serial_resnet(make, cases.N, T=cases.T), (2, 8, 8),
                         MPI.COMM_SELF) <= cases.TOL
    ok = LayerParallelResNet.build(lambda k: cases.conv_step(2), 4, (2, 8, 8),
                                   spatial=SpatialCoarsening(),
                                   forward=cases.options(2, True), backward=cases.options(2, True))
    assert ok._chain.batched and ok._chain.plain_shapes == set()


# -- exactness on one rank -------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    dict(dims=2, size=7), dict(dims=2, size=8, batched=False),
    dict(dims=3, size=5, restrict="injection"), dict(dims=3, size=6, prolong="constant"),
    dict(dims=2, size=8, levels=3, coarsened=(1, 2), grid="cell"),
    dict(dims=2, size=15, levels=3, coarsened=(1, 2), grid="vertex", batched=False),
    dict(dims=1, size=15, levels=3, coarsened=(2,))])
def test_exact_against_serial_one_rank(kw):
    from mpi4py import MPI
    print(cases.check_exact(comm=MPI.COMM_SELF, **kw))


def test_solver_level_heat_equation_converges_to_sequential_stepping():
    """The solver alone (no mgrit.nn): a linear diffusion chain on a 15 x 15 grid, 2 and 3
    levels; the space-time solution equals sequential stepping and the coarse correction
    reduces the residual (factor < 0.5 per cycle)."""
    lap = torch.tensor([[0, 1, 0], [1, -4, 1], [0, 1, 0]], dtype=DT).view(1, 1, 3, 3)

    class Heat(Propagator):
        def step(self, u, a, b, level):  # the Laplacian rediscretized on the state's grid
            scale = ((u.shape[-1] + 1) / 16) ** 2
            return u + (b - a) * 0.1 * scale * F.conv2d(u, lap, padding=1)

    u0 = _x(1, 1, 15, 15)
    ref = [u0]
    for k in range(32):
        ref.append(Heat().step(ref[-1], k, k + 1, 0))
    for levels in (2, 3):
        s = MGRIT(Heat(), 32, (1, 1, 15, 15), options=MGRITOptions(
            max_levels=levels, cfactor=4, tol=1e-13, max_iter=40), spatial=SpatialCoarsening())
        r = s.solve(u0)
        assert r.converged
        assert max((r.states[k] - ref[k]).abs().max().item() for k in range(33)) < 1e-12
        assert r.residuals[3] < 0.5 ** 3 * r.residuals[0]


def test_space_time_equals_time_only_where_the_coarse_grid_is_exact():
    """Pointwise steps (1 x 1 convolutions) on block-constant states (cell grid, averaging and
    constant prolongation): the fine states stay block-constant and the coarse grid represents
    them exactly, so the space-time cycles must reproduce the time-only cycles -- residual
    histories, inexact outputs and gradients (2 forward / 1 adjoint cycles) -- to round-off:
    the FAS right-hand side, the correction and the transposed adjoint operators together."""
    make = lambda k: nn.Sequential(nn.Conv2d(2, 2, 1), nn.Tanh()).to(DT)  # noqa: E731
    x = _x(3, 2, 4, 4).repeat_interleave(2, -1).repeat_interleave(2, -2)
    w = _x(3, 2, 4, 4, seed=1).repeat_interleave(2, -1).repeat_interleave(2, -2)
    out = {}
    for sp in (None, SpatialCoarsening(grid="cell", prolong="constant")):
        fo = MGRITOptions(max_levels=3, cfactor=2, min_coarse=1, tol=0, max_iter=2)
        bo = MGRITOptions(max_levels=3, cfactor=2, min_coarse=1, tol=0, max_iter=1)
        net = LayerParallelResNet.build(make, 16, (2, 8, 8), spatial=sp, forward=fo, backward=bo,
                                        warm_start=False)
        xx = x.clone().requires_grad_(True)
        y = net(xx)
        (y * w).sum().backward()
        out[sp is None] = (y.detach(), xx.grad, [p.grad for p in net.parameters()],
                           net.last_forward.residuals, net.last_backward.residuals)
    a, b = out[True], out[False]
    assert (a[0] - b[0]).abs().max() < 1e-12 and (a[1] - b[1]).abs().max() < 1e-12
    assert max((p - q).abs().max().item() for p, q in zip(a[2], b[2])) < 1e-12
    assert all(abs(r - s) <= 1e-12 * abs(r) + 1e-15 for r, s in zip(a[3] + a[4], b[3] + b[4]))
    exact = serial_resnet(make, 16)(x)  # and the cycles are not yet converged: a real test
    assert (a[0] - exact).abs().max() > 1e-6


def test_set_options_with_new_levels_checks_them():
    """Level 2 is listed but absent at build (2 levels): nothing is coarsened and a fixed-size
    layer is fine; options with 3 levels bring it in and are refused naming the layer."""
    net = LayerParallelResNet.build(lambda k: FlatLinear(), 8, (2, 7, 7),
                                    spatial=SpatialCoarsening(levels=(2,)),
                                    forward=cases.options(2, True), backward=cases.options(2, True))
    ref = serial_resnet(lambda k: FlatLinear(), 8)
    assert torch.allclose(net(_x(2, 2, 7, 7)), ref(_x(2, 2, 7, 7)), atol=1e-12)
    with pytest.raises(ValueError, match=r"layer 0 \(FlatLinear\) cannot run .* level 2"):
        net.set_options(forward=cases.options(3, True))


def test_nested_iteration_keeps_the_initial_value():
    """Nested iteration prolongs the coarse solution in space; the fine initial value (point 0)
    is kept, so the exact solve still equals serial (2 and 3 levels, two coarsened)."""
    make = lambda k: cases.conv_step(2)  # noqa: E731
    for levels in (2, 3):
        o = MGRITOptions(max_levels=levels, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80,
                         nested_iteration=True)
        net = LayerParallelResNet.build(make, cases.N, (2, 7, 7), T=cases.T, forward=o,
                                        backward=o, spatial=SpatialCoarsening(levels=(1, 2)))
        from mpi4py import MPI
        assert cases.compare(net, serial_resnet(make, cases.N, T=cases.T), (2, 7, 7),
                             MPI.COMM_SELF) <= cases.TOL


@pytest.mark.parametrize("extra", [dict(skip_first_relaxation=True), dict(cycle="F"),
                                   dict(c_weight=0.8, relax="FCFCF")])
def test_cycle_options_stay_exact(extra):
    """XBraid's skip (copy down), F-cycles, weighted C-relaxation with two sweeps, and a warm
    start from the previous forward: still serial's solution with spatial coarsening."""
    make = lambda k: cases.conv_step(2)  # noqa: E731
    o = MGRITOptions(max_levels=3, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80, **extra)
    net = LayerParallelResNet.build(make, cases.N, (2, 8, 8), T=cases.T, forward=o, backward=o,
                                    spatial=SpatialCoarsening(levels=(1, 2)), warm_start=True)
    from mpi4py import MPI
    serial = serial_resnet(make, cases.N, T=cases.T)
    for seed in (0, 5):  # the second forward starts from the first one's states
        for p in [*net.parameters(), *serial.parameters()]:
            p.grad = None
        assert cases.compare(net, serial, (2, 8, 8), MPI.COMM_SELF, seed=seed) <= cases.TOL
