"""The training loop (mgrit.training.Trainer) on 2 ranks: replicas with empty shards equal the
single-replica run, resume after an interruption is bitwise, a NaN names its layer, failed
saves reach every rank, mismatched checkpoints are named, a serial checkpoint resumes a
layer-parallel network (issue 13 items 5, 6, 8); in-process: the callback contract, a serial
fit equal to a plain loop, the exact-mode warning."""
import tempfile

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet
from mgrit.options import MGRITOptions
from mgrit.training import Trainer
from mgrit.training.epoch import UnconvergedWarning
from tests.mpi_harness import MPIBatch

C = "tests.mpi_cases.training.trainer_cases"
TMP = tempfile.mkdtemp(prefix="layerpar-trainer-")
BATCH = MPIBatch(timeout=400)
for kind in ("serial", "mgrit"):
    BATCH.add(2, f"dp_last_batch-{kind}", f"{C}:check_dp_small_last_batch", kind=kind)
    BATCH.add(2, f"resume-{kind}", f"{C}:check_resume_after_interruption", kind=kind,
              ckpt_dir=TMP)
BATCH.add(2, "nan_layer", f"{C}:check_nan_names_layer")
for where in ("write", "prepare"):
    BATCH.add(2, f"save_failure-{where}", f"{C}:check_save_failure", where=where, ckpt_dir=TMP)
BATCH.add(2, "mismatch", f"{C}:check_mismatch_messages", ckpt_dir=TMP)
BATCH.add(2, "cross", f"{C}:check_serial_checkpoint_into_mgrit", ckpt_dir=TMP)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["serial", "mgrit"])
def test_replicas_with_an_empty_shard_equal_one_replica(kind):
    errs = BATCH.run(2, f"dp_last_batch-{kind}")
    assert all(float(e) <= 1e-12 for e in errs), errs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["serial", "mgrit"])
def test_resume_after_interruption_is_bitwise(kind):
    losses = BATCH.run(2, f"resume-{kind}")
    assert len(set(losses)) == 1, losses


@pytest.mark.slow
def test_nan_residual_names_the_layer():
    msgs = BATCH.run(2, "nan_layer")
    assert len(set(msgs)) == 1 and "x_6" in msgs[0], msgs


@pytest.mark.slow
@pytest.mark.parametrize("where", ["write", "prepare"])
def test_failed_save_reaches_every_rank(where):
    msgs = BATCH.run(2, f"save_failure-{where}")
    assert len(set(msgs)) == 1, msgs


@pytest.mark.slow
def test_mismatched_checkpoint_is_named():
    cases = BATCH.run(2, "mismatch")
    assert len(set(cases)) == 1, cases


@pytest.mark.slow
def test_serial_checkpoint_resumes_layer_parallel():
    errs = BATCH.run(2, "cross")
    assert all(float(e) <= 1e-12 for e in errs), errs


# -- in-process (one rank) -------------------------------------------------------------------
def _tiny_data(n=30):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def test_callbacks_are_checked():
    class Misspelt:
        def on_epoch_ned(self, trainer, record):
            pass

    class HalfState:
        def state_dict(self):
            return {}

    net = nn.Linear(3, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="on_epoch_ned"):
        Trainer(net, opt, callbacks=[Misspelt()])
    with pytest.raises(ValueError, match="only one of state_dict/load_state_dict"):
        Trainer(net, opt, callbacks=[HalfState()])
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        Trainer(net, "sgd")


def test_serial_fit_equals_plain_loop():
    """A serial nn.Sequential through Trainer.fit (3 epochs, batches of 8 of 30 samples: a
    partial last batch) equals a plain PyTorch loop bit for bit, and calls every hook."""
    x, y = _tiny_data()

    def make():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()

    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(3):
        perm = np.random.default_rng([2, epoch]).permutation(len(y))
        for s in range(0, len(y), 8):
            j = torch.as_tensor(perm[s:s + 8])
            opt.zero_grad()
            F.cross_entropy(ref(x[j]), y[j]).backward()
            opt.step()

    class Count:
        def __init__(self):
            self.calls = {}

        def __getattr__(self, name):
            if name not in ("on_fit_start", "on_after_backward", "on_step_end", "on_epoch_end",
                            "on_fit_end"):
                raise AttributeError(name)
            return lambda trainer, record: self.calls.__setitem__(name, self.calls.get(name, 0) + 1)

    net, counter = make(), Count()
    result = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                     callbacks=[counter]).fit((x, y), epochs=3, batch_size=8, seed=2, test=(x, y))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))
    assert result.steps == 12 and len(result.history["loss"]) == 3
    assert counter.calls == {"on_fit_start": 1, "on_after_backward": 12, "on_step_end": 12,
                             "on_epoch_end": 3, "on_fit_end": 1}, counter.calls


def test_unconverged_exact_mode_warns():
    """Exact mode (a tolerance) with a cycle cap too small to reach it: one warning per epoch."""
    x, y = _tiny_data()
    o = MGRITOptions(max_levels=2, cfactor=2, tol=1e-15, max_iter=1, relax="F")
    torch.set_default_dtype(torch.float64)
    try:
        resnet = LayerParallelResNet.build(lambda k: DenseStep(3, "tanh"), 16, (3,),
                                           forward=o, backward=o)
        net = LayerParallelNet(None, resnet, None)
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1))
        with pytest.warns(UnconvergedWarning, match="stopped at the cycle cap"):
            result = trainer.fit((x, y), epochs=1, batch_size=10)
    finally:
        torch.set_default_dtype(torch.float32)
    assert result.history["fwd_iters"] == [1]
