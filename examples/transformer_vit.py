"""A small vision transformer whose encoder blocks are solved layer-parallel by MGRIT.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py examples/transformer_vit.py [--quick]

Each pre-LN block is one forward-Euler step ``X + h F(X)`` (``TransformerStep``); ``T = N``
gives ``h = 1``, the standard transformer. Patch embedding and head are ordinary modules
around the layer-parallel segment. Training loop: plain PyTorch, on every rank.
"""
import argparse

import torch
from torch import nn

from data import load_dataset
from mgrit.nn import LayerParallelNet, LayerParallelResNet, TransformerStep
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid


class Patches(nn.Module):
    """(n, 1, 8, 8) images -> (n, 4, d) tokens: 4x4 patches, a linear map, learned positions."""

    def __init__(self, d):
        super().__init__()
        self.embed, self.pos = nn.Conv2d(1, d, 4, stride=4), nn.Parameter(torch.zeros(4, d))

    def forward(self, x):
        return self.embed(x).flatten(2).transpose(1, 2) + self.pos


class Head(nn.Module):  # LayerNorm, mean over tokens, linear classifier
    def __init__(self, d):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, x):
        return self.out(self.norm(x).mean(1))


p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true", help="a few seconds: 4 blocks, 20 steps")
args = p.parse_args()
grid = ProcessGrid()
d, blocks, steps = 16, 4 if args.quick else 8, 20 if args.quick else 300
# inexact training (the fast mode): nested iteration, 3 forward / 2 adjoint cycles
fwd = MGRITOptions(max_levels=2, cfactor=2, tol=0, max_iter=3, nested_iteration=True)
bwd = MGRITOptions(max_levels=2, cfactor=2, tol=0, max_iter=2)
stack = LayerParallelResNet.build(lambda k: TransformerStep(d, n_heads=2), blocks, (4, d),
                                  T=float(blocks), comm=grid.layer_comm, forward=fwd, backward=bwd,
                                  warm_start=False)  # nested iteration replaces the warm start
torch.manual_seed(0)
net = LayerParallelNet(Patches(d), stack, Head(d))
opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
train, test = load_dataset("digits")
x, y = torch.as_tensor(train.x), torch.as_tensor(train.y)
g = torch.Generator().manual_seed(0)          # the same batches on every rank
for step in range(steps):
    idx = torch.randint(len(y), (64,), generator=g)
    opt.zero_grad()
    loss = net.loss(net(x[idx]), y[idx])      # every rank; the real loss on the last rank
    loss.backward()                           # every rank: one adjoint MGRIT solve
    opt.step()
    if step in (0, steps - 1) and grid.comm.rank == 0:
        print(f"step {step} loss {net.from_last(loss.item()):.4f}")
    elif step in (0, steps - 1):
        net.from_last(loss.item())            # from_last is collective
with torch.no_grad():
    out = net.from_last(net(torch.as_tensor(test.x)))
if grid.comm.rank == 0:
    acc = (out.argmax(1).numpy() == test.y).mean()
    print(f"test accuracy {acc:.3f}; last forward residuals {stack.last_forward.residuals}")
