"""A GRU solved parallel in time (MGRIT over the time steps) on the adding problem.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py examples/gru_sequence.py [--quick]

Each rank holds the time steps of its slice of the sequence; the GRU's parameters are
replicated (``nn.GRUCell``'s names and initialization); the head sits on the last time rank.
Target: the sum of the two marked values of a sequence (predicting 1 scores MSE 1/6).
"""
import argparse

import torch
from torch.nn import functional as F

from data.sequences import ADDING_BASELINE_MSE, make_adding_problem
from mgrit.nn import GRUSequenceClassifier
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid

p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true", help="a few seconds: 32 time steps, 30 steps")
args = p.parse_args()
grid = ProcessGrid()
T, steps = (32, 30) if args.quick else (256, 400)
x, y = (torch.as_tensor(a) for a in make_adding_problem(512, T, seed=0))
tx, ty = (torch.as_tensor(a) for a in make_adding_problem(256, T, seed=0, stream=1))
# trained GRUs converge slowly under MGRIT: FCF relaxation and 3 forward / 2 adjoint cycles
fwd = MGRITOptions(max_levels=2, cfactor=4, relax="FCF", tol=0, max_iter=3)
bwd = MGRITOptions(max_levels=2, cfactor=4, relax="FCF", tol=0, max_iter=2)
torch.manual_seed(0)
net = GRUSequenceClassifier(2, 16, 1, comm=grid.layer_comm, forward=fwd, backward=bwd)
opt = torch.optim.Adam(net.parameters(), lr=1e-2)


def mse(out, target):
    return F.mse_loss(out.squeeze(-1), target)


for step in range(steps):
    idx = torch.arange(step * 32, step * 32 + 32) % len(y)
    opt.zero_grad()
    loss = net.loss(net(x[idx]), y[idx], mse)  # every rank; the real loss on the last rank
    loss.backward()                            # adjoint MGRIT over time, then one Allreduce
    opt.step()
    first = net.from_last(loss.item()) if step == 0 else first
print_ = print if grid.comm.rank == 0 else (lambda *a: None)
with torch.no_grad():
    out = net(tx)                              # collective: every rank calls the net
test_mgrit = net.from_last(mse(out, ty).item() if net.is_last else None)
serial = net.to_serial()                       # nn.GRU + nn.Linear with these weights, no MPI
with torch.no_grad():
    test_serial = mse(serial["head"](serial["gru"](tx)[1][0]), ty).item()
print_(f"first batch MSE {first:.4f}; baseline {ADDING_BASELINE_MSE:.4f}")
print_(f"test MSE {test_mgrit:.4f} (3 MGRIT cycles) {test_serial:.4f} (exported nn.GRU)")
