"""Heads, stage splits, batch schedule, configuration errors of train_layerwise."""
import numpy as np
import pytest
import torch
from torch import nn

from layerwise import ResidualStep, check_head_fits, global_batches, make_head, shard, split_stages
from layerwise import train_layerwise


@pytest.mark.parametrize("kind,shape", [("linear", (7,)), ("mlp", (7,)), ("linear", (3, 4, 4)),
                                        ("pool", (3, 4, 4)), ("conv", (3, 5, 5))])
def test_heads_map_features_to_logits(kind, shape):
    head = make_head(kind, shape, 4, hidden=8, dtype=torch.float64)
    out = head(torch.randn(5, *shape, dtype=torch.float64))
    assert out.shape == (5, 4) and out.dtype == torch.float64


def test_head_errors_are_clear():
    with pytest.raises(ValueError, match=r"head 'pool' does not fit the stage output shape \(16,\)"):
        make_head("pool", (16,), 3)
    with pytest.raises(ValueError, match="head='softmax' is not allowed: use one of linear, mlp"):
        make_head("softmax", (16,), 3)
    with pytest.raises(ValueError, match="does not fit the stage output shape"):
        make_head(lambda s, c: nn.Linear(10, c), (16,), 3)
    with pytest.raises(ValueError, match=r"returns \(5,\) per sample, expected \(3,\)"):
        check_head_fits(nn.Linear(16, 5), (16,), 3)


def test_residual_step_is_forward_euler():
    F = nn.Linear(4, 4)
    step = ResidualStep(F, h=0.25)
    x = torch.randn(3, 4)
    assert torch.equal(step(x), x + 0.25 * F(x))


def test_split_stages():
    assert split_stages(5, 2) == [(0, 3), (3, 5)]
    assert split_stages(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="num_stages=6 is more stages than layers \\(5\\)"):
        split_stages(5, 6)
    with pytest.raises(ValueError, match="stage_sizes"):
        split_stages(4, 2, [2, 1])


def test_global_batches_follow_the_data_sampler_convention():
    batches = global_batches(23, 8, 3, 1, num_replicas=2)
    assert [len(b) for b in batches] == [8, 8, 7]
    assert sorted(np.concatenate(batches).tolist()) == list(range(23))
    try:
        from data import GlobalBatchSampler
    except ImportError:
        return
    for r in range(2):
        s = GlobalBatchSampler(23, 8, seed=3, rank=r, num_replicas=2)
        s.set_epoch(1)
        assert [list(i) for i in s] == [list(shard(b, r, 2)) for b in batches]


def _layers():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 8), nn.ReLU())]


X, Y = np.random.default_rng(0).normal(size=(20, 6)).astype(np.float32), np.arange(20) % 3


@pytest.mark.parametrize("kw,msg", [
    (dict(method="mgrit"), "method='mgrit' is not allowed here: use one of sequential, decoupled"),
    (dict(head="cnn"), "head='cnn' is not allowed"),
    (dict(optimizer="rmsprop"), "optimizer='rmsprop' is not allowed: use one of sgd, adam"),
    (dict(epochs=0), "epochs=0 is not allowed: use an int >= 1"),
    (dict(lr=-0.1), "lr=-0.1 is not allowed"),
    (dict(lr=0.0, method="sequential"), "lr=0.0 is not allowed"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(num_stages=3), "num_stages=3 is more stages than layers \\(2\\)"),
    (dict(head="pool"), "does not fit the stage output shape \\(8,\\)"),
    (dict(method="sequential", head="conv"), "does not fit the stage output shape"),
    (dict(method="sequential", grow="bottom"), "grow='bottom' is not allowed"),
])
def test_bad_configurations_are_clear_value_errors(kw, msg):
    kw = dict(dict(method="decoupled"), **kw)
    with pytest.raises(ValueError, match=msg):
        train_layerwise(kw.pop("method"), _layers(), 3, X, Y, epochs=kw.pop("epochs", 1),
                        progress=False, **kw)
