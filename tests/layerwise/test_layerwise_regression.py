"""The regression path of layer-wise training (``loss="mse"``), one process: the replicas'
loss shares give the gradient of the global-batch MSE (against autograd of ``F.mse_loss``
on the whole batch), one-stage DGL and one-layer sequential training equal plain
backpropagation on ``F.mse_loss`` (float64, bit for bit), every method reduces the test MSE
of a small regression task, accuracies are None, and bad losses/targets are refused by name.
Multi-replica and pipelined equality: test_layerwise_mpi.py."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layerwise import (DecoupledModel, DecoupledTrainer, SequentialTrainer, build_method,
                       global_batches, make_head, shard, shard_loss, train_layerwise)
from layerwise.common import mse_loss


def _layers(depth=2, width=12, d_in=2, seed=0):
    torch.manual_seed(seed)
    dims = [d_in] + [width] * depth
    return [nn.Sequential(nn.Linear(a, b), nn.Tanh()).double() for a, b in zip(dims, dims[1:])]


def _task(n, seed):
    """Smooth 2-output regression on [-2, 2]^2 (float64): targets (n, 2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=torch.float64) * 4 - 2
    return x, torch.stack([torch.sin(x[:, 0]) * x[:, 1], torch.cos(x[:, 1])], 1)


@pytest.mark.parametrize("n,R", [(7, 3), (5, 2), (2, 3), (6, 3)])
def test_mse_shares_average_to_the_global_batch_gradient(n, R):
    """Mean over R replicas of the gradients of their shares == gradient of F.mse_loss over
    the global batch (unequal shards, an empty shard, equal shards)."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    x, y = torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(n, 4, generator=g,
                                                                            dtype=torch.float64)
    (ref,) = torch.autograd.grad(F.mse_loss(x @ w, y), w)
    total = torch.zeros_like(w)
    for r in range(R):
        j = torch.as_tensor(shard(np.arange(n), r, R))
        (grad,) = torch.autograd.grad(shard_loss(x[j] @ w, y[j], n, R, loss="mse"), w)
        total += grad
    torch.testing.assert_close(total / R, ref, rtol=0, atol=1e-15)
    # the evaluation form: per-sample sums add up to the mean over samples and outputs
    with torch.no_grad():
        assert abs(float(mse_loss(x @ w, y, reduction="sum")) / n - float(F.mse_loss(x @ w, y))) < 1e-15


def test_mse_one_stage_dgl_and_one_layer_sequential_are_plain_backprop():
    x, y = _task(40, 1)
    epochs, B, lr, seed = 2, 8, 0.05, 3
    # DGL, one stage: its update is the plain SGD step on F.mse_loss of the whole network
    model = DecoupledModel(_layers(), 2, (2,), num_stages=1, seed=seed, loss="mse")
    tr = DecoupledTrainer(model, lr=lr, momentum=0.5)
    ref = DecoupledModel(_layers(), 2, (2,), num_stages=1, seed=seed, loss="mse")
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.5)
    for e in range(epochs):
        batches = global_batches(len(y), B, seed, e)
        tr.train_epoch(x, y, batches)
        for b in batches:
            b = torch.as_tensor(b)
            opt.zero_grad()
            F.mse_loss(ref(x[b]), y[b]).backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    # sequential, one layer, no head re-fit: plain backprop of (layer, head) in the Trainer
    layer = _layers(depth=1)
    seq = SequentialTrainer(layer, 2, (2,), epochs_per_layer=epochs, head_epochs=0,
                            batch_size=B, lr=lr, seed=seed, loss="mse")
    hist = seq.fit(x, y, x[:9], y[:9])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = make_head("linear", (12,), 2, dtype=torch.float64)
    net = nn.Sequential(_layers(depth=1)[0], head)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    want = []
    for e in range(epochs):
        tot = 0.0
        for b in global_batches(len(y), B, seed, e):
            b = torch.as_tensor(b)
            loss = F.mse_loss(net(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item() * len(b)
        with torch.no_grad():
            want.append([tot / len(y), F.mse_loss(net(x[:9]), y[:9]).item()])
    assert [[h["loss"], h["test_loss"]] for h in hist] == want
    assert all(h["train_acc"] is None and h["test_acc"] is None for h in hist)
    assert all(torch.equal(a, b) for a, b in zip(seq.network.parameters(), net.parameters()))
    assert seq.evaluate(x[:9], y[:9]) == {"loss": want[-1][1], "acc": None}


@pytest.mark.parametrize("method,kw", [
    ("sequential", dict(epochs=6)),
    ("sequential", dict(epochs=6, grow="before_output")),
    ("decoupled", dict(epochs=10, ensemble=True)),
    ("decoupled", dict(epochs=10, asynchronous=True, buffer_size=4)),
])
def test_every_method_reduces_the_test_mse_of_a_regression_task(method, kw):
    x, y = _task(160, 2)
    tx, ty = _task(60, 3)
    res = train_layerwise(method, _layers(), 2, x.float().numpy(), y.float().numpy(),
                          tx.numpy(), ty.numpy(), batch_size=16, lr=0.05, loss="mse",
                          progress=False, **kw)
    initial = res["result"].plan.initial_test_loss
    variance = float(ty.var(0, unbiased=False).mean())  # MSE of predicting the mean
    final = res["final"]
    assert final["acc"] is None and final["loss"] == pytest.approx(res["test_loss"][-1], abs=1e-12)
    assert final["loss"] < 0.1 * variance < 0.1 * initial, (final, variance, initial)
    assert len(res["test_loss"]) == len(res["loss"]) and res["loss"][-1] < res["loss"][0]
    assert all(a is None for a in res["train_acc"] + res["test_acc"])
    if kw.get("ensemble"):
        assert res["ensemble_acc"][-1] is None and res["ensemble_loss"][-1] < variance
        assert final["stage_acc"] == [None, None] and final["stage_loss"][-1] == final["loss"]
    # float targets are cast to the layers' dtype (float64 here)
    assert res["model"](tx[:3]).dtype == torch.float64


def test_bad_loss_and_targets_are_refused_by_name():
    x, y = _task(20, 4)
    labels = torch.randint(0, 2, (20,))
    with pytest.raises(ValueError, match=r"loss='l1' is not allowed: use one of cross_entropy, mse"):
        train_layerwise("sequential", _layers(), 2, x, y, loss="l1", progress=False)
    for make in (lambda: build_method("decoupled", _layers(), 2, (2,), loss="huber"),
                 lambda: DecoupledModel(_layers(), 2, (2,), num_stages=2, loss=None),
                 lambda: SequentialTrainer(_layers(), 2, (2,), loss="MSE")):
        with pytest.raises(ValueError, match="is not allowed: use one of cross_entropy, mse"):
            make()
    cases = [(labels, "mse", r"train_y of dtype torch.int64 and shape \(20,\) is not allowed "
                             r"with loss='mse': use float targets of shape \(n, 2\)"),
             (y[:, 0], "mse", r"shape \(20,\) is not allowed with loss='mse'"),
             (y, "mse", None),
             (torch.cat([y, y], 1), "mse", r"shape \(20, 4\) is not allowed with loss='mse'"),
             (y, "cross_entropy", r"train_y of dtype torch.float64 and shape \(20, 2\) is not "
                                  r"allowed with loss='cross_entropy': use integer class labels"),
             (labels.double(), "cross_entropy", r"float64 and shape \(20,\) is not allowed")]
    for method in ("sequential", "decoupled"):
        for targets, loss, msg in cases:
            if msg is None:
                continue
            with pytest.raises(ValueError, match=msg):
                train_layerwise(method, _layers(), 2, x, targets, loss=loss, progress=False)
    # methods built directly: the targets are checked at every step (before any collective)
    # and by the standalone loops
    seq = SequentialTrainer(_layers(), 2, (2,), epochs_per_layer=1, loss="mse")
    with pytest.raises(ValueError, match=r"y of dtype torch.int64 .* loss='mse'"):
        seq.fit(x, labels)
    model = DecoupledModel(_layers(), 2, (2,), num_stages=2, loss="mse")
    with pytest.raises(ValueError, match=r"shape \(20, 4\) is not allowed with loss='mse'"):
        DecoupledTrainer(model).train_epoch(x, torch.cat([y, y], 1), global_batches(20, 8, 0, 0))
