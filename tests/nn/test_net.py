"""LayerParallelNet on one rank (COMM_SELF): the classic (opening, resnet, closing) form, global
keys, conversions, errors. Multi-rank behaviour: tests/nn/test_segments_mpi.py."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, serial_resnet
from mgrit.options import MGRITOptions

EXACT = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=60)


def _seg(width, n, seed, dtype=torch.float64):
    return LayerParallelResNet.build(lambda k: DenseStep(width, "tanh").to(dtype), n, (width,),
                                     seed=seed, forward=EXACT, backward=EXACT)


def _mods(dtype=torch.float64):
    torch.manual_seed(4)
    return [nn.Linear(2, 3).to(dtype), nn.Linear(3, 4).to(dtype), nn.Linear(4, 5).to(dtype)]


def _two_segment_net(dtype=torch.float64):
    a, b, c = _mods(dtype)
    return LayerParallelNet(a, _seg(3, 5, 1, dtype), b, _seg(4, 6, 2, dtype), c)


def _two_segment_serial():
    a, b, c = _mods()
    return nn.Sequential(a, *serial_resnet(lambda k: DenseStep(3, "tanh").double(), 5, 1.0, 1), b,
                         *serial_resnet(lambda k: DenseStep(4, "tanh").double(), 6, 1.0, 2), c)


def test_classic_form_keeps_its_attributes_and_keys():
    opening, closing = nn.Linear(2, 3).double(), nn.Linear(3, 5).double()
    resnet = _seg(3, 4, 0)
    net = LayerParallelNet(opening, resnet, closing)
    assert net.opening is opening and net.closing is closing and net.resnet is resnet
    assert net.is_last and net.first_rank == 0 and net.last_rank == 0
    # parameter order as before: the resnet's, then the opening's, then the closing's
    want = [*resnet.parameters(), *opening.parameters(), *closing.parameters()]
    assert [id(p) for p in net.parameters()] == [id(p) for p in want]
    keys = [k for k, _ in net.named_global_parameters()]
    assert keys[:2] == ["0.weight", "0.bias"] and keys[-2:] == ["5.weight", "5.bias"]
    assert "1.F.linear.weight" in keys and "4.F.linear.bias" in keys
    assert net.is_first and dict(net.named_global_modules()) == {
        "0": opening, **{f"{1 + k}.F": s for k, s in enumerate(resnet.steps)}, "5": closing}
    ser = net.to_serial()
    assert len(ser) == 4 + 2
    serial_order = sorted(keys, key=lambda k: int(k.split(".")[0]))
    assert [k for k, _ in ser.named_parameters()] == serial_order
    ident = LayerParallelNet(None, _seg(3, 4, 0), None)
    assert isinstance(ident.opening, nn.Identity) and isinstance(ident.closing, nn.Identity)


def test_two_segments_on_one_rank_equal_serial_autograd():
    torch.set_default_dtype(torch.float64)
    try:
        net, ser = _two_segment_net(), _two_segment_serial()
        x = torch.randn(6, 2, generator=torch.Generator().manual_seed(1))
        y = torch.arange(6) % 5
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        la, lb = net.loss(net(xa), y), F.cross_entropy(ser(xb), y)
        la.backward()
        lb.backward()
        assert abs(la.item() - lb.item()) <= 1e-12 * lb.item()
        assert torch.allclose(xa.grad, xb.grad, rtol=1e-10, atol=0)
        ref = dict(ser.named_parameters())
        n = 0
        for key, p in net.named_global_parameters():
            assert torch.allclose(p.grad, ref[key].grad, rtol=1e-10, atol=1e-15), key
            n += 1
        assert n == len(ref)
        with pytest.raises(AttributeError, match="2 segment"):
            net.resnet
        with pytest.raises(AttributeError, match="segments"):
            net.opening
    finally:
        torch.set_default_dtype(torch.float32)


def test_double_converts_segments_and_modules():
    """Built in float32, then net.double(): the solve, the checks and the output follow."""
    net = _two_segment_net(torch.float32)
    net.double()
    assert all(p.dtype == torch.float64 for p in net.parameters())
    assert all(s.dtype == torch.float64 for s in net.segments)
    x = torch.randn(3, 2, dtype=torch.float64)
    out = net(x)
    assert out.dtype == torch.float64 and out.shape == (3, 5)
    with torch.no_grad():
        ref = net.to_serial()(x)
    assert torch.allclose(out, ref, rtol=1e-11, atol=0)
    with pytest.raises(ValueError, match="part 0 .* torch.float32"):
        net(x.float())


def test_state_dict_round_trip_and_serial_load():
    net, ser = _two_segment_net(), _two_segment_serial()
    sd = net.gather_state_dict()
    assert list(sd) == list(ser.state_dict())
    with torch.no_grad():
        for p in ser.parameters():
            p.mul_(1.5)
    net.load_global_state_dict(ser.state_dict())
    x = torch.randn(3, 2, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(net(x), ser(x), rtol=1e-11, atol=0)
    with pytest.raises(KeyError, match="missing"):
        net.load_global_state_dict({k: v for k, v in ser.state_dict().items() if k != "0.bias"})


@pytest.mark.parametrize("parts,words", [
    ((), "at least one part"),
    ((nn.Linear(2, 3),), "at least one LayerParallelResNet"),
    ((5,), "part 0 is a int"),
    ((nn.Sequential(_seg(3, 4, 0)),), "contains a LayerParallelResNet"),
])
def test_structure_errors(parts, words):
    with pytest.raises(ValueError, match=words):
        LayerParallelNet(*parts)


def test_shape_errors_name_the_part_and_the_shapes():
    with pytest.raises(ValueError, match=r"part 1 \(Linear\) produces \(batch, 4\) but segment 1"):
        LayerParallelNet(_seg(3, 4, 0), nn.Linear(3, 4).double(), _seg(3, 4, 1))
    bad = LayerParallelResNet([nn.Linear(3, 3).double(), nn.Linear(3, 2).double()], 2, (3,),
                              forward=MGRITOptions(max_levels=1),
                              backward=MGRITOptions(max_levels=1))
    with pytest.raises(ValueError, match="segment 0 layer 1 .* keep the state shape"):
        LayerParallelNet(bad)
    net = LayerParallelNet(nn.Linear(2, 4).double(), _seg(3, 4, 0))
    with pytest.raises(ValueError, match=r"part 0 \(Linear\) produces \(batch, 4\)"):
        net(torch.zeros(2, 2, dtype=torch.float64))
