"""Layer-wise training: decoupled greedy learning (DGL) pipelined over ranks, or sequential
layer-by-layer training, each layer with its own auxiliary head and local loss.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py examples/layerwise_training.py [--quick]
        [--method decoupled|sequential]

decoupled (Belilovsky et al. 2020): the blocks are split into one stage per layer rank; every
stage trains on its own head's loss as soon as the previous stage's output arrives, so no
backward pass crosses ranks. sequential (Kim 2019): block 1 with its head, then block 2 on the
frozen block 1's features, ...; the ranks are data-parallel replicas.
"""
import argparse

import torch
from mpi4py import MPI
from torch import nn

from data import load_dataset
from layerwise import build_method
from mgrit.parallel import ProcessGrid
from mgrit.training import Trainer

p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true", help="a few seconds: 480 images, short schedule")
p.add_argument("--method", choices=["decoupled", "sequential"], default="decoupled")
args = p.parse_args()
train, test = load_dataset("digits")
data = (train.x[:480], train.y[:480]) if args.quick else train
torch.manual_seed(0)  # the blocks must be identical on every rank
blocks = [nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU())] + \
         [nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)]
if args.method == "decoupled":  # stages over the layer ranks (4 blocks: 1, 2 or 4 ranks)
    grid = ProcessGrid(data_parallel=1)
    method = build_method("decoupled", blocks, 10, (1, 8, 8), grid=grid, lr=0.05, head="linear")
    epochs = 2 if args.quick else 20
else:                           # every rank a replica; --epochs is per block
    grid = ProcessGrid(data_parallel=MPI.COMM_WORLD.Get_size())
    method = build_method("sequential", blocks, 10, (1, 8, 8), grid=grid, lr=0.05,
                          epochs=1 if args.quick else 5)
    epochs = len(method.plan)   # one entry per epoch: which block (or head) trains
trainer = Trainer(method, None, grid, loss=method.loss_function)
fit = trainer.fit(data, epochs=epochs, batch_size=32, seed=0, test=test)
if trainer.is_root:
    print(f"{args.method}: test accuracy {fit.plan.initial_test_acc:.3f} before, "
          f"{fit.final['test_acc']:.3f} after {epochs} epochs")
