"""Space-time MGRIT: the coarse levels of a 3-D convolutional ResNet on coarser voxel grids.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py examples/spatial_coarsening.py [--quick]

The states are feature maps (batch, C, 15, 15, 15) of the generated voxel set (data.voxels).
With ``spatial=SpatialCoarsening(levels=(1,))`` MGRIT's level 1 works on 7^3 maps, so a coarse
step costs 343/3375 of a fine one. Exact solves (a tolerance) still give the serial network's
output: spatial coarsening changes the coarse-grid correction, not the fixed point. Then a few
inexact training steps (2 forward / 1 adjoint cycles), as in training.
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F

from data import load_dataset
from mgrit.nn import LayerParallelNet, LayerParallelResNet, make_step
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid
from mgrit.perf import spatial_level_cost
from mgrit.spatial import SpatialCoarsening

p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true", help="a few seconds: 8 layers, 2 channels")
args = p.parse_args()
torch.set_default_dtype(torch.float64)
grid = ProcessGrid()
train, _ = load_dataset("voxels")             # 3-D shapes on 15^3, generated (nothing downloaded)
C, N, n = (2, 8, 8) if args.quick else (4, 32, 16)
x = torch.as_tensor(train.x[:n], dtype=torch.float64)   # (n, 1, 15, 15, 15)
y = torch.as_tensor(train.y[:n])


def network(spatial, opts, bwd=None):
    """Conv3d opening -> N residual 3-D conv steps (layer-parallel) -> linear closing."""
    torch.manual_seed(0)  # the same weights for every network built here
    opening = nn.Sequential(nn.Conv3d(1, C, 3, padding=1), nn.Tanh())
    resnet = LayerParallelResNet.build(lambda k: make_step("conv", C, "tanh", dims=3), N,
                                       (C, 15, 15, 15), comm=grid.layer_comm, seed=0,
                                       forward=opts, backward=bwd or opts, spatial=spatial)
    torch.manual_seed(1)
    return LayerParallelNet(opening, resnet, nn.Sequential(nn.Flatten(), nn.Linear(C * 3375, 4)))


exact = MGRITOptions(max_levels=2, cfactor=2, tol=1e-10, max_iter=50, relax="FCF")
cycles = {}
for name, spatial in (("time-only", None), ("space-time", SpatialCoarsening(levels=(1,)))):
    net = network(spatial, exact)
    with torch.no_grad():
        out = net.from_last(net(x))           # collective; the output lives on the last rank
    cycles[name] = len(net.resnet.last_forward.residuals) - 1
serial = net.to_serial()                      # the plain nn.Sequential with the same weights
with torch.no_grad():
    diff = (serial(x) - out).abs().max().item()
cost = spatial_level_cost((15, 15, 15), (1,), 2)
if grid.comm.rank == 0:
    print(f"exact solves: time-only {cycles['time-only']} cycles, space-time "
          f"{cycles['space-time']} cycles; max |space-time - serial| = {diff:.2e}")
    print(f"a level-1 step costs {cost[1]:.4f} of a fine step (7^3 / 15^3 points)")

# inexact training, as the main job trains (--spatial-coarsening 1): 2 forward / 1 adjoint cycles
inexact = [MGRITOptions(max_levels=2, cfactor=2, tol=0, max_iter=k, relax="FCF")
           for k in (2, 1)]
net = network(SpatialCoarsening(levels=(1,)), *inexact)
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
losses = []
for step in range(10 if args.quick else 40):
    opt.zero_grad()
    loss = net.loss(net(x), y, F.cross_entropy)
    loss.backward()
    opt.step()
    losses.append(net.from_last(loss.item()))
if grid.comm.rank == 0:
    print(f"training loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")
