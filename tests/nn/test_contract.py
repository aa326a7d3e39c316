"""Issue 22 items 1, 2, 3, 7, 8 (the fast paths' contract, :mod:`mgrit.nn.chains.contract`): subclasses
of the shipped steps, module hooks, parameters replaced after build, autocast and compiled
steps, each against serial PyTorch autograd on the same weights (float64, 2 levels, solves to
1e-13, compared at 1e-9 relative; autocast: float32/bfloat16 at 1e-6), on 1 rank in-process and
on 2 and 3 ranks in one MPI job each. The checks are in ``tests/mpi_cases/nn/contract_cases.py``.
"""
import warnings

import pytest
import torch

from mgrit.nn import DenseStep, LayerParallelResNet
from mgrit.nn.chains.contract import Fingerprint
from tests.mpi_cases.nn import contract_cases as C
from tests.mpi_harness import MPIBatch

T = "tests.mpi_cases.nn.contract_cases"
DENSE = ["dense_subclass", "dense_buffer_subclass", "user_step", "dense"]
CHECKS = ["check_replaced_activation", "check_hooks", "check_replaced_parameters",
          "check_changed_between_forward_and_backward", "check_autocast",
          "check_compiled_state_dict"]
BATCH = MPIBatch()
BATCH.add(2, "subclasses", f"{T}:check_subclasses", names=DENSE)
for name in CHECKS:
    BATCH.add(2, name, f"{T}:{name}")
for name in ["check_hooks", "check_replaced_activation"]:  # cheap: no optimizer, no compile
    BATCH.add(3, name, f"{T}:{name}")


@pytest.mark.parametrize("name", ["check_subclasses"] + CHECKS)
def test_one_rank(name):
    """All checks on one rank (COMM_WORLD of this process), every step class."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        getattr(C, name)()


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_ranks(k, name):
    BATCH.run(k, name)


def test_fingerprint_sees_each_change():
    """Each fact of the contract changes the fingerprint; values changed in place and a
    train/eval switch of every layer alike do not (no rebuild needed)."""
    lp = LayerParallelResNet.build(lambda k: DenseStep(3), 4, (3,))
    fp = lp._fingerprint
    assert fp.same() and not fp.hooked()
    with torch.no_grad():
        lp.steps[1].linear.weight.add_(1.0)
    lp.eval()
    assert fp.same()  # in-place values, every layer in eval mode: the proof still holds
    lp.train()
    changes = [
        lambda: setattr(lp.steps[1].linear, "weight", torch.nn.Parameter(torch.ones(3, 3))),
        lambda: lp.steps[2].register_buffer("extra", torch.zeros(1)),
        lambda: lp.steps.__setitem__(3, DenseStep(3)),
        lambda: setattr(lp.steps[0], "act", torch.nn.ReLU()),
    ]
    for change in changes:
        change()
        assert not fp.same()
        lp._restructure()
        assert fp.same()
    h = lp.steps[2].linear.register_forward_hook(lambda *a: None)
    assert fp.hooked()
    h.remove()
    assert not fp.hooked()
    assert isinstance(fp, Fingerprint)


@pytest.mark.parametrize("maker", [lambda k: DenseStep(3), lambda k: C.UserStep(3)])
def test_training_loop_needs_no_rescan(maker):
    """Forwards, backwards, optimizer steps and functional_call (the batched vmap path of a
    user step) write no watched dict: the per-call check stays O(1) (no rescan); a user
    step's batched path (template's flags for every layer) also compares training flags."""
    from mgrit.nn.chains import contract
    lp = LayerParallelResNet.build(maker, 8, (3,), forward=C.EXACT, backward=C.EXACT)
    opt = torch.optim.SGD(lp.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3)
    lp(x).sum().backward()
    opt.step()
    seen = lp._fingerprint._seen
    for _ in range(2):
        opt.zero_grad()
        lp(x).sum().backward()
        opt.step()
    assert contract._EPOCH[0] == seen == lp._fingerprint._seen
    native = isinstance(lp.steps[0], DenseStep)
    assert lp._chain._stack._native == native
    sub = lp.steps[0].linear if native else lp.steps[0].lin
    sub.eval()
    assert lp._fingerprint.same() == native  # the vmap path applies the template's flags


def test_copies_watch_their_own_dicts():
    """A deep copy of a model (also what pickling does) holds plain dicts: its first check
    rebuilds and watches them, so a parameter replaced in the copy is seen."""
    import copy
    lp = LayerParallelResNet.build(lambda k: DenseStep(3), 4, (3,))
    cp = copy.deepcopy(lp)
    assert not cp._fingerprint.same()
    cp._restructure()
    assert cp._fingerprint.same()
    cp.steps[1].linear.weight = torch.nn.Parameter(torch.ones(3, 3))
    assert not cp._fingerprint.same() and lp._fingerprint.same()


def test_snapshot_sees_a_changed_dtype():
    """One layer's ``.double()`` after build (identity kept, dtype changed): the next snapshot
    notices (torch.stack would promote) and the chain is proved again: per layer, like serial."""
    lp = LayerParallelResNet.build(lambda k: DenseStep(3), 4, (3,))
    assert lp._chain.refresh() and lp.batching_obstacle is None
    lp.steps[1].double()
    assert lp._fingerprint.same()  # not a fingerprint fact: the snapshot checks it
    assert lp._chain.refresh() == {}
    assert "dtypes" in lp.batching_obstacle


@pytest.mark.slow
def test_checkpoints_of_compiled_and_plain_runs_load_into_each_other(tmp_path):
    """Item 8 through the training checkpoint (one process): a LayerParallelNet with
    ``torch.compile``d steps and opening and the plain one, and a compiled serial model and
    the plain one, save checkpoints the other loads (weights and optimizer state equal)."""
    from torch import nn

    from mgrit.nn import LayerParallelNet
    from mgrit.training.checkpoint import load_checkpoint, save_checkpoint

    def lp_net(compiled, seed):
        wrap = (lambda m: torch.compile(m, backend="eager")) if compiled else (lambda m: m)
        torch.manual_seed(seed)
        seg = LayerParallelResNet.build(lambda k: wrap(DenseStep(3)), 4, (3,), seed=seed,
                                        forward=C.EXACT, backward=C.EXACT)
        return LayerParallelNet(wrap(nn.Linear(2, 3)), seg, nn.Linear(3, 2))

    def serial(compiled, seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2))
        return torch.compile(m, backend="eager") if compiled else m

    for make in (lp_net, serial):
        for src_compiled in (True, False):
            src, dst = make(src_compiled, 1), make(not src_compiled, 2)
            opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
            for i, p in enumerate(src.parameters()):  # (no forward: no dynamo tracing here)
                p.grad = torch.full_like(p, 0.1 * i)
            opt.step()
            path = tmp_path / f"{make.__name__}-{src_compiled}.pt"
            save_checkpoint(path, src, opt)
            opt2 = torch.optim.SGD(dst.parameters(), lr=0.1, momentum=0.9)
            load_checkpoint(path, dst, opt2)
            for p, q in zip(src.parameters(), dst.parameters()):
                assert torch.equal(p, q)
                assert torch.equal(opt.state[p]["momentum_buffer"],
                                   opt2.state[q]["momentum_buffer"])
