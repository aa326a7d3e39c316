"""A tiny layer-parallel training job with tagged phases, for fault injection.

Run (with or without ``-m mpi4py``)::

    LAYERPAR_INJECT_FAULT="1:coarse solve" mpiexec -n 3 python tests/mpi_cases/fault_job.py

Without injection it trains 3 steps and exits 0; with it, the selected rank raises in that
phase and :func:`mgrit.training.faults.fail_fast` aborts the whole job (non-zero exit, message
``rank R failed in phase P``).
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))

from mpi4py import MPI  # noqa: E402

from mgrit.training.faults import fail_fast, instrument_resnet, phase  # noqa: E402


def main():
    comm = MPI.COMM_WORLD
    fail_fast(comm)
    import torch
    from tests.mpi_cases.reliability_cases import build, make_data, BATCH
    net, opt = build(comm, "inexact")
    instrument_resnet(net.resnet)
    x, y = make_data()
    for step in range(3):
        with phase("data loading"):
            idx = torch.arange(step * BATCH, (step + 1) * BATCH)
            xb, yb = x[idx], y[idx]
        opt.zero_grad()
        loss = net.loss(net(xb), yb)
        loss.backward()
        with phase("gradient averaging"):
            # stands in for data-parallel averaging (ranks hold different layers here)
            comm.allreduce(sum(float(p.grad.sum()) for p in net.parameters() if p.grad is not None))
        opt.step()
    comm.Barrier()
    if comm.Get_rank() == 0:
        print("fault_job finished", flush=True)


if __name__ == "__main__":
    main()
