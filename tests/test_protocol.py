"""The network protocol (mgrit.nn.protocol): every network kind the runtime takes implements
it; a new network type that implements only the required members (with NetMixin) trains in
the Trainer and round-trips a checkpoint exactly like the same module as a plain serial
network (float64, bitwise: same arithmetic); a module with only the loop's members is refused
with a TypeError naming the missing ones. One process, no MPI launch."""
import tempfile
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import DenseStep, GRUSequenceClassifier, LayerParallelNet, LayerParallelResNet
from mgrit.nn.protocol import PROVIDED, REQUIRED, NetMixin, TrainableNet
from mgrit.options import MGRITOptions
from mgrit.training import Trainer
from mgrit.training.method import TrainingMethod
from mgrit.training.support.nets import SerialNet, as_net


class TwoPiece(NetMixin, nn.Module):
    """A new network type: two linear layers, one rank; only the required members."""

    is_last = True

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.comm = MPI.COMM_SELF

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

    def loss(self, out, target, fn=F.cross_entropy):
        return fn(out, target)

    def from_last(self, value):
        return value

    def global_modules(self):
        return [("first.", self.a), ("second.", self.b)]


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(24, 4, generator=g, dtype=torch.float64), torch.arange(24) % 3


def _fit(net):
    x, y = _data()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with tempfile.TemporaryDirectory() as d:
        ck = Path(d) / "ck.pt"
        trainer = Trainer(net, opt, checkpoint=ck, eval_batch_size=8)
        trainer.fit((x, y), epochs=2, batch_size=8, seed=1)
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()
        trainer.load(ck)
    return [p.detach().clone() for p in net.parameters()], trainer


def test_every_network_kind_implements_the_protocol():
    opts = MGRITOptions(max_levels=1)
    resnet = LayerParallelResNet.build(lambda k: DenseStep(4, "tanh"), 2, (4,),
                                       comm=MPI.COMM_SELF, forward=opts, backward=opts)
    nets = [LayerParallelNet(nn.Identity(), resnet, nn.Linear(4, 2)),
            GRUSequenceClassifier(2, 3, 2, comm=MPI.COMM_SELF), SerialNet(nn.Linear(2, 2)),
            TrainingMethod(), TwoPiece()]
    for net in nets:
        assert isinstance(net, TrainableNet), type(net).__name__
        assert as_net(net) is net
        missing = [m for m in REQUIRED + PROVIDED if not hasattr(net, m)]
        assert not missing, (type(net).__name__, missing)
    assert [len(n.solver_segments()) for n in nets] == [1, 0, 0, 0, 0]
    assert nets[0].checkpoint_meta() == {"kind": "layer-parallel", "n_layers": [2],
                                         "state_shape": [[4]]}


def test_new_network_type_trains_and_checkpoints_like_a_serial_module():
    torch.set_default_dtype(torch.float64)
    try:
        mine, trainer = _fit(TwoPiece())
        ref = TwoPiece()
        plain = nn.Sequential(ref.a, nn.Tanh(), ref.b)
        theirs, _ = _fit(plain)
    finally:
        torch.set_default_dtype(torch.float32)
    assert trainer.net.global_modules()[0][0] == "first."
    assert len(mine) == len(theirs) == 4
    for p, q in zip(mine, theirs):
        assert torch.equal(p, q)
    assert not torch.equal(mine[0], TwoPiece().a.weight.double())  # it trained


def test_loop_members_without_the_protocol_are_refused():
    class Partial(nn.Module):
        is_last = True

        def loss(self, out, target, fn=F.cross_entropy):
            return fn(out, target)

        def from_last(self, value):
            return value

    with pytest.raises(TypeError, match=r"Partial has the training loop's members .*"
                                        r"missing \['comm', 'global_modules'"):
        as_net(Partial())
