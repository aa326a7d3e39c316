"""Replica state without MPI (one rank, ``COMM_SELF``): synchronized BatchNorm equals torch's
BatchNorm (outputs, input and parameter gradients, running statistics; float64, 1e-13), the
buffer guard catches every kind of buffer change, frozen stages release their gradients and
optimizer state, and the batch schedule uses every sample. Multi-replica equality with the
single-process trainers is tested in test_layerwise_mpi.py."""
import copy
import gc
import weakref

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import layerwise.sequential as sequential_mod
from layerwise import DecoupledModel, DecoupledTrainer, SequentialTrainer, global_batches, shard
from mgrit.parallel.replicas import ReplicaSync, refuse_unsynchronized

SELF = MPI.COMM_SELF

BN_CASES = {
    "1d": (lambda: nn.BatchNorm1d(5), (7, 5)),
    "1d-seq-cumulative": (lambda: nn.BatchNorm1d(5, momentum=None), (7, 5, 3)),
    "2d-no-affine": (lambda: nn.BatchNorm2d(3, affine=False, momentum=0.3), (4, 3, 2, 2)),
    "3d-no-running-stats": (lambda: nn.BatchNorm3d(2, track_running_stats=False), (3, 2, 2, 2, 2)),
    "lazy": (lambda: nn.LazyBatchNorm1d(), (6, 4)),
    "one-sample-2d": (lambda: nn.BatchNorm2d(3), (1, 3, 2, 2)),
}


@pytest.mark.parametrize("case", list(BN_CASES))
def test_synchronized_batch_norm_equals_torch_batch_norm(case):
    make, shape = BN_CASES[case]
    torch.manual_seed(0)
    ref = make().double()
    ref(torch.zeros(shape, dtype=torch.float64))  # materialize lazy parameters
    ref.reset_running_stats() if ref.track_running_stats else None
    if ref.weight is not None:
        with torch.no_grad():
            ref.weight.normal_()
            ref.bias.normal_()
    bn = copy.deepcopy(ref)
    for _ in range(3):
        x = (torch.randn(shape, dtype=torch.float64) * 3 + 1).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        w = torch.randn(shape, dtype=torch.float64)
        y_ref = ref(x)
        (w * y_ref).sum().backward()
        with ReplicaSync([bn], SELF):
            assert "forward" in bn.__dict__
            y = bn(x2)
            (w * y).sum().backward()
        assert "forward" not in bn.__dict__  # the module's own forward is back
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-13)
        torch.testing.assert_close(x2.grad, x.grad, rtol=0, atol=1e-13)
        for p, q in zip(bn.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-13)
        for b, c in zip(bn.buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, rtol=0, atol=1e-13)
    bn.eval(), ref.eval()
    x = torch.randn(shape, dtype=torch.float64)
    with ReplicaSync([bn], SELF):  # eval: the module's own forward (running statistics)
        torch.testing.assert_close(bn(x), ref(x), rtol=0, atol=1e-13)
        assert bn(x).grad_fn is None or "NativeBatchNorm" in type(bn(x).grad_fn).__name__


def test_synchronized_batch_norm_needs_two_values_and_restores_on_error():
    bn = nn.BatchNorm1d(3).double()
    with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training, "
                                         r"got 1 over the global batch of all 1 replicas"):
        with ReplicaSync([nn.Sequential(nn.Linear(2, 3).double(), bn)], SELF):
            bn(torch.zeros(1, 3, dtype=torch.float64))
    assert "forward" not in bn.__dict__


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros((), dtype=torch.int64))
        self.register_buffer("const", torch.ones(3))

    def forward(self, x):
        self.n += 1
        return x


class Replacer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(4))

    def forward(self, x):
        self.last = x.detach().mean(0)  # a new tensor object under the same name
        return x


class LateBuffer(nn.Module):
    def forward(self, x):
        if "seen" not in self._buffers:
            self.register_buffer("seen", torch.ones(1))
        return x


class Constant(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return x * self.scale


@pytest.mark.parametrize("bad,what", [
    (Counter(), r"module 0\.1 \(Counter\) changed its buffer\(s\) 'n' in a training forward"),
    (Replacer(), r"\(Replacer\) changed its buffer\(s\) 'last'"),
    (LateBuffer(), r"\(LateBuffer\) changed its buffer\(s\) 'seen'"),
    (nn.Sequential(nn.Unflatten(1, (2, 2)), nn.InstanceNorm1d(2, track_running_stats=True), nn.Flatten()),
     r"\(InstanceNorm1d\) changed its buffer\(s\) 'running_mean', 'running_var'"),
])
def test_guard_refuses_every_kind_of_buffer_change(bad, what):
    net = nn.Sequential(nn.Linear(4, 4), bad, Constant(), nn.BatchNorm1d(4))
    state = copy.deepcopy(net.state_dict())
    sync = ReplicaSync([net], SELF)
    # at set-up: one probe forward, everything restored afterwards
    with pytest.raises(ValueError, match=what):
        refuse_unsynchronized([sync], [(4,)], torch.float32, SELF)
    assert net.state_dict().keys() == state.keys()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())
    # during training: after backward, before any step
    with sync:
        sync.begin_step()
        net(torch.randn(5, 4)).sum().backward()
        with pytest.raises(ValueError, match=what):
            sync.end_step()


def test_guard_accepts_batch_norm_and_constant_buffers():
    net = nn.Sequential(nn.Linear(4, 4), Constant(), nn.BatchNorm1d(4))
    sync = ReplicaSync([net], SELF)
    refuse_unsynchronized([sync], [(4,)], torch.float32, SELF)
    with sync:
        for _ in range(2):
            sync.begin_step()
            net(torch.randn(5, 4)).sum().backward()
            sync.end_step()
    assert int(net[2].num_batches_tracked) == 2


def _mlp(depth=3, width=16, d_in=12, seed=0):
    torch.manual_seed(seed)
    dims = [d_in] + [width] * depth
    return [nn.Sequential(nn.Linear(a, b), nn.Tanh()).double() for a, b in zip(dims, dims[1:])]


def _data(n=40, d=12, classes=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.slow
@pytest.mark.parametrize("grow", ["top", "before_output"])
def test_finished_stages_release_gradients_and_optimizer_state(monkeypatch, grow):
    """Frozen layers hold no stale gradient and finished stages no optimizer state, during
    training (checked at every epoch) and after it."""
    layers = _mlp()
    x, y = _data()
    optimizers, stages_seen = [], set()
    real = sequential_mod.make_optimizer

    def recording(*args, **kwargs):
        opt = real(*args, **kwargs)
        optimizers.append(weakref.ref(opt))
        return opt

    def log(rec):  # fine-tuning trains (unfreezes) every layer: nothing is frozen then
        k = {"head": len(layers), "finetune": 0}.get(rec["stage"], rec["stage"])
        stale = [(j, i) for j in range(k) for i, p in enumerate(layers[j].parameters()) if p.grad is not None]
        assert not stale, f"stage {rec['stage']}: frozen layers hold gradients {stale}"
        if grow == "top":
            assert all(p.grad is None for h in tr.heads[:min(k, len(layers) - 1)] for p in h.parameters())
        last = rec["epoch"] == len(tr.plan) or tr.plan[rec["epoch"]] != rec["stage"]
        if last:  # the stage's last epoch: released before the epoch's metrics
            assert tr.stage_optimizer is None
            assert all(p.grad is None for p in tr.network.parameters())
        else:
            assert tr.stage_optimizer is optimizers[-1]()
        if rec["stage"] not in stages_seen:  # once per stage (gc.collect is slow)
            stages_seen.add(rec["stage"])
            gc.collect()
            alive = [i for i, ref in enumerate(optimizers[:-1]) if ref() is not None]
            assert not alive, f"stage {rec['stage']}: optimizers of finished stages {alive} alive"

    tr = SequentialTrainer(layers, 4, (12,), grow=grow, epochs_per_layer=2, head_epochs=1,
                           finetune_epochs=1, batch_size=8, momentum=0.9, log=log)
    monkeypatch.setattr(sequential_mod, "make_optimizer", recording)
    tr.fit(x, y)
    gc.collect()
    assert tr.stage_optimizer is None and all(ref() is None for ref in optimizers)
    assert len(optimizers) == len(layers) + 2  # stages, head re-fit, fine-tuning
    assert all(p.grad is None for p in tr.network.parameters())


def test_decoupled_epochs_release_gradients():
    x, y = _data()
    model = DecoupledModel(_mlp(), 4, (12,), num_stages=3)
    tr = DecoupledTrainer(model, lr=0.1)
    tr.train_epoch(x, y, global_batches(len(y), 8, 0, 0))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("n,B,R", [(41, 8, 2), (41, 8, 3), (10, 2, 3), (5, 8, 7)])
def test_every_sample_is_used_for_every_batch_size_and_replica_count(n, B, R):
    batches = global_batches(n, B, 3, 1, num_replicas=R)
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(n))
    for b in batches:
        parts = [shard(b, r, R) for r in range(R)]
        assert all(p.dtype == np.int64 for p in parts)
        assert np.array_equal(np.concatenate(parts), b)
    assert any(len(shard(b, R - 1, R)) == 0 for b in batches)  # some replica has an empty shard
    dropped = global_batches(n, B, 3, 1, num_replicas=R, drop_last=True)
    assert all(len(b) == B for b in dropped) and len(dropped) == n // B
