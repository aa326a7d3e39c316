"""Layer-parallel transformer checks run on k ranks by tests/nn/test_transformer_mpi.py (float64).

Each rank builds the serial reference (``serial_resnet`` of the same ``TransformerStep``s, same
per-layer seeds) and asserts on its part: output and loss on the last layer rank, the input
gradient on the first, every parameter gradient of its own layers. ``T = N``, so ``h = 1``: the
chain is a standard pre-LN transformer stack (Jiang et al. 2026).
"""
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import LayerParallelNet, LayerParallelResNet, serial_resnet
from mgrit.nn.steps.transformer import TransformerStep
from mgrit.options import MGRITOptions

COMM = MPI.COMM_WORLD
DT = torch.float64
D, HEADS, TOKENS, BATCH, VOCAB = 8, 2, 4, 2, 11
EXACT = dict(tol=1e-13, max_iter=80)


def _maker(causal):
    """Encoder (gelu) or causal decoder (GPT-2's gelu_tanh) layers; the LayerNorm affine
    parameters are perturbed from their 1/0 init (drawn after the build's per-layer seed)."""
    act = "gelu_tanh" if causal else "gelu"

    def make(k):
        s = TransformerStep(D, HEADS, causal=causal, act=act, dtype=DT)
        with torch.no_grad():
            for ln in (s.norm1, s.norm2):
                ln.weight.add_(0.2 * torch.randn_like(ln.weight))
                ln.bias.add_(0.2 * torch.randn_like(ln.bias))
        return s
    return make


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _build(causal, n, levels, cfactor, seed):
    opts = MGRITOptions(max_levels=levels, cfactor=cfactor, **EXACT)
    return LayerParallelResNet.build(_maker(causal), n, (TOKENS, D), comm=COMM, seed=seed,
                                     T=float(n), forward=opts, backward=opts)


def _layer_errors(model, layers, tol):
    """Relative error of every local parameter gradient vs ``layers[k].F`` (asserted)."""
    worst = 0.0
    for j, s in enumerate(model.steps):
        k = model.first + j
        for (name, p), (name_s, q) in zip(s.named_parameters(), layers[k].F.named_parameters()):
            assert name == name_s and p.grad is not None, f"layer {k} {name}: no gradient"
            e = _rel(p.grad, q.grad)
            assert e <= tol, f"layer {k} {name}: grad rel err {e}"
            worst = max(worst, e)
    return worst


def _check_batched_used(model, cfactor):
    """A rank holding at least two C-points' intervals relaxes them in one batched call."""
    calls = (model.last_forward.stats.steps_batched_calls,
             model.last_backward.stats.steps_batched_calls)
    if len(model.steps) >= 2 * cfactor:
        assert min(calls) > 0, f"{len(model.steps)} local layers but batched calls {calls}"
    return calls


def check_exact(causal, n, levels, cfactor, tol=1e-10):
    """Exact mode: output, loss, input gradient, every parameter gradient vs serial autograd."""
    torch.set_default_dtype(DT)
    seed = 5
    x = _rand(BATCH, TOKENS, D, seed=21)
    w = _rand(BATCH, TOKENS, D, seed=22)
    ser = serial_resnet(_maker(causal), n, T=float(n), seed=seed)
    assert all(layer.h == 1.0 for layer in ser)
    xs = x.clone().requires_grad_(True)
    y_ref = ser(xs)
    loss_ref = (y_ref * w).sum()
    loss_ref.backward()

    model = _build(causal, n, levels, cfactor, seed)
    xl = x.clone().requires_grad_(True) if model.is_first else None
    out = model(xl, batch_size=BATCH)
    loss = (out * w).sum() if model.is_last else out.sum()
    loss.backward()
    worst = 0.0
    if model.is_last:
        e, e2 = _rel(out, y_ref), abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
        assert e <= tol and e2 <= tol, f"output rel err {e}, loss rel err {e2}"
        worst = max(worst, e, e2)
    if model.is_first:
        e = _rel(xl.grad, xs.grad)
        assert e <= tol, f"input grad rel err {e}"
        worst = max(worst, e)
    worst = max(worst, _layer_errors(model, ser, tol))
    calls = _check_batched_used(model, cfactor)
    return COMM.allreduce(worst, op=MPI.MAX), COMM.allreduce(sum(calls), op=MPI.SUM)


class _Embed(nn.Module):
    """Token + learned position embedding: ``(batch, tokens)`` ids -> ``(batch, tokens, D)``."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D, dtype=DT)
        self.pos = nn.Parameter(0.1 * torch.randn(TOKENS, D, dtype=DT))

    def forward(self, ids):
        return self.tok(ids) + self.pos


def _lm_parts(seed=41):
    torch.manual_seed(seed)
    return _Embed(), nn.Sequential(nn.LayerNorm(D, dtype=DT), nn.Linear(D, VOCAB, dtype=DT))


def _lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def check_lm_exact(n, levels, cfactor, tol=1e-10):
    """A tiny causal language model (token + position embedding -> layer-parallel decoder ->
    LN + vocabulary head, next-token cross-entropy) through LayerParallelNet vs the same model
    serially: loss, every parameter gradient (embedding, layers, head)."""
    torch.set_default_dtype(DT)
    seed = 6
    g = torch.Generator().manual_seed(51)
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    emb, head = _lm_parts()
    layers = serial_resnet(_maker(True), n, T=float(n), seed=seed)
    ser = nn.Sequential(emb, *layers, head)
    loss_ref = _lm_loss(ser(x), y)
    loss_ref.backward()

    emb2, head2 = _lm_parts()
    net = LayerParallelNet(emb2, _build(True, n, levels, cfactor, seed), head2)
    loss = net.loss(net(x), y, fn=_lm_loss)
    loss.backward()
    worst = 0.0
    if net.is_last:
        e = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
        assert e <= tol, f"loss rel err {e}"
        worst = e
        for (nm, p), q in zip(net.closing.named_parameters(), head.parameters()):
            e = _rel(p.grad, q.grad)
            assert e <= tol, f"head {nm}: grad rel err {e}"
            worst = max(worst, e)
    if net.resnet.is_first:
        for (nm, p), q in zip(net.opening.named_parameters(), emb.parameters()):
            e = _rel(p.grad, q.grad)
            assert e <= tol, f"embedding {nm}: grad rel err {e}"
            worst = max(worst, e)
    worst = max(worst, _layer_errors(net.resnet, layers, tol))
    return COMM.allreduce(worst, op=MPI.MAX), net.from_last(loss.item())
