"""Issue 39, item 5: a TrainingMethod is not a network (no NetMixin in its bases) and still
implements the runtime's network protocol with exactly the answers NetMixin gives a module
without MGRIT segments (the reference: NetMixin's own members called on the method)."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mgrit.nn.protocol import PROVIDED, REQUIRED, NetMixin, TrainableNet
from mgrit.training.method import TrainingMethod
from mgrit.training.support.nets import as_net


class _Replicated(nn.Linear):
    replicated_weights = True


class TinyMethod(TrainingMethod):
    def __init__(self):
        super().__init__(MPI.COMM_SELF)
        self.body = nn.Linear(3, 4)
        self.head = _Replicated(4, 2)

    def forward(self, x):
        return self.head(self.body(x))


def test_a_method_is_not_a_netmixin():
    assert not issubclass(TrainingMethod, NetMixin)
    m = TinyMethod()
    assert isinstance(m, TrainableNet) and as_net(m) is m
    assert all(hasattr(m, name) for name in REQUIRED + PROVIDED)


@pytest.mark.parametrize("name", ["global_modules", "replicated_parameters", "checkpoint_meta",
                                  "tied_prefixes", "solver_segments", "solver_results",
                                  "solver_options", "exact_tolerance", "describe_solvers",
                                  "solver_summary", "owned_points", "warm_states",
                                  "tied_duplicates"])
def test_answers_are_netmixins_for_a_segment_free_module(name):
    m = TinyMethod()
    mine, reference = getattr(m, name)(), getattr(NetMixin, name)(m)
    if name in ("global_modules", "replicated_parameters"):
        assert [id(v) for v in _flat(mine)] == [id(v) for v in _flat(reference)]
        assert mine  # not vacuous: the module itself, the replicated head's weights
    else:
        assert mine == reference


def test_no_op_members():
    m = TinyMethod()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert m.set_warm_states([]) is None and m.check_tied_replicas() is None
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def _flat(v):
    return [x for item in v for x in (item if isinstance(item, tuple) else (item,))]
