"""BatchNorm, Dropout and DropPath inside layer-parallel steps (mgrit/nn/steps/batchnorm.py,
mgrit/nn/steps/stochastic.py).

MPI (tests/mpi_cases/nn/stateful_cases.py; one job per rank count): exact mode (float64, 1e-13)
against an independently built serial network trained by autograd and SGD on the same batches
(and, with dropout, the same ``torch.manual_seed``): loss, every gradient, every
``running_mean`` / ``running_var`` / ``num_batches_tracked`` after 3 steps, evaluation outputs;
7 layers on 1, 3 (side by side in one job) and 4 ranks; dense (``momentum=None``; ``affine=False`` and
``track_running_stats=False``) and conv (two BatchNorms) steps; a
dropout + DropPath dense step and a transformer block with dropout and DropPath; 2
data-parallel replicas x 2 layer ranks equal the one-process run on the whole batch (SyncBN
semantics). In process: gradients vs central finite differences with the masks fixed, the
dropout rates, evaluation mode, the batching obstacle.
"""
import pytest
import torch
from torch import nn

from mgrit.nn import LayerParallelResNet, TransformerStep
from mgrit.nn.steps.stochastic import Dropout, DropPath, NoiseSource
from mgrit.options import MGRITOptions
from tests.mpi_harness import MPIBatch

C = "tests.mpi_cases.nn.stateful_cases"
BATCH = MPIBatch()
# one 4-rank job: P = 1 and P = 3 side by side (split communicators), then P = 4 and 2 x 2
for kind in ("dense", "bnvar", "conv", "dropout", "vit"):
    BATCH.add(4, f"train-{kind}-P1+P3", f"{C}:check_train_exact", kind=kind, sizes=[1, 3])
for kind in ("dense", "conv"):
    BATCH.add(4, f"train-{kind}-P4", f"{C}:check_train_exact", kind=kind)
    BATCH.add(4, f"dp-{kind}", f"{C}:check_dp_batchnorm", kind=kind)
# the one-level path (layer-wise model parallelism in autograd)
BATCH.add(4, "train-conv-L1-P1+P3", f"{C}:check_train_exact", kind="conv", sizes=[1, 3], levels=1)
BATCH.add(4, "dp-dense-L1", f"{C}:check_dp_batchnorm", kind="dense", levels=1)
BATCH.add(4, "dropout-semantics", f"{C}:check_dropout_semantics")
BATCH.add(4, "errors", f"{C}:check_errors")


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_stateful_mpi(k, name):
    results = BATCH.run(k, name)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    print(f"{name} on {k} ranks: {results[0]}")


def test_dropout_rates_and_eval():
    """Elementwise dropout drops a fraction p (within 5 sigma) and scales kept values by
    1/(1-p); DropPath drops whole samples; evaluation mode and p = 0 are the identity."""
    src = NoiseSource()
    d, dp = Dropout(0.3), DropPath(0.25)
    for i, m in enumerate((d, dp)):
        m.noise, m.layer, m.slot = src, 4, i
    x = torch.ones(400, 250, dtype=torch.float64)
    with src.use(123, {}):
        y, z = d(x), dp(x)
    n = x.numel()
    assert abs((y == 0).double().mean().item() - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.7))
    rows = (z == 0).all(1)
    assert ((z == 0).any(1) == rows).all(), "DropPath must drop whole samples"
    assert abs(rows.double().mean().item() - 0.25) < 5 * (0.25 * 0.75 / 400) ** 0.5
    with src.use(123, {}):
        assert torch.equal(d(x), y), "the same seed gave another mask"
    with src.use(124, {}):
        assert not torch.equal(d(x), y), "another seed gave the same mask"
    d.eval()
    assert torch.equal(d(x), x)
    assert torch.equal(Dropout(0.0)(x), x)


class _Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop, self.path = nn.Linear(3, 3), Dropout(0.3), DropPath(0.3)

    def forward(self, x):
        return self.path(self.drop(torch.tanh(self.lin(x))))


def test_gradients_equal_finite_differences_with_fixed_masks():
    """Layer-parallel gradients (one rank, 2-level exact solves) equal central differences of
    the loss with the masks fixed by ``torch.manual_seed`` (float64, step 1e-6, 1e-7 rel)."""
    opts = MGRITOptions(max_levels=2, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80)
    net = LayerParallelResNet.build(lambda k: _Step().double(), 6, (3,), forward=opts,
                                    backward=opts)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def loss():
        torch.manual_seed(42)
        return net(x, 5).pow(2).sum()

    loss().backward()
    checked = 0
    for p in (net.steps[0].lin.weight, net.steps[4].lin.bias):
        for idx in [(0, 1), (2, 2)] if p.dim() == 2 else [(0,), (2,)]:
            with torch.no_grad():
                old = p[idx].item()
                p[idx] = old + 1e-6
                up = loss().item()
                p[idx] = old - 1e-6
                down = loss().item()
                p[idx] = old
            fd = (up - down) / 2e-6
            assert abs(fd - p.grad[idx].item()) <= 1e-7 * max(1.0, abs(fd)), (idx, fd, p.grad[idx])
            checked += 1
    assert checked == 4


def test_transformer_dropout_eval_and_batching():
    """A block with dropout and DropPath in evaluation mode equals the plain block with the same
    weights; a segment of BatchNorm steps is evaluated layer by layer (the obstacle names it)."""
    torch.manual_seed(0)
    plain = TransformerStep(8, 2, 16).double()
    torch.manual_seed(0)
    drop = TransformerStep(8, 2, 16, dropout=0.3, drop_path=0.2).double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    assert torch.equal(drop(x), plain(x))
    drop.train()
    assert not torch.allclose(drop(x), plain(x))  # outside a segment: like nn.Dropout
    seg = LayerParallelResNet.build(lambda k: nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)),
                                    4, (3,))
    assert "BatchNorm1d" in seg.batching_obstacle
    out = seg(torch.randn(6, 3), 6)  # training: running statistics once per forward
    bn = seg.steps[0][1]
    assert int(bn.num_batches_tracked) == 1 and out.shape == (6, 3)
    with torch.no_grad():
        seg(torch.randn(6, 3), 6)
    assert int(bn.num_batches_tracked) == 2, "a training-mode forward under no_grad updates too"


def test_cifar_resnet_model_and_flags():
    """``--model cifar-resnet``: the layer-parallel network (one rank, exact 2-level solves)
    equals its serial form (same keys and weights; training-mode output and running statistics
    after one forward; evaluation output), h = 1; ``--dropout`` only for the transformers."""
    from mpi4py import MPI

    from layerpar.jobconfig import JobConfig
    from mgrit.models import build_model
    cfg = JobConfig(model="cifar-resnet", dataset="digits", channels=2, layers=3, levels=2,
                    cfactor=2, tol=1e-13)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ser = build_model("cifar-resnet", cfg, (1, 8, 8), 10)
        par = build_model("cifar-resnet", cfg, (1, 8, 8), 10, comm=MPI.COMM_SELF)
        assert par.segments[0].h == 1.0 and len(par.segments) == 3
        sd, ref = par.to_serial().state_dict(), ser.state_dict()
        assert list(sd) == list(ref) and all(torch.equal(sd[k], ref[k]) for k in sd)
        x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(1))
        out, want = par(x), ser(x)
        assert ((out - want).norm() / want.norm()).item() < 1e-10
        sd = par.to_serial().state_dict()
        worst = max(((sd[k] - v).norm() / v.norm().clamp_min(1e-4)).item()
                    for k, v in ser.state_dict().items() if "running" in k)
        assert worst < 1e-10, f"running statistics rel err {worst}"
        par.eval()
        ser.eval()
        with torch.no_grad():
            out, want = par(x), ser(x)
        assert ((out - want).norm() / want.norm()).item() < 1e-10
    finally:
        torch.set_default_dtype(old)
    with pytest.raises(ValueError, match="--dropout=0.1 applies to the transformers"):
        JobConfig(model="resnet", dropout=0.1).validated(1)
    with pytest.raises(ValueError, match="--drop-path=1.0 is not allowed"):
        JobConfig(model="vit", drop_path=1.0).validated(1)
