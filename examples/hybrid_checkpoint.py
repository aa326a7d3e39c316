"""Layer x data parallel training with checkpoints, resumed on a different process grid.

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py examples/hybrid_checkpoint.py [--quick]

``ProcessGrid(data_parallel=P_D)`` splits the ranks into ``P_L = size / P_D`` layer ranks times
``P_D`` replicas. The job trains one epoch on that grid, saves a checkpoint, then resumes it on
a grid of layer ranks only (checkpoints re-partition) and compares with an uninterrupted run.
"""
import argparse
import os
import tempfile

import torch
from mpi4py import MPI
from torch import nn

from data import load_dataset
from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid
from mgrit.training import Trainer

p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true", help="a few seconds: 8 layers, 240 images")
p.add_argument("--dp", type=int, default=2, help="replicas P_D of the first grid (default 2)")
args = p.parse_args()
torch.set_default_dtype(torch.float64)  # exact mode (the default options) in float64
world = MPI.COMM_WORLD
ckpt = world.bcast(os.path.join(tempfile.mkdtemp(), "ckpt.pt") if world.rank == 0 else None)
train, test = load_dataset("digits")
data = (train.x[:240], train.y[:240]) if args.quick else train
layers = 8 if args.quick else 16
exact = MGRITOptions(max_levels=2, cfactor=2, tol=1e-10, max_iter=50)  # solves to round-off


def run(grid, epochs, checkpoint=None, resume=None):
    resnet = LayerParallelResNet.build(lambda k: DenseStep(16, "tanh"), layers, (16,),
                                       comm=grid.layer_comm, forward=exact, backward=exact)
    torch.manual_seed(0)  # opening and closing: the same weights on every grid
    net = LayerParallelNet(nn.Sequential(nn.Flatten(), nn.Linear(64, 16)), resnet, nn.Linear(16, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(net, opt, grid, checkpoint=checkpoint)
    fit = trainer.fit(data, epochs=epochs, batch_size=40, seed=0, test=test, resume=resume)
    return fit.final


a = ProcessGrid(world, data_parallel=args.dp)   # e.g. 4 ranks: 2 layer ranks x 2 replicas
run(a, epochs=1, checkpoint=ckpt)               # epoch 1, checkpoint at its end
b = ProcessGrid(world, data_parallel=1)         # every rank a layer rank, no replicas
resumed = run(b, epochs=2, resume=ckpt)         # epoch 2 from the checkpoint
straight = run(a, epochs=2)                     # the same two epochs without a break
if world.rank == 0:
    print(f"grid {a.layer_size}x{a.data_size} then {b.layer_size}x{b.data_size}: "
          f"test loss {resumed['test_loss']:.10f}")
    print(f"grid {a.layer_size}x{a.data_size} throughout: test loss {straight['test_loss']:.10f}")
    print(f"difference {abs(resumed['test_loss'] - straight['test_loss']):.1e}")
