"""Spatial coarsening of the coarse MGRIT levels (``LayerParallelResNet(spatial=...)``,
mgrit/spatial/), run on k ranks by tests/nn/test_spatial_mpi.py and in-process by
tests/nn/test_spatial.py (float64, exact mode: solves to 1e-13).

Reference: serial PyTorch autograd through ``serial_resnet`` (the same per-layer seeds). Each
rank compares what it holds: the output and the loss (last layer rank), the input gradient
(first layer rank) and the gradient of every local parameter, to 1e-10 (absolute; the values
are O(1)). Spatial coarsening changes only the coarse correction, never the fixed point.
"""
import torch
from mpi4py import MPI
from torch import nn

from mgrit.nn import LayerParallelResNet
from mgrit.nn.resnet.seeding import serial_resnet
from mgrit.options import MGRITOptions
from mgrit.spatial import SpatialCoarsening

COMM = MPI.COMM_WORLD
DT = torch.float64
N, B, C, T = 12, 3, 2, 1.5
TOL = 1e-10


def conv_step(dims: int, bn: bool = False):
    """A ``C -> C`` convolution step of ``dims`` spatial dims (padding: any size)."""
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    parts = [conv(C, C, 3, padding=1)]
    if bn:
        parts.append((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims - 1](C))
    return nn.Sequential(*parts, nn.Tanh()).to(DT)


def options(levels: int, batched: bool, tol: float = 1e-13, max_iter: int = 80):
    return MGRITOptions(max_levels=levels, cfactor=2, min_coarse=1, tol=tol, max_iter=max_iter,
                        batched=batched)


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def compare(net, serial, shape, comm, seed=0):
    """Forward + backward of ``net`` (every rank) and ``serial``; the largest deviation this
    rank holds, maximized over ``comm``."""
    x = _rand(B, *shape, seed=seed).requires_grad_(True)
    w = _rand(B, *shape, seed=seed + 1)
    y = net(x if net.is_first else None, batch_size=B)
    (y * w).sum().backward() if net.is_last else y.sum().backward()
    xs = x.detach().clone().requires_grad_(True)
    ys = serial(xs)
    (ys * w).sum().backward()
    worst = 0.0
    if net.is_last:
        worst = max(worst, (y - ys).abs().max().item())
    if net.is_first:
        worst = max(worst, (x.grad - xs.grad).abs().max().item())
    for j, step in enumerate(net.steps):
        ref = serial[net.first + j].F
        for (name, p), q in zip(step.named_parameters(), ref.parameters()):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    return comm.allreduce(worst, op=MPI.MAX)


def check_exact(dims=2, size=7, levels=2, coarsened=(1,), grid="auto", batched=True,
                restrict="full_weighting", prolong="linear", comm=None):
    """Output, input gradient and every parameter gradient equal serial autograd (<= 1e-10)."""
    comm = COMM if comm is None else comm
    shape = (C, *([size] * dims))
    sp = SpatialCoarsening(levels=coarsened, restrict=restrict, prolong=prolong, grid=grid)
    make = lambda k: conv_step(dims)  # noqa: E731
    net = LayerParallelResNet.build(make, N, shape, comm=comm, T=T, spatial=sp,
                                    forward=options(levels, batched),
                                    backward=options(levels, batched))
    worst = compare(net, serial_resnet(make, N, T=T), shape, comm)
    its = (net.last_forward.iterations, net.last_backward.iterations)
    assert net.last_forward.converged and net.last_backward.converged, its
    assert worst <= TOL, (worst, its)
    return f"{worst:.1e} its={its}"


def check_replicas(levels=2):
    """2 layer ranks x 2 data-parallel replicas (Trainer): parameters after 2 SGD steps equal
    serial full-batch training (relative 1e-9; global keys are the serial model's)."""
    import copy

    import torch.nn.functional as F

    from mgrit.nn import LayerParallelNet
    from mgrit.parallel import ProcessGrid
    from mgrit.training import Trainer
    grid = ProcessGrid(data_parallel=2)
    shape = (C, 6, 6)
    make = lambda k: conv_step(2)  # noqa: E731
    torch.manual_seed(5)
    opening = nn.Conv2d(1, C, 3, padding=1).to(DT)
    closing = nn.Sequential(nn.Flatten(), nn.Linear(C * 36, 2)).to(DT)
    serial = copy.deepcopy(nn.Sequential(opening, *serial_resnet(make, N, T=T), closing))
    seg = LayerParallelResNet.build(make, N, shape, comm=grid.layer_comm, T=T,
                                    spatial=SpatialCoarsening(),
                                    forward=options(levels, True), backward=options(levels, True))
    net = LayerParallelNet(opening, seg, closing)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), grid)
    sopt = torch.optim.SGD(serial.parameters(), lr=0.1)
    x, y = _rand(8, 1, 6, 6, seed=3), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
    half = slice(4 * grid.data_rank, 4 * grid.data_rank + 4)
    for _ in range(2):
        trainer.step(x[half], y[half], weight=0.5)
        sopt.zero_grad()
        F.cross_entropy(serial(x), y).backward()
        sopt.step()
    sp = dict(serial.named_parameters())
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-300)).item()  # noqa: E731
    worst = max(rel(p.detach(), sp[k].detach())
                for k, p in net.named_global_parameters())
    worst = grid.comm.allreduce(worst, op=MPI.MAX)
    assert worst < 1e-9, worst
    return f"{worst:.1e}"

