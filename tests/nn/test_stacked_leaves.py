"""``LayerParallelResNet(stacked_parameters=True)`` (mgrit.nn.resnet.stacked_leaves): one leaf
per parameter name. Against serial PyTorch autograd in float64 (gradients and optimizer steps
within 1e-12), the unstacked model's state dict (keys, order and values; checkpoints both
ways), what a user may touch (hooks, freezing, ``.to()``, ``load_state_dict(assign=True)``) and
the refusals. P = 2 through the MPI harness (slow)."""
import ast
import warnings

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mgrit.nn import DenseStep, LayerParallelResNet
from mgrit.options import MGRITOptions
from tests.mpi_cases.nn.stacked_cases import check_stacked_matches_serial
from tests.mpi_harness import MPIBatch

SELF = MPI.COMM_SELF


def _opts(**kw):
    return MGRITOptions(**{"max_levels": 2, "cfactor": 4, "tol": 1e-13, "max_iter": 80, **kw})


def _build(stacked=True, n=12, width=3, **kw):
    kw.setdefault("forward", _opts())
    kw.setdefault("backward", _opts())
    return LayerParallelResNet.build(lambda k: DenseStep(width, "tanh").double(), n, (width,),
                                     stacked_parameters=stacked, **kw)


def _grads(model, x):
    model.zero_grad()
    (model(x) ** 2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_gradients_and_steps_equal_serial_p1(optimizer):
    assert float(check_stacked_matches_serial(optimizer=optimizer, comm=SELF)) <= 1e-12


def test_parameters_are_stacked_leaves_and_layers_views():
    m = _build()
    assert [(n, tuple(p.shape)) for n, p in m.named_parameters()] == [
        ("stacked.linear.weight", (12, 3, 3)), ("stacked.linear.bias", (12, 3))]
    w = m.stacked.linear.weight
    v = m.steps[5].linear.weight
    assert not v.is_leaf and v.data_ptr() == w[5].data_ptr()
    assert list(m.steps[5].parameters()) == []


def test_state_dict_interchanges_with_unstacked():
    a, b = _build(False), _build(True)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.no_grad():  # other weights, then load each into the other kind
        for p in b.parameters():
            p.mul_(-0.5)
    a.load_state_dict(b.state_dict())
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in sa)
    c = _build(True, forward=_opts(cfactor=2), backward=_opts(cfactor=2))
    c.load_state_dict(a.state_dict())
    x = torch.randn(4, 3, dtype=torch.float64)
    ga, gc = _grads(a, x), _grads(c, x)
    w = gc["stacked.linear.weight"]
    assert max((ga[f"steps.{j}.linear.weight"] - w[j]).abs().max().item()
               for j in range(12)) <= 1e-12
    sd = a.state_dict()
    del sd["steps.2.linear.weight"]
    r = _build(True).load_state_dict(sd, strict=False)
    assert r.missing_keys == ["steps.2.linear.weight"] and r.unexpected_keys == []
    with pytest.raises(RuntimeError, match=r"steps\.2\.linear\.weight"):
        _build(True).load_state_dict(sd)
    sd = a.state_dict()
    sd["steps.1.linear.bias"] = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"size mismatch for steps\.1\.linear\.bias"):
        _build(True).load_state_dict(sd)


def test_global_views_and_serial_copy():
    a, b = _build(False), _build(True)
    ga, gb = a.gather_state_dict(), b.gather_state_dict()
    assert list(ga) == list(gb) and all(torch.equal(ga[k], gb[k]) for k in ga)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.25)
    b.load_global_state_dict(a.gather_state_dict())
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    sb = b.to_serial()
    assert sum(p.numel() for p in sb.parameters()) == sum(p.numel() for p in b.parameters())
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        assert (sb(x) - b(x)).abs().max().item() <= 1e-12
    assert list(b.steps[0].parameters()) == []  # the views are back


def test_hooks_freeze_to_and_assign():
    m, ref = _build(True), _build(False)
    x = torch.randn(4, 3, dtype=torch.float64)
    g = _grads(m, x)["stacked.linear.weight"]
    h = m.steps[3].register_forward_hook(lambda mod, i, o: o * 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the serial pipeline's warning
        gh = _grads(m, x)["stacked.linear.weight"]
    h.remove()
    assert (g - gh).abs().max().item() <= 1e-12
    m.stacked.linear.bias.requires_grad_(False)
    gf = _grads(m, x)
    assert "stacked.linear.bias" not in gf and m.stacked.linear.bias.grad is None
    assert (gf["stacked.linear.weight"] - g).abs().max() <= 1e-12
    m.stacked.linear.bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match="leaf"):
        m.steps[1].linear.weight.requires_grad_(False)  # one layer alone: torch refuses
    m.float().double()  # new leaves' data: the views follow
    assert (_grads(m, x)["stacked.linear.weight"] - g).abs().max() <= 1e-12
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    m.load_state_dict(ref.state_dict(), assign=True)
    gr, gm = _grads(ref, x), _grads(m, x)["stacked.linear.weight"]
    assert max((gr[f"steps.{j}.linear.weight"] - gm[j]).abs().max().item()
               for j in range(12)) <= 1e-12


def test_refusals():
    m = _build(True)
    m.steps[3].linear.weight = nn.Parameter(torch.zeros(3, 3, dtype=torch.float64))
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="parameter 'linear.weight' of layer 3 was replaced"):
        m(x)
    with pytest.raises(ValueError, match="replaced"):  # it stays refused
        m(x)
    m = _build(True)
    with pytest.raises(ValueError, match="functional_call"):
        torch.func.functional_call(m, {"stacked.linear.weight": m.stacked.linear.weight * 1.0},
                                   (x,))
    for kw, words in [(dict(tie=lambda k: 0), "tie"), (dict(adjoint="serial"), "adjoint"),
                      (dict(backward=_opts(max_levels=1)), "multilevel"),
                      (dict(forward=_opts(batched=False)), "batched"),
                      (dict(n=1), "at least two layers")]:
        with pytest.raises(ValueError, match=words):
            _build(True, **kw)
    shared = DenseStep(3, "tanh").double()
    with pytest.raises(ValueError, match="shared"):
        LayerParallelResNet([shared, shared, DenseStep(3, "tanh").double()], 3, (3,),
                            forward=_opts(), backward=_opts(), stacked_parameters=True)


def test_foreach_and_fused_sgd_equal_the_plain_loop():
    """The job's optimizers (layerpar.job.OPTIMIZERS, foreach=True) on stacked leaves give the
    numbers of the per-tensor loop on per-layer parameters (float64 round-off)."""
    from layerpar.job import OPTIMIZERS

    class C:
        lr, momentum, weight_decay = 0.1, 0.9, 0.01
    x = torch.randn(4, 3, dtype=torch.float64)
    for name in ("sgd", "adam", "adamw"):
        ref, fast = _build(False), _build(True)
        opt_r = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01,
                                                   foreach=False),
                 "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01, foreach=False),
                 "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01,
                                                       foreach=False)}[name](ref.parameters())
        opt_f = OPTIMIZERS[name](fast.parameters(), C)
        for _ in range(3):
            for m, o in ((ref, opt_r), (fast, opt_f)):
                o.zero_grad()
                (m(x) ** 2).mean().backward()
                o.step()
        sr, sf = ref.state_dict(), fast.state_dict()
        worst = max(((sr[k] - sf[k]).abs().max() / sr[k].abs().max().clamp_min(1)).item()
                    for k in sr)
        assert worst <= 1e-12, (name, worst)


BATCH = MPIBatch()
for k in (2, 3):
    BATCH.add(k, "stacked_matches_serial", "tests.mpi_cases.nn.stacked_cases:"
              "check_stacked_matches_serial")


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_stacked_mpi(k, name):
    results = BATCH.run(k, name)  # each rank's return value, repr'd
    assert len(set(results)) == 1 and float(ast.literal_eval(results[0])) <= 1e-12, results


def test_inexact_float32_training_is_bitwise_the_per_layer_path():
    """The benchmark's configuration (float32, 2 forward / 1 adjoint cycles, warm start): the
    stacked step (foreach SGD) is bitwise the per-layer step (per-tensor SGD)."""
    def build(stacked):
        def o(it):
            return MGRITOptions(max_levels=2, cfactor=4, tol=0, max_iter=it, relax="F")
        return LayerParallelResNet.build(lambda k: DenseStep(4, "tanh"), 32, (4,), forward=o(2),
                                         backward=o(1), stacked_parameters=stacked)
    a, b = build(False), build(True)
    oa = torch.optim.SGD(a.parameters(), lr=0.05, foreach=False)
    ob = torch.optim.SGD(b.parameters(), lr=0.05, foreach=True)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            (m(x) ** 2).mean().backward()
            o.step()
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["steps.0.linear.weight"], build(False).state_dict()[
        "steps.0.linear.weight"])  # the steps moved the weights
