"""TransformerStep (pre-LN block as a residual step, Jiang et al. 2026), one process, float64.

References: ``nn.TransformerEncoderLayer(norm_first=True, dropout=0)`` with the same weights
(``x + F(x)`` is a standard pre-LN block, 1e-12 relative); ``forward_batched`` against one
``forward`` call per layer (values and autograd gradients in ``x`` and every stacked parameter,
1e-12 relative, every linear kernel, in one group and in groups of layers); the solver's chain
with and without batching. The benchmark's ``--smoke`` mode runs in-process.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from mgrit.nn.chains import ForwardChain
from mgrit.nn.steps.transformer import LINEAR_KERNELS, TransformerStep

ROOT = Path(__file__).resolve().parents[2]
DT = torch.float64
TOL = 1e-12


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _steps(B, d, heads, causal=False, act="gelu", d_ff=None, seed=0):
    """``B`` layers with their default init, LayerNorm affine parameters perturbed (so the
    stacked affine path is exercised: the default 1/0 would hide a wrong layer's row)."""
    torch.manual_seed(seed)
    steps = [TransformerStep(d, heads, d_ff, causal=causal, act=act, dtype=DT) for _ in range(B)]
    with torch.no_grad():
        for s in steps:
            for ln in (s.norm1, s.norm2):
                ln.weight.add_(0.3 * torch.randn_like(ln.weight))
                ln.bias.add_(0.3 * torch.randn_like(ln.bias))
    return steps


def _stack(steps, grad=False):
    names = [n for n, _ in steps[0].named_parameters()]
    return {n: torch.stack([s.get_parameter(n).detach() for s in steps]).requires_grad_(grad)
            for n in names}


# -- construction -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=10, n_heads=3), "not divisible by n_heads=3"),
    (dict(d_model=0, n_heads=1), "d_model=0"),
    (dict(d_model=8, n_heads=0), "n_heads=0"),
    (dict(d_model=8, n_heads=2, d_ff=0), "d_ff=0"),
    (dict(d_model=8.0, n_heads=2), "d_model=8.0"),
    (dict(d_model=True, n_heads=1), "d_model=True"),
    (dict(d_model=8, n_heads=2, act="swish"), "act='swish'"),
    (dict(d_model=8, n_heads=2, causal=1), "causal=1"),
    (dict(d_model=8, n_heads=2, dropout=1.0), "dropout=1.0 is not allowed"),
    (dict(d_model=8, n_heads=2, drop_path=-0.1), "drop_path=-0.1 is not allowed"),
    (dict(d_model=8, n_heads=2, dropout=-1.0), "dropout=-1.0"),
])
def test_construction_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerStep(**kwargs)


def test_defaults_and_init():
    s = TransformerStep(16, 4)
    assert (s.d_ff, s.d_head, s.causal, s.act) == (64, 4, False, "gelu")
    assert s.qkv.weight.shape == (48, 16) and s.fc1.weight.shape == (64, 16)
    assert torch.equal(s.norm1.weight, torch.ones(16))
    assert torch.equal(s.norm2.bias, torch.zeros(16))
    bound = 16 ** -0.5  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert s.qkv.weight.abs().max() <= bound and s.qkv.weight.abs().max() > 0.8 * bound
    assert s.fc2.weight.abs().max() <= 64 ** -0.5
    assert TransformerStep(8, 2, dtype=DT).fc2.bias.dtype == DT


def test_input_errors():
    s = TransformerStep(8, 2)
    with pytest.raises(ValueError, match=r"\(batch, tokens, d_model\) with d_model=8"):
        s(torch.zeros(2, 3, 6))
    with pytest.raises(ValueError, match="d_model=8"):
        s(torch.zeros(3, 8))
    p = _stack([s, s])
    with pytest.raises(ValueError, match=r"\(layers, batch, tokens, d_model\)"):
        s.forward_batched(p, torch.zeros(2, 3, 8))
    t = TransformerStep(8, 2)
    t.linear_kernel = "matmul"
    with pytest.raises(ValueError, match="linear_kernel='matmul'"):
        t.forward_batched(p, torch.zeros(2, 1, 3, 8))


# -- x + F(x) is a standard pre-LN block -------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_equals_torch_pre_ln_encoder_layer(causal, act):
    (s,) = _steps(1, 12, 3, causal=causal, act=act, d_ff=20)
    ref = nn.TransformerEncoderLayer(12, 3, 20, dropout=0.0, activation=act, batch_first=True,
                                     norm_first=True, dtype=DT)
    with torch.no_grad():
        for dst, src in [(ref.self_attn.in_proj_weight, s.qkv.weight),
                         (ref.self_attn.in_proj_bias, s.qkv.bias),
                         (ref.self_attn.out_proj.weight, s.proj.weight),
                         (ref.self_attn.out_proj.bias, s.proj.bias),
                         (ref.linear1.weight, s.fc1.weight), (ref.linear1.bias, s.fc1.bias),
                         (ref.linear2.weight, s.fc2.weight), (ref.linear2.bias, s.fc2.bias),
                         (ref.norm1.weight, s.norm1.weight), (ref.norm1.bias, s.norm1.bias),
                         (ref.norm2.weight, s.norm2.weight), (ref.norm2.bias, s.norm2.bias)]:
            dst.copy_(src)
    x = torch.randn(3, 7, 12, dtype=DT)
    mask = nn.Transformer.generate_square_subsequent_mask(7, dtype=DT) if causal else None
    y = ref(x, src_mask=mask, is_causal=causal)
    assert _rel(x + s(x), y) <= TOL
    if causal:  # the mask matters: a later token does not change earlier outputs
        x2 = x.clone()
        x2[:, -1] += 1.0
        assert torch.equal(s(x2)[:, :-1], s(x)[:, :-1])
        assert not torch.equal(s(x2)[:, -1], s(x)[:, -1])


def test_gelu_tanh_is_gpt2_gelu():
    (s,) = _steps(1, 8, 2, act="gelu_tanh")
    (e,) = _steps(1, 8, 2, act="gelu")
    x = torch.randn(2, 4, 8, dtype=DT)
    a = s.proj(s._attend(s.qkv(s.norm1(x)), 2, 4))
    hid = s.fc1(s.norm2(x + a))
    z = 0.5 * hid * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (hid + 0.044715 * hid ** 3)))
    assert _rel(s(x), a + s.fc2(z)) <= TOL
    assert not torch.allclose(s(x), e(x))  # same seed, other activation: differs


# -- forward_batched == per-layer calls ---------------------------------------------------------
SHAPES = [  # B, batch, tokens, d_model, heads, d_ff
    (1, 2, 4, 8, 2, None), (3, 2, 4, 8, 2, None), (5, 1, 1, 8, 2, 16), (2, 3, 1, 6, 3, 7),
    (4, 1, 9, 12, 4, 5), (7, 2, 3, 4, 1, None), (2, 5, 16, 16, 2, 32), (16, 2, 5, 8, 8, 8),
]


@pytest.mark.parametrize("B,batch,tokens,d,heads,d_ff", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_batched_equals_per_layer(B, batch, tokens, d, heads, d_ff, causal):
    for act in ("gelu", "relu", "gelu_tanh"):
        steps = _steps(B, d, heads, causal, act, d_ff, seed=B + tokens)
        x = torch.randn(B, batch, tokens, d, dtype=DT)
        ref = torch.stack([s(x[b]) for b, s in enumerate(steps)])
        per_layer = batch * tokens * max(3 * d, steps[0].d_ff)
        for kernel in LINEAR_KERNELS:
            for chunk in (None, 1, 2 * per_layer):  # one group; groups of 1; of 2 (uneven)
                steps[0].linear_kernel = kernel
                if chunk is not None:
                    steps[0].chunk_elements = chunk
                out = steps[0].forward_batched(_stack(steps), x)
                assert out.shape == x.shape and out.dtype == DT
                assert _rel(out, ref) <= TOL, (act, kernel, chunk, _rel(out, ref))


@pytest.mark.parametrize("kernel", sorted(LINEAR_KERNELS))
@pytest.mark.parametrize("causal,chunk", [(False, None), (True, None), (True, 3 * 10 * 32)])
def test_forward_batched_gradients(kernel, causal, chunk):
    """The adjoint solve's batched VJPs and parameter gradients go through autograd of
    forward_batched: both must equal per-layer autograd."""
    B, batch, tokens, d = 4, 2, 5, 8
    steps = _steps(B, d, 2, causal, seed=7)
    x = torch.randn(B, batch, tokens, d, dtype=DT)
    v = torch.randn(B, batch, tokens, d, dtype=DT)
    xb = x.clone().requires_grad_(True)
    p = _stack(steps, grad=True)
    steps[0].linear_kernel = kernel
    if chunk is not None:  # groups of 3 layers: 3 + 1
        steps[0].chunk_elements = chunk
    (steps[0].forward_batched(p, xb) * v).sum().backward()
    for b, s in enumerate(steps):
        xs = x[b].clone().requires_grad_(True)
        (s(xs) * v[b]).sum().backward()
        assert _rel(xb.grad[b], xs.grad) <= TOL
        for name, q in s.named_parameters():
            assert _rel(p[name].grad[b], q.grad) <= TOL, (b, name)


def test_layer_groups(monkeypatch):
    """chunk_elements bounds the layers applied together: 2 layers' worth -> groups 2, 2, 1."""
    steps = _steps(5, 8, 2)
    sizes = []
    orig = TransformerStep._forward_group
    monkeypatch.setattr(TransformerStep, "_forward_group",
                        lambda self, lin, p, x: sizes.append(x.shape[0]) or orig(self, lin, p, x))
    x = torch.randn(5, 2, 3, 8, dtype=DT)
    steps[0].forward_batched(_stack(steps), x)
    assert sizes == [5]  # the default budget: one group at this size
    sizes.clear()
    steps[0].chunk_elements = 2 * (2 * 3 * 32)  # batch * tokens * max(3 d, d_ff), two layers
    steps[0].forward_batched(_stack(steps), x)
    assert sizes == [2, 2, 1]


def test_float32_batched_close():
    steps = [TransformerStep(16, 4) for _ in range(3)]
    x = torch.randn(3, 4, 8, 16)
    ref = torch.stack([s(x[b]) for b, s in enumerate(steps)])
    out = steps[0].forward_batched(_stack(steps), x)
    assert out.dtype == torch.float32 and _rel(out, ref) <= 1e-5


# -- through the solver's chain ----------------------------------------------------------------
def test_chain_batches_transformer_steps():
    steps = _steps(5, 8, 2, causal=True, seed=3)
    chain = ForwardChain(steps, first=10, h=1.0)
    assert chain.batched
    u = torch.randn(3, 2, 4, 8, dtype=DT)
    out = chain.step_batch(u, range(10, 15, 2), range(11, 16, 2), 0)
    ref = torch.stack([u[j] + steps[2 * j](u[j]) for j in range(3)])
    assert _rel(out, ref) <= TOL


@pytest.mark.parametrize("other", [dict(causal=True), dict(act="relu"), dict(n_heads=4)])
def test_chain_does_not_stack_different_settings(other):
    kw = dict(d_model=8, n_heads=2, dtype=DT)
    steps = [TransformerStep(**kw), TransformerStep(**{**kw, **other})]
    assert not ForwardChain(steps, first=0, h=1.0).batched


# -- the benchmark's smoke mode ----------------------------------------------------------------
def test_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_transformer",
                                                  ROOT / "experiments" / "benchmarks" / "bench_transformer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--smoke", "--out", str(tmp_path)])
    text = (tmp_path / "bench_transformer.md").read_text()
    assert "commit" in text and "| d_model |" in text
    assert len(rows) == len(bench.SMOKE_SIZES)
    for r in rows:  # timings are not checked (no test depends on timing); values are
        assert {"speedup", "bound"} <= set(r) and r["max_rel_diff"] <= 1e-5
