"""A user's script on 2 ranks, launched WITHOUT ``python -m mpi4py`` (no abort on an uncaught
exception, no fail_fast): a layer-parallel ResNet, one forward, then by ``sys.argv[1]``

* ``skip``: rank 1 never calls ``.backward()`` (it waits in a barrier); rank 0's backward
  agreement must end the job after the 2 s deadline naming rank 1;
* ``adjoint``: a step's VJP raises on rank 1 only, inside the adjoint MGRIT solve; the job
  must end at once (the other rank waits in the solve), naming rank 1;
* ``pipelined``: the same failure on the one-level path (``max_levels=1``), where rank 1's
  layers run their backward in the caller's autograd engine, outside any library section:
  rank 0 waits for rank 1's gradient at most the 2 s deadline, names rank 1, and ends the job.
"""
import sys

import torch
from mpi4py import MPI
from torch import nn

from mgrit.collective import set_collective_timeout
from mgrit.nn import LayerParallelResNet
from mgrit.options import MGRITOptions

comm = MPI.COMM_WORLD
mode = sys.argv[1]
set_collective_timeout(2.0)


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if comm.Get_rank() == 1 and mode != "skip":
            raise ValueError("step VJP failed on purpose")
        return g


class Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(Boom.apply(self.lin(x)))


torch.set_default_dtype(torch.float64)
opts = MGRITOptions(max_levels=1 if mode == "pipelined" else 2, cfactor=2, max_iter=2)
net = LayerParallelResNet.build(lambda k: Step(), 8, (4,), comm=comm, forward=opts,
                                backward=opts)
x = torch.randn(3, 4) if comm.Get_rank() == 0 else None
out = net(x, batch_size=3)
if mode == "skip":
    if comm.Get_rank() == 1:
        comm.Barrier()  # never meets rank 0, which is in the backward agreement
    out.sum().backward()
else:
    out.sum().backward()
print(f"rank {comm.Get_rank()} finished (must not happen)", flush=True)
