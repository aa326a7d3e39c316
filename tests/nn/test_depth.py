"""Depth transfer of residual-network weights (mgrit.nn.depth), serial (float64).

References: hand-written stencils (``theta_{2j} = Theta_j``, ``theta_{2j+1} = (Theta_j +
Theta_{j+1})/2``, ...), bitwise; the round trip restriction(prolongation) = identity, bitwise;
the coarse network's output, to O(h) with observed order 1 (error ratios in [1.6, 2.4] for
N = 8..64); ``<P u, g> = <u, P^T g>`` for the adjoint, 1e-13 relative. Multi-rank checks live in
tests/multilevel/test_multilevel_mpi.py.
"""
import math

import pytest
import torch
from torch import nn

from mgrit.nn import (ConvStep, DenseStep, LayerParallelNet, LayerParallelResNet, ResidualStep,
                      TwoConvStep)
from mgrit.nn.depth import DepthTransfer, depth_stencil, prolong, restrict, transfer_weights
from mgrit.options import MGRITOptions

DT = torch.float64
W = 4


class GatedStep(nn.Module):
    """A step with several parameter kinds, a LayerNorm and a float buffer (stands in for any
    step class with equal shapes across layers)."""

    def __init__(self, width=W):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.a = nn.Linear(width, 2 * width)
        self.b = nn.Linear(2 * width, width, bias=False)
        self.register_buffer("scale", torch.rand(width))

    def forward(self, x):
        return self.scale * self.b(torch.tanh(self.a(self.norm(x))))


def transformer_step():
    return nn.TransformerEncoderLayer(d_model=W, nhead=2, dim_feedforward=8, dropout=0.0,
                                      batch_first=True)


MAKERS = {
    "dense": (lambda: DenseStep(W, "tanh"), (5, W)),
    "conv": (lambda: ConvStep(2, 3, "relu"), (2, 2, 5, 5)),
    "twoconv": (lambda: TwoConvStep(2, 3, "smoothrelu"), (2, 2, 5, 5)),
    "gated": (GatedStep, (5, W)),
    "transformer": (transformer_step, (2, 3, W)),
}


def _seq(kind, n, T=1.0, seed=0, ends=False):
    make = MAKERS[kind][0]
    torch.manual_seed(seed)
    layers = [ResidualStep(make().to(DT), T / n) for _ in range(n)]
    with torch.no_grad():  # make every parameter and buffer distinct per layer
        for k, layer in enumerate(layers):
            for t in layer.state_dict().values():
                if t.is_floating_point():
                    t.add_(torch.randn(t.shape, dtype=DT) * 0.1 + 0.01 * k)
    if ends:
        return nn.Sequential(nn.Linear(3, W).to(DT), *layers, nn.Linear(W, 2).to(DT))
    return nn.Sequential(*layers)


def _states(seq):
    return [s.F.state_dict() for s in seq if isinstance(s, ResidualStep)]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stencils_by_hand():
    assert depth_stencil("constant", 3, 6) == [[(0, 1.0)], [(0, 1.0)], [(1, 1.0)], [(1, 1.0)],
                                               [(2, 1.0)], [(2, 1.0)]]
    assert depth_stencil("linear", 2, 6) == [[(0, 1.0)], [(0, 2 / 3), (1, 1 / 3)],
                                             [(0, 1 / 3), (1, 2 / 3)], [(1, 1.0)], [(1, 1.0)],
                                             [(1, 1.0)]]
    assert depth_stencil("injection", 6, 3) == [[(0, 1.0)], [(2, 1.0)], [(4, 1.0)]]
    assert depth_stencil("average", 4, 2) == [[(0, 0.5), (1, 0.5)], [(2, 0.5), (3, 0.5)]]


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_prolong_weights_by_hand(kind):
    c = _seq(kind, 3, T=2.0)
    for method in ("constant", "linear"):
        f = prolong(c, method=method)
        assert len(f) == 6 and all(s.h == 2.0 / 6 for s in f)
        fs, cs = _states(f), _states(c)
        for j in range(3):
            assert _same(fs[2 * j], cs[j])
            if method == "constant" or j == 2:
                assert _same(fs[2 * j + 1], cs[j])
            else:
                for n, t in cs[j].items():
                    ref = (t + cs[j + 1][n]) * 0.5
                    assert torch.equal(fs[2 * j + 1][n], ref), n
        # the copies are independent modules
        assert f[0].F is not f[1].F and f[0].F is not c[0].F


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("factor", [2, 4])
def test_round_trip_exact(kind, factor):
    c = _seq(kind, 3, ends=True)
    pairs = [("constant", "injection"), ("linear", "injection"), ("constant", "average")]
    for p, r in pairs:
        back = restrict(prolong(c, factor, p), factor, r)
        assert [type(m) for m in back] == [type(m) for m in c]
        assert all(s.h == c[1].h for s in back if isinstance(s, ResidualStep))
        assert _same(back.state_dict(), c.state_dict()), (p, r)
    # linear then average is not a projection: it smooths (documented, not an identity)
    back = restrict(prolong(c, factor, "linear"), factor, "average")
    assert not _same(back.state_dict(), c.state_dict())


def _smooth_seq(n, T=1.0):
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(W, W, generator=g, dtype=DT), torch.randn(W, W, generator=g, dtype=DT)
    a, b = torch.randn(W, generator=g, dtype=DT), torch.randn(W, generator=g, dtype=DT)
    layers = []
    for k in range(n):
        t = k * T / n
        s = DenseStep(W, "tanh").to(DT)
        with torch.no_grad():
            s.linear.weight.copy_(A * math.cos(2 * t) + B * t)
            s.linear.bias.copy_(a + b * math.sin(3 * t))
        layers.append(ResidualStep(s, T / n))
    return nn.Sequential(*layers)


def _piecewise_random_seq(n, T=1.0):
    """Independent random weights on 4 fixed pieces of [0, T) (a rough control)."""
    torch.manual_seed(3)
    pieces = [DenseStep(W, "tanh").to(DT) for _ in range(4)]
    return nn.Sequential(*[ResidualStep(pieces[4 * k // n], T / n) for k in range(n)])


@pytest.mark.parametrize("method,build", [("constant", _smooth_seq), ("linear", _smooth_seq),
                                          ("constant", _piecewise_random_seq)])
def test_prolonged_output_first_order(method, build):
    x = torch.randn(16, W, dtype=DT, generator=torch.Generator().manual_seed(1))
    errs = []
    for n in (8, 16, 32, 64):
        c = build(n)
        f = prolong(c, method=method)
        with torch.no_grad():
            yc, yf = c(x), f(x)
        errs.append(((yf - yc).norm() / yc.norm()).item())
    ratios = [errs[i] / errs[i + 1] for i in range(3)]
    print(f"{method}/{build.__name__}: errors {errs} ratios {ratios}")
    assert all(1.6 <= r <= 2.4 for r in ratios), (errs, ratios)
    assert errs[-1] < 1e-2


def _dot(a, b):
    return sum(float((x * y).sum()) for x, y in zip(a, b))


@pytest.mark.parametrize("method,nc,nf", [("constant", 3, 6), ("linear", 3, 6), ("linear", 2, 6),
                                          ("constant", 2, 8)])
def test_adjoint_dot_product(method, nc, nf):
    c, f = _seq("gated", nc, ends=True), _seq("gated", nf, ends=True)
    P = DepthTransfer(c, f, method)
    Pt = P.adjoint()
    g = torch.Generator().manual_seed(5)
    u = [torch.randn(p.shape, dtype=DT, generator=g) for p in c.parameters()]
    v = [torch.randn(p.shape, dtype=DT, generator=g) for p in f.parameters()]
    lhs, rhs = _dot(P(u), v), _dot(u, Pt(v))
    assert abs(lhs - rhs) <= 1e-13 * abs(lhs)
    # P applied to the weights equals transfer_weights (parameters only here)
    Pw = P([p.detach() for p in c.parameters()])
    transfer_weights(c, f, method)
    assert all(torch.equal(a, b) for a, b in zip(Pw, f.parameters()))
    # restrictions: R P = I on parameters (injection)
    R = DepthTransfer(f, c, "injection")
    assert all(torch.equal(a, b) for a, b in zip(R(P(u)), u))


def test_constant_adjoint_sums_layers():
    """P^T of the piecewise-constant prolongation sums the fine layers of each coarse layer."""
    c, f = _seq("dense", 2), _seq("dense", 4)
    Pt = DepthTransfer(c, f, "constant").adjoint()
    g = [torch.randn(p.shape, dtype=DT) for p in f.parameters()]
    out = Pt(g)  # parameters() order: layer0.weight, layer0.bias, layer1.weight, ...
    assert torch.equal(out[0], g[0] + g[2]) and torch.equal(out[1], g[1] + g[3])
    assert torch.equal(out[2], g[4] + g[6]) and torch.equal(out[3], g[5] + g[7])


def _lp(n, T=1.0, seed=0, **kw):
    opts = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=60)
    return LayerParallelResNet.build(lambda k: DenseStep(W, "tanh").to(DT), n, (W,), T=T, seed=seed,
                                     forward=opts, backward=opts, **kw)


def test_layer_parallel_one_rank_matches_serial():
    c = _lp(5, T=1.5)
    for method in ("constant", "linear"):
        f = prolong(c, method=method)
        assert isinstance(f, LayerParallelResNet) and f.n_layers == 10 and f.h == 1.5 / 10
        assert f.fwd_opts is c.fwd_opts
        ref = prolong(c.to_serial(), method=method)
        assert _same(f.to_serial().state_dict(), ref.state_dict())
    r = restrict(_lp(8), method="injection")
    assert r.n_layers == 4 and _same(r.to_serial().state_dict(),
                                     restrict(_lp(8).to_serial(), method="injection").state_dict())
    # LayerParallelNet <-> its serial form (ends copied, layers transferred)
    net = LayerParallelNet(nn.Linear(3, W).to(DT), _lp(4), nn.Linear(W, 2).to(DT))
    fine = prolong(net, method="linear")
    assert isinstance(fine, LayerParallelNet) and fine.resnet.n_layers == 8
    ref = prolong(net.to_serial(), method="linear")
    assert _same(fine.to_serial().state_dict(), ref.state_dict())
    seq = _seq("dense", 8, ends=True)
    transfer_weights(seq, net, "average")
    assert _same(net.to_serial().state_dict(), restrict(seq, method="average").state_dict())


def test_errors():
    c4, c3 = _seq("dense", 4), _seq("dense", 3)
    with pytest.raises(ValueError, match="restriction of N=3 layers \\(segment 0\\) by factor 2"):
        restrict(c3)
    with pytest.raises(ValueError, match="must be a multiple of the coarse depth"):
        transfer_weights(c4, _seq("dense", 10, T=1.0), "linear")
    with pytest.raises(ValueError, match="must be a multiple"):
        transfer_weights(_seq("dense", 6), c4, "injection")
    with pytest.raises(ValueError, match="step classes/shapes differ"):
        transfer_weights(c4, _seq("gated", 8), "constant")
    wide = nn.Sequential(*[ResidualStep(DenseStep(W + 1).to(DT), 1 / 8) for _ in range(8)])
    with pytest.raises(ValueError, match="step classes/shapes differ"):
        transfer_weights(c4, wide, "constant")
    relu = nn.Sequential(*[ResidualStep(DenseStep(W, "relu").to(DT), 1 / 8) for _ in range(8)])
    with pytest.raises(ValueError, match="step classes/shapes differ"):
        transfer_weights(c4, relu, "constant")
    mixed = nn.Sequential(ResidualStep(DenseStep(W).to(DT), 0.5),
                          ResidualStep(GatedStep().to(DT), 0.5))
    with pytest.raises(ValueError, match="source network's residual steps in segment 0 differ"):
        prolong(mixed)
    with pytest.raises(ValueError, match="does not follow the depth"):
        transfer_weights(c4, _seq("dense", 8, T=2.0), "constant")
    two = nn.Sequential(ResidualStep(DenseStep(W), 0.5), nn.Tanh(), ResidualStep(DenseStep(W), 0.5))
    with pytest.raises(ValueError, match="structures differ"):
        transfer_weights(c4, prolong(two), "constant")
    with pytest.raises(ValueError, match="no ResidualStep"):
        prolong(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="method 'cubic' is not allowed"):
        prolong(c4, method="cubic")
    with pytest.raises(ValueError, match="factor=0 is not allowed"):
        prolong(c4, factor=0)
    with pytest.raises(ValueError, match="structures differ"):
        transfer_weights(_seq("dense", 4, ends=True), _seq("dense", 8), "constant")
    other_end = _seq("dense", 8, ends=True)
    other_end[0] = nn.Linear(3, W + 1).to(DT)
    with pytest.raises(ValueError, match="ordinary module 0 differs"):
        transfer_weights(_seq("dense", 4, ends=True), other_end, "constant")
    with pytest.raises(TypeError, match="is not supported"):
        prolong(nn.Linear(2, 2))


def test_segments():
    """Several segments (runs of ResidualStep with one step size, ordinary modules between) are
    transferred each on its own; adjacent runs with different steps are separate segments."""
    torch.manual_seed(4)
    a = [ResidualStep(DenseStep(W).to(DT), 1 / 2) for _ in range(2)]
    b = [ResidualStep(GatedStep().to(DT), 2 / 4) for _ in range(4)]
    c = [ResidualStep(DenseStep(W).to(DT), 1 / 3) for _ in range(3)]
    net = nn.Sequential(nn.Linear(3, W).to(DT), *a, nn.Tanh(), *b, *c, nn.Linear(W, 2).to(DT))
    fine = prolong(net, 2, "linear")
    steps = [m for m in fine if isinstance(m, ResidualStep)]
    assert [s.h for s in steps] == [1 / 4] * 4 + [2 / 8] * 8 + [1 / 6] * 6
    assert all(type(s.F) is GatedStep for s in steps[4:12])
    for seg, lo, n in ((a, 0, 2), (b, 4, 4), (c, 12, 3)):
        for j in range(n):
            assert _same(steps[lo + 2 * j].F.state_dict(), seg[j].F.state_dict())
            nxt = seg[min(j + 1, n - 1)].F.state_dict()
            mid = {k: (t + nxt[k]) * 0.5 if j + 1 < n else t
                   for k, t in seg[j].F.state_dict().items()}
            assert _same(steps[lo + 2 * j + 1].F.state_dict(), mid)
    back = restrict(fine, 2, "injection")
    assert _same(back.state_dict(), net.state_dict())
    with pytest.raises(ValueError, match="segment 2\\) by factor 2"):
        restrict(net, 2)
