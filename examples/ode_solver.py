"""The MGRIT solver on your own ODE: subclass Propagator, solve all time steps at once.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py examples/ode_solver.py [--quick]

The damped pendulum ``theta'' = -sin(theta) - 0.1 theta'`` as a first-order system
``u = (theta, omega)``, stepped with the explicit midpoint rule. The solver only hands out
integer fine indices ``start < stop``: an interval of ``stop - start`` fine steps on coarse
levels is one step of size ``(stop - start) * h`` (rediscretization).
"""
import argparse

import torch
from mpi4py import MPI

from mgrit.options import MGRITOptions
from mgrit.propagator import Propagator
from mgrit.solver import MGRIT


class Pendulum(Propagator):
    def __init__(self, n_intervals, t_end):
        self.n_intervals, self.h = n_intervals, t_end / n_intervals

    def f(self, u):                             # right-hand side of u' = f(u)
        return torch.stack([u[1], -torch.sin(u[0]) - 0.1 * u[1]])

    def step(self, u, start, stop, level):      # u at fine index start -> u at fine index stop
        dt = (stop - start) * self.h
        return u + dt * self.f(u + 0.5 * dt * self.f(u))


p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true", help="256 instead of 4096 time steps")
args = p.parse_args()
comm = MPI.COMM_WORLD                           # the time steps are split over its ranks
N = 256 if args.quick else 4096
prop = Pendulum(N, t_end=10.0)
u0 = torch.tensor([2.0, 0.0], dtype=torch.float64)
opts = MGRITOptions(max_levels=3, cfactor=4, relax="FCF", tol=1e-10, max_iter=30)
res = MGRIT(prop, N, (2,), options=opts, comm=comm).solve(u0)  # res.states: rows lo..hi-1
ref = [u0]                                      # sequential time stepping, for comparison
for i in range(N):
    ref.append(prop.step(ref[-1], i, i + 1, 0))
err = (res.states - torch.stack(ref[res.lo:res.hi])).abs().max().item()
err = comm.allreduce(err, op=MPI.MAX)
if comm.rank == 0:
    print(f"{res.iterations} cycles, residuals {['%.1e' % r for r in res.residuals]}")
    print(f"convergence factors {['%.2f' % c for c in res.convergence_factors]}")
    print(f"max |MGRIT - sequential| = {err:.1e} over {N} steps on {comm.size} ranks")
