"""Sequential freezing/caching, single-process DGL, and accuracy on sklearn digits."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layerwise import DecoupledModel, DecoupledTrainer, SequentialTrainer, global_batches
from layerwise import train_layerwise


def mlp(depth=3, width=16, d_in=12, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    dims = [d_in] + [width] * depth
    return [nn.Sequential(nn.Linear(a, b), nn.Tanh()).to(dtype) for a, b in zip(dims, dims[1:])]


def data(n=40, d=12, classes=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("grow", ["top", "before_output"])
def test_sequential_freezes_lower_layers_and_caches_their_outputs(grow):
    layers = mlp()
    x, y = data()
    tx, ty = data(n=10, seed=2)
    calls = [0] * len(layers)
    snaps = {}
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, inp, out, i=i: calls.__setitem__(i, calls[i] + 1))

    def log(rec):  # at the end of every epoch: snapshot of every layer already frozen
        k = rec["stage"] if isinstance(rec["stage"], int) else len(layers)
        for j in range(k):
            snap = [p.detach().clone() for p in layers[j].parameters()]
            if j in snaps:
                assert all(torch.equal(a, b) for a, b in zip(snaps[j][0], snap)), \
                    f"layer {j} changed during stage {rec['stage']}"
                assert calls[j] == snaps[j][1], f"layer {j} recomputed during stage {rec['stage']}"
            else:
                snaps[j] = (snap, calls[j])

    tr = SequentialTrainer(layers, 4, (12,), grow=grow, epochs_per_layer=3, head_epochs=2,
                           batch_size=8, cache_batch_size=1000, log=log)
    before = [p.detach().clone() for p in layers[1].parameters()]
    hist = tr.fit(x, y, tx, ty)
    assert [h["stage"] for h in hist] == [0] * 3 + [1] * 3 + [2] * 3 + ["head"] * 2
    assert set(snaps) == {0, 1, 2}
    # each layer: 1 shape probe at set-up, 5 training batches + 1 test evaluation per epoch x 3
    # epochs while it trains, then one pass over the train and one over the test cache (chunk
    # 1000 > n) when it is frozen -- never again in later stages or the head re-fit; layer 0
    # also once for the training loop's evaluation before training (stage 0's network)
    assert calls == [1 + 1 + 3 * (5 + 1) + 2] + [1 + 3 * (5 + 1) + 2] * 2
    assert not all(torch.equal(a, b) for a, b in zip(before, layers[1].parameters()))
    assert all(p.requires_grad for l in layers for p in l.parameters())  # flags restored
    assert torch.equal(tr.cached_features, tr.network[:-1](x).detach()) or \
        torch.allclose(tr.cached_features, tr.network[:-1](x), atol=1e-14)
    assert len(tr.heads) == (3 if grow == "top" else 1)
    tr2 = SequentialTrainer(mlp(seed=5), 4, (12,), grow=grow)
    tr2.load_state_dict(tr.state_dict())
    assert tr2.evaluate(tx, ty) == tr.evaluate(tx, ty)


def test_sequential_finetune_moves_lower_layers_and_grow_before_output_checks_shapes():
    layers = mlp(depth=2)
    x, y = data()
    seen = {}

    def log(rec):  # layer 0's weight after the head re-fit (frozen) and after fine-tuning
        seen[rec["stage"]] = layers[0][0].weight.detach().clone()

    tr = SequentialTrainer(layers, 4, (12,), epochs_per_layer=1, head_epochs=1, finetune_epochs=1,
                           batch_size=8, log=log)
    tr.fit(x, y)
    assert [h["stage"] for h in tr.history] == [0, 1, "head", "finetune"]
    assert torch.equal(seen[0], seen["head"])  # frozen after its stage
    assert not torch.equal(seen["head"], seen["finetune"])  # fine-tuning trains it again
    bad = [nn.Linear(12, 16).double(), nn.Linear(16, 8).double()]
    with pytest.raises(ValueError, match="grow='before_output' keeps one output head.*layer 1"):
        SequentialTrainer(bad, 4, (12,), grow="before_output")


def test_one_stage_dgl_is_plain_backprop_and_stages_get_detached_inputs():
    x, y = data()
    model = DecoupledModel(mlp(), 4, (12,), num_stages=1, seed=0)
    ref = DecoupledModel(mlp(), 4, (12,), num_stages=1, seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    tr = DecoupledTrainer(model, lr=0.1, momentum=0.5)
    for e in range(2):
        batches = global_batches(len(y), 8, 0, e)
        tr.train_epoch(x, y, batches)
        for b in batches:
            b = torch.as_tensor(b)
            opt.zero_grad()
            F.cross_entropy(ref(x[b]), y[b]).backward()
            opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    # K = 3: the local loss of stage 2 leaves stages 0, 1 untouched (no gradient crosses stages)
    m3 = DecoupledModel(mlp(), 4, (12,), num_stages=3)
    out = m3.bodies[1](m3.bodies[0](x)).detach()
    F.cross_entropy(m3.heads[2](m3.bodies[2](out)), y).backward()
    assert all(p.grad is None for k in (0, 1) for p in m3.stage_parameters(k))


def test_async_dgl_replay_buffer_is_bounded_and_trains():
    x, y = data(n=64)
    model = DecoupledModel(mlp(), 4, (12,), num_stages=3)
    tr = DecoupledTrainer(model, asynchronous=True, buffer_size=3, lr=0.1)
    first = tr.train_epoch(x, y, global_batches(64, 8, 0, 0))
    for e in range(1, 15):
        last = tr.train_epoch(x, y, global_batches(64, 8, 0, e))
    assert all(len(b) == 3 for b in tr.buffers)
    assert last["loss"] < first["loss"]


@pytest.mark.slow
def test_digits_accuracy_end_to_end_sequential_decoupled():
    from sklearn.datasets import load_digits
    X, yy = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    p = np.random.default_rng(0).permutation(len(yy))
    tr, te = p[:1400], p[1400:]
    accs = {}
    for name, method, kw in [("end-to-end", "decoupled", dict(num_stages=1)),
                             ("sequential", "sequential", {}),
                             ("decoupled", "decoupled", dict(ensemble=True))]:
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(64, 64), nn.ReLU())] + \
                 [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2)]
        res = train_layerwise(method, layers, 10, X[tr], yy[tr], X[te], yy[te], epochs=4,
                              batch_size=32, lr=0.05, progress=False, **kw)
        accs[name] = res["final"]["acc"]
        assert len(res["loss"]) == len(res["test_acc"]) == len(res["time"])
    print(accs)
    assert all(a > 0.85 for a in accs.values()), accs
