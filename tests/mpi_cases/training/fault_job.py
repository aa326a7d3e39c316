"""A tiny layer-parallel training job through the library loop, for fault injection.

Run (with or without ``-m mpi4py``)::

    LAYERPAR_INJECT_FAULT="1:coarse solve" mpiexec -n 3 python tests/mpi_cases/training/fault_job.py

Without injection it trains 3 steps (:meth:`mgrit.training.Trainer.step`: every rank enters
the phases forward relaxation, coarse solve, adjoint and gradient averaging; ``data loading``
is tagged here) and exits 0; with it, the selected rank raises in that phase and
:func:`mgrit.training.fail_fast` aborts the whole job (non-zero exit, one line
``rank R failed in phase P: ...``). With 4 ranks the grid is 2 layer ranks x 2 replicas.
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(_here))))

from mpi4py import MPI  # noqa: E402

from mgrit.training import Trainer, fail_fast  # noqa: E402
from mgrit.training.support.faults import phase  # noqa: E402


def main():
    comm = MPI.COMM_WORLD
    fail_fast(comm)
    # imported after fail_fast on purpose: a failing import is reported (and ends the job) too
    import torch
    from mgrit.parallel import ProcessGrid
    from tests.mpi_cases.training.reliability_cases import BATCH, build, make_data
    grid = ProcessGrid(comm, data_parallel=2 if comm.Get_size() == 4 else 1)
    net, opt = build(grid.layer_comm, "inexact")
    trainer = Trainer(net, opt, grid)
    x, y = make_data()
    for step in range(3):
        with phase("data loading"):
            idx = torch.arange(step * BATCH, (step + 1) * BATCH)
            xb, yb = x[idx], y[idx]
        trainer.step(xb, yb)
    comm.Barrier()
    if comm.Get_rank() == 0:
        print("fault_job finished", flush=True)


if __name__ == "__main__":
    main()
