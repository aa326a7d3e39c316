"""The torch.nn.Module internals that the fast paths' fingerprint (mgrit.nn.chains.contract)
relies on, checked on the installed torch (``docs/torch_internals.rst`` lists them; a torch
outside ``mgrit._torchcheck.TESTED`` must pass this file before it is admitted). Each check is a
public operation of torch and what the fingerprint must see of it."""
from __future__ import annotations

import copy
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

from mgrit.nn.chains import contract


def _watched():
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    for sub in m.modules():
        contract._watch(sub)
    return m


def test_fresh_modules_hold_plain_dicts_in_their_instance_dict():
    m = nn.Linear(2, 2)
    for name in ("_parameters", "_buffers", "_modules"):
        assert type(vars(m)[name]) is dict, name
    for name in contract.MODULE_HOOKS:
        assert type(vars(m)[name]) is OrderedDict, name


def test_watched_dicts_stay_bound_and_are_read_through():
    m = _watched()
    lin = m[0]
    assert type(vars(lin)["_parameters"]) is contract._Watched
    assert lin.weight is vars(lin)["_parameters"]["weight"]  # attribute reads use the dict
    ids = {k: id(vars(s)[k]) for s in m.modules() for k in ("_parameters", "_buffers",
                                                             "_modules")}
    m.train(False)
    m.double()  # _apply: values replaced, the dicts themselves never rebound
    m.zero_grad()
    assert ids == {k: id(vars(s)[k]) for s in m.modules() for k in ("_parameters", "_buffers",
                                                                    "_modules")}


@pytest.mark.parametrize("change", [
    lambda m: setattr(m[0], "weight", nn.Parameter(torch.ones(2, 2))),
    lambda m: m[0].register_parameter("extra", nn.Parameter(torch.ones(1))),
    lambda m: m[1].register_buffer("extra", torch.zeros(1)),
    lambda m: setattr(m[1], "running_mean", torch.zeros(2)),
    lambda m: m.add_module("2", nn.ReLU()),
    lambda m: m.__setitem__(0, nn.Linear(2, 2)),
    lambda m: delattr(m[0], "bias"),
    lambda m: m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True),
    lambda m: m.to(torch.float64),
], ids=["setattr-param", "register_parameter", "register_buffer", "setattr-buffer",
        "add_module", "replace-submodule", "delattr", "load_state_dict-assign", "to-dtype"])
def test_every_structural_change_writes_through_the_dicts(change):
    m = _watched()
    before = contract._EPOCH[0]
    change(m)
    assert contract._EPOCH[0] > before


def test_in_place_value_changes_write_no_dict():
    m = _watched()
    before = contract._EPOCH[0]
    with torch.no_grad():
        m[0].weight.add_(1.0)
    m(torch.randn(3, 2)).sum().backward()
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert contract._EPOCH[0] == before


def test_hook_registration_and_removal_write_through_the_hook_dicts():
    m = _watched()
    for register in ("register_forward_hook", "register_forward_pre_hook",
                     "register_full_backward_hook", "register_full_backward_pre_hook"):
        before = contract._EPOCH[0]
        h = getattr(m[0], register)(lambda *a, **k: None)
        assert contract._EPOCH[0] > before and any(getattr(m[0], n) for n in contract.MODULE_HOOKS)
        before = contract._EPOCH[0]
        h.remove()
        assert contract._EPOCH[0] > before and not any(getattr(m[0], n)
                                                      for n in contract.MODULE_HOOKS)


def test_global_hook_dicts_have_the_names_the_fingerprint_reads():
    for name in contract._GLOBAL_HOOKS:
        assert isinstance(getattr(torch_module, name), dict), name
    assert not contract.global_hooks_registered()
    h = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert contract.global_hooks_registered()
    finally:
        h.remove()
    assert not contract.global_hooks_registered()


def test_copies_and_pickles_get_plain_dicts():
    m = _watched()
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(vars(other[0])["_parameters"]) is dict
        assert torch.equal(other[0].weight, m[0].weight)
