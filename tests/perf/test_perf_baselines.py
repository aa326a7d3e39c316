"""The baselines of the benchmarks (mgrit.perf.lean, mgrit.perf.baselines): the lean serial loop's
forward, closed-form backward and SGD step equal serial autograd (float64, 1e-12 relative);
GPipe (lean and autograd stages, uneven partitions and micro-batches) and lean data parallelism
give serial autograd's gradients on 2 and 3 ranks (one MPI job per rank count). No timing."""
import pytest
import torch

from mgrit.nn import DenseStep, serial_resnet
from mgrit.perf import lean as lean_mod
from mgrit.perf.baselines import micro_batch_sizes
from mgrit.perf.lean import LeanResNet
from tests.mpi_harness import MPIBatch

BATCH = MPIBatch(timeout=300)
CHECKS = ("gpipe_lean", "gpipe_module", "lean_data_parallel", "gpipe_bad_micro")
for _n in (2, 3):
    for _c in CHECKS:
        BATCH.add(_n, _c, f"tests.mpi_cases.core.perf_cases:check_{_c}")


def _net(N=13, w=4, act="tanh"):
    return serial_resnet(lambda k: DenseStep(w, act), N, seed=2).double()


def _x(B=5, w=4):
    return torch.randn(B, w, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


def _rel(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max())


@pytest.mark.parametrize("act", ["tanh", "relu"])
def test_lean_forward_backward_step_equal_autograd(act):
    net, x = _net(act=act), _x()
    lean = LeanResNet.from_sequential(net)
    xr = x.clone().requires_grad_(True)
    y = net(xr)
    (y ** 2).mean().backward()
    assert _rel(lean.forward(x), y) < 1e-12
    out = lean.forward_store(x)
    assert _rel(out, y) < 1e-12
    gx = lean.backward(2 * out / out.numel())
    assert _rel(gx, xr.grad) < 1e-12
    for k, layer in enumerate(net):
        assert _rel(lean.gWT[k].t(), layer.F.linear.weight.grad) < 1e-12, k
        assert _rel(lean.gb[k], layer.F.linear.bias.grad) < 1e-12, k
    # accumulate over two halves of the batch == the whole batch's gradient
    full = lean.grad_flat.clone()
    lean.zero_grad()
    for rows in (slice(0, 2), slice(2, 5)):
        o = lean.forward_store(x[rows], slot=1)
        lean.backward(2 * o / y.numel(), slot=1, accumulate=True)
    assert _rel(lean.grad_flat, full) < 1e-12
    # train_step == torch.optim.SGD on the nn.Sequential
    lean2 = LeanResNet.from_sequential(net)
    lean2.train_step(x, 0.3)
    torch.optim.SGD(net.parameters(), 0.3).step()
    W, b = lean2.weights()
    for k, layer in enumerate(net):
        assert _rel(W[k], layer.F.linear.weight.detach()) < 1e-12
        assert _rel(b[k], layer.F.linear.bias.detach()) < 1e-12


def test_lean_slice_and_errors():
    net, x = _net(), _x()
    lean = LeanResNet.from_sequential(net)
    a, b = lean.slice(0, 5), lean.slice(5, 13)
    assert _rel(b.forward(a.forward(x).clone()), net(x)) < 1e-12
    with pytest.raises(ValueError, match="slice"):
        lean.slice(3, 3)
    with pytest.raises(ValueError, match="act"):
        LeanResNet(torch.zeros(2, 3, 3), torch.zeros(2, 3), 0.1, "gelu")
    with pytest.raises(ValueError, match="W"):
        LeanResNet(torch.zeros(2, 3, 4), torch.zeros(2, 3), 0.1)
    with pytest.raises(ValueError, match="from_sequential"):
        LeanResNet.from_sequential(_net(act="smoothrelu"))


@pytest.mark.slow
def test_compiled_loops_equal_lean():
    """The compiled block loops (forward; forward-store + closed-form backward + SGD) compute
    the lean loop's numbers. Backend ``eager`` here: inductor's C++ compile takes minutes on
    CI, and the benchmark times (and reports the failure of) the real compile."""
    net, x = _net(N=12), _x()
    lean = LeanResNet.from_sequential(net)
    y = lean.forward(x).clone()
    fwd = lean_mod.compiled_forward(lean, block=4, backend="eager")
    assert _rel(fwd(x), y) < 1e-12
    ref = LeanResNet.from_sequential(net)
    ref.train_step(x, 0.2)
    step = lean_mod.compiled_train_step(lean, block=3, backend="eager")
    step(x, 0.2)
    assert _rel(lean.WT, ref.WT) < 1e-12 and _rel(lean.b, ref.b) < 1e-12
    with pytest.raises(ValueError, match="block"):
        lean_mod.compiled_forward(lean, block=5)


def test_micro_batch_sizes():
    assert micro_batch_sizes(10, 3) == [4, 3, 3]
    assert micro_batch_sizes(4, 4) == [1, 1, 1, 1]
    for bad in (0, 5, True):
        with pytest.raises(ValueError, match="micro_batches"):
            micro_batch_sizes(4, bad)


@pytest.mark.slow
@pytest.mark.parametrize("nprocs,check", [(n, c) for n in (2, 3) for c in CHECKS])
def test_baselines_mpi(nprocs, check):
    BATCH.run(nprocs, check)
