"""GRU parallel in time, one process (float64): the chain against nn.GRUCell and autograd, the
module against unrolled nn.GRUCell / nn.GRU, bad inputs, the classifier, the adding problem and
the benchmark's --smoke mode. Multi-rank checks: tests/nn/test_gru_mpi.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_sequence

from data.sequences import ADDING_BASELINE_MSE, make_adding_problem
from mgrit.nn.gru import ParallelGRU
from mgrit.nn.gru.chains import GRUAdjointChain, GRUChain
from mgrit.nn.gru.classifier import GRUSequenceClassifier, image_rows
from mgrit.options import MGRITOptions

DT = torch.float64
B, I, H = 3, 2, 4


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(DT)
    yield
    torch.set_default_dtype(old)


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


def _cell_and_chain(n, seed=0, coarse="power"):
    torch.manual_seed(seed)
    cell = nn.GRUCell(I, H)
    x = _rand(B, n, I, seed=seed + 1)
    with torch.no_grad():  # per-step projections, as nn.GRUCell computes them
        gi = torch.stack([F.linear(x[:, t], cell.weight_ih, cell.bias_ih) for t in range(n)])
    chain = GRUChain(gi, cell.weight_hh.detach(), cell.bias_hh.detach(), 0, coarse)
    return cell, x, chain


# -- the chain -------------------------------------------------------------------------------
def test_fine_step_is_grucell_to_roundoff():
    cell, x, chain = _cell_and_chain(9)
    h = ref = _rand(B, H, seed=5)
    with torch.no_grad():
        for t in range(9):
            ref = cell(x[:, t], ref)
            h = chain.step(h, t, t + 1, 0)
            # round-off: bitwise where torch's GRUCell kernel orders its operations as the
            # chain does; on some CPUs (vectorized sigmoid/tanh, FMA) the last bit differs
            assert (h - ref).abs().max() <= 1e-15, \
                f"step {t} differs by {(h - ref).abs().max().item()}"


@pytest.mark.parametrize("coarse", ["power", "implicit"])
@pytest.mark.parametrize("span", [1, 4])
def test_step_batch_equals_step(coarse, span):
    _, _, chain = _cell_and_chain(24, coarse=coarse)
    U = _rand(5, B, H, seed=7)
    for starts in (range(0, 20, 4), [3, 0, 7, 11, 2]):  # the solver's ranges, and any order
        stops = [s + span for s in starts]
        got = chain.step_batch(U, starts, stops, 1)
        want = torch.stack([chain.step(U[b], s, s + span, 1) for b, s in enumerate(starts)])
        assert _rel(got, want) <= 1e-14
    mixed = chain.step_batch(U, [0, 4, 8, 12, 16], [1, 8, 9, 16, 20], 0)  # unequal spans
    want = torch.stack([chain.step(U[b], s, e, 0) for b, (s, e) in
                        enumerate(zip([0, 4, 8, 12, 16], [1, 8, 9, 16, 20]))])
    assert _rel(mixed, want) <= 1e-14


def test_coarse_steps_definition():
    """power: dt fine steps with the gates and n frozen; implicit: the linearly implicit step."""
    _, _, power = _cell_and_chain(8, coarse="power")
    implicit = GRUChain(power.gi, power.w_hh, power.b_hh, 0, "implicit")
    h = _rand(B, H, seed=9)
    gh = F.linear(h, power.w_hh, power.b_hh)
    i_r, i_z, i_n = power.gi[2].chunk(3, -1)
    h_r, h_z, h_n = gh.chunk(3, -1)
    z, r = torch.sigmoid(i_z + h_z), torch.sigmoid(i_r + h_r)
    n = torch.tanh(i_n + r * h_n)
    frozen = h
    for _ in range(5):
        frozen = (1 - z) * n + z * frozen
    assert _rel(power.step(h, 2, 7, 1), frozen) <= 1e-14
    c = 5 * (1 - z)
    assert _rel(implicit.step(h, 2, 7, 1), (h + c * n) / (1 + c)) <= 1e-14
    assert torch.equal(implicit.step(h, 2, 3, 0), power.step(h, 2, 3, 0))  # fine: nn.GRUCell


@pytest.mark.parametrize("coarse", ["power", "implicit"])
@pytest.mark.parametrize("span", [1, 3])
def test_adjoint_step_is_the_vjp(coarse, span):
    """The adjoint step from reversed point i is (dPhi/dh)^T (mu + s) of the forward step of
    layer N-1-i, against torch.autograd; batched equals single."""
    n = 12
    _, _, chain = _cell_and_chain(n, coarse=coarse)
    states = _rand(n, B, H, seed=11)
    sources = _rand(n, B, H, seed=12)
    adj = GRUAdjointChain(chain, n, states, sources)
    mus = _rand(4, B, H, seed=13)
    starts = [0, 3, 6, 9]
    for b, i in enumerate(starts):
        k = n - 1 - i
        h = states[k].clone().requires_grad_(True)
        y = chain.step(h, k, k + span, 1)
        (want,) = torch.autograd.grad(y, h, mus[b] + sources[k])
        assert _rel(adj.step(mus[b], i, i + span, 1), want) <= 1e-13
    got = adj.step_batch(mus, range(0, 12, 3), range(span, 12 + span, 3), 1)
    want = torch.stack([adj.step(mus[b], i, i + span, 1) for b, i in enumerate(starts)])
    assert _rel(got, want) <= 1e-14


def test_gate_gradients_give_autograd_parameter_gradients():
    n = 6
    cell, x, chain = _cell_and_chain(n)
    states = _rand(n, B, H, seed=21)
    cot = _rand(n, B, H, seed=22)
    adj = GRUAdjointChain(chain, n, states)
    dgh, dgi = adj.gate_gradients(cot)
    ys = torch.stack([cell(x[:, t], states[t]) for t in range(n)])
    params = [cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh]
    grads = torch.autograd.grad(ys, params, cot)
    mine = [dgi.reshape(-1, 3 * H).t() @ x.transpose(0, 1).reshape(-1, I),
            dgh.reshape(-1, 3 * H).t() @ states.reshape(-1, H), dgi.sum((0, 1)), dgh.sum((0, 1))]
    for g, m in zip(grads, mine):
        assert _rel(m, g) <= 1e-13


# -- the module on one rank ------------------------------------------------------------------
def _model(levels=2, cfactor=2, coarse="power", bias=True, seed=0, **o):
    torch.manual_seed(seed)
    opts = MGRITOptions(max_levels=levels, cfactor=cfactor, **{"tol": 1e-13, "max_iter": 80, **o})
    return ParallelGRU(I, H, forward=opts, backward=opts, coarse=coarse, bias=bias)


def _serial(model, x, h0, w, ws):
    cell = nn.GRUCell(I, H, bias=model.bias)
    cell.load_state_dict(model.state_dict())
    xs, hs = x.clone().requires_grad_(True), h0.clone().requires_grad_(True)
    h, outs = hs, []
    for t in range(x.shape[1]):
        h = cell(xs[:, t], h)
        outs.append(h)
    seq = torch.stack(outs, 1)
    ((h * w).sum() + (seq * ws).sum()).backward()
    return h, seq, xs.grad, hs.grad, cell


@pytest.mark.parametrize("levels,cfactor,coarse,bias", [(2, 4, "power", True),
                                                        (3, 2, "implicit", True),
                                                        (3, 2, "power", False)])
def test_exact_matches_unrolled_grucell(levels, cfactor, coarse, bias):
    n = 19
    model = _model(levels, cfactor, coarse, bias)
    x, h0 = _rand(B, n, I, seed=31), _rand(B, H, seed=32)
    w, ws = _rand(B, H, seed=33), _rand(B, n, H, seed=34)
    h_ref, seq_ref, gx_ref, gh_ref, cell = _serial(model, x, h0, w, ws)
    xp, hp = x.clone().requires_grad_(True), h0.clone().requires_grad_(True)
    h, seq = model(xp, hp, return_sequence=True)
    ((h * w).sum() + (seq * ws).sum()).backward()
    assert model.last_forward.iterations > 1 and model.last_backward.iterations > 1
    for a, b in [(h, h_ref), (seq, seq_ref), (xp.grad, gx_ref), (hp.grad, gh_ref),
                 *zip([p.grad for p in model.parameters()], [q.grad for q in cell.parameters()])]:
        assert _rel(a, b) <= 1e-10


def test_one_level_is_nn_gru_to_roundoff():
    model = _model(levels=1)
    gru = model.to_gru()
    x = _rand(B, 17, I, seed=41)
    out_ref, hn_ref = gru(x)
    (out_ref.sum() + hn_ref.square().sum()).backward()
    h, seq = model(x, return_sequence=True)
    assert (seq - out_ref).abs().max() <= 1e-14 and (h - hn_ref[0]).abs().max() <= 1e-14
    (seq.sum() + h.square().sum()).backward()
    for p, q in zip(model.parameters(), gru.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-13


def test_inexact_gradient_error_falls_with_iterations():
    n = 64
    x, w = _rand(B, n, I, seed=51), _rand(B, H, seed=52)
    ref = _model(levels=1)
    (ref(x) * w).sum().backward()
    errors = []
    for it in (1, 2, 4, 8):
        m = _model(2, 4, relax="FCF", tol=0.0, max_iter=it)
        (m(x) * w).sum().backward()
        errors.append(max(_rel(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters())))
    print("gradient errors after 1, 2, 4, 8 cycles:", errors)
    assert errors[0] > 1e-6 and errors[-1] < 1e-3 * errors[0], errors
    assert all(v <= 1.5 * u for u, v in zip(errors, errors[1:])), errors


def test_inputs_like_pytorch():
    """Unbatched input and equal-length lists behave like the batched tensor; no_grad builds
    no graph; an in-place parameter update between forward and backward raises, as in PyTorch."""
    model = _model(2, 4)
    x = _rand(B, 13, I, seed=61)
    h = model(x)
    assert _rel(model(x[1]), h[1]) <= 1e-10
    assert _rel(model(list(x)), h) <= 1e-14
    with torch.no_grad():
        assert not model(x).requires_grad
    out = model(x)
    with torch.no_grad():
        model.weight_hh.add_(0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("call,words", [
    (lambda m, x: m(_rand(B, 13, I + 1, seed=1)), ["input size 3", "input_size=2"]),
    (lambda m, x: m(x, _rand(B, H + 1, seed=2)), ["h0", f"({B}, {H})"]),
    (lambda m, x: m(x.float()), ["torch.float32", "torch.float64"]),
    (lambda m, x: m([x[0], x[1, :-2]]), ["unequal lengths", "[13, 11]"]),
    (lambda m, x: m(pack_sequence([x[0], x[1, :-2]])), ["PackedSequence"]),
    (lambda m, x: m(x[0, 0]), ["(batch, seq, input)"]),
    (lambda m, x: m(x, return_sequence=1), ["return_sequence"]),
    (lambda m, x: ParallelGRU(I, 0), ["hidden_size=0"]),
    (lambda m, x: ParallelGRU(I, H, coarse="explicit"), ["explicit"]),
    (lambda m, x: ParallelGRU(I, H, forward=MGRITOptions(nested_iteration=True), warm_start=True),
     ["nested_iteration"]),
])
def test_bad_inputs(call, words):
    model = _model()
    with pytest.raises(ValueError) as e:
        call(model, _rand(B, 13, I, seed=3))
    for wd in words:
        assert wd in str(e.value)


# -- classifier and the adding problem -------------------------------------------------------
def test_classifier_matches_serial_and_image_rows():
    torch.manual_seed(3)
    opts = MGRITOptions(max_levels=2, cfactor=4, tol=1e-13, max_iter=80)
    model = GRUSequenceClassifier(28, 8, 10, forward=opts, backward=opts)
    ser = model.to_serial()
    images = _rand(4, 1, 28, 28, seed=71)
    y = torch.tensor([1, 7, 3, 0])
    x = image_rows(images)
    assert x.shape == (4, 28, 28)
    out = model(x)
    model.loss(out, y).backward()
    ref = ser["head"](ser["gru"](x)[1][0])
    F.cross_entropy(ref, y).backward()
    assert _rel(out, ref) <= 1e-10
    for p, q in zip(model.parameters(), ser.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-10
    with pytest.raises(ValueError, match="single-channel"):
        image_rows(_rand(2, 3, 5, 5, seed=1))


def test_adding_problem():
    x, y = make_adding_problem(500, 1024, seed=4)
    assert x.shape == (500, 1024, 2) and x.dtype == np.float32 and y.dtype == np.float32
    marks = x[..., 1]
    assert set(np.unique(marks)) == {0.0, 1.0} and (marks.sum(1) == 2).all()
    assert (marks[:, :512].sum(1) == 1).all() and (marks[:, 512:].sum(1) == 1).all()
    assert np.array_equal(y, (x[..., 0] * marks).sum(1, dtype=np.float32))
    x2, y2 = make_adding_problem(500, 1024, seed=4)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert not np.array_equal(make_adding_problem(500, 1024, seed=4, stream=1)[1], y)
    _, yb = make_adding_problem(20000, 8, seed=5)
    mse = float(((yb - 1.0) ** 2).mean())  # the constant predictor's error: 1/6 +- ~0.002
    assert abs(mse - ADDING_BASELINE_MSE) < 0.01, mse
    with pytest.raises(ValueError, match="seq_len=1"):
        make_adding_problem(3, 1)


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    """experiments/benchmarks/bench_gru.py --smoke in-process (its 2-rank part as an mpiexec
    subprocess)."""
    path = Path(__file__).resolve().parents[2] / "experiments" / "benchmarks" / "bench_gru.py"
    spec = importlib.util.spec_from_file_location("bench_gru", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    old = torch.get_num_threads()
    try:
        rows = bench.main(["--smoke", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(old)
    table = (tmp_path / "bench_gru.md").read_text()
    assert "- command:" in table and "- commit:" in table and "| N |" in table
    assert [r[0] for r in rows] == [32, 48]
    for r in rows:
        assert all(isinstance(v, float) and v > 0 for v in r[1:7]), r
        assert r[10] < 1e-2  # 2 FCF cycles on 32-48 steps are close to the serial result
