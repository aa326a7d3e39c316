"""Trace of a real layer-parallel ResNet training step: the MGRIT forward solve and the
adjoint-MGRIT backward solve of :class:`mgrit.nn.LayerParallelResNet` on ``P`` ranks
(oversubscribed where the machine has fewer cores: the trace records the order of operations
and messages, which oversubscription does not change; its wall clocks are then not times of
dedicated cores).

What is traced: the solves (steps, state messages, the solver's collectives). Not traced:
the autograd bridge around them (the parameter-gradient sweep after the adjoint solve, the
agreement collectives of the bridge, the loss) -- see the issue-24 notes in
``docs/features/tracing.rst``; its share of the step is measured
(``meta["step_walls"]`` minus the solves' walls; :mod:`mgrit.perf.trace.calibrate`).

Command line (one JSON file per run, every rank's record gathered on rank 0)::

    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m mgrit.perf.trace.resnet \\
        --layers 32 --width 4 --batch 8 --cfactor 4 --iters 2 --out trace.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from mpi4py import MPI

from ...nn import DenseStep, LayerParallelResNet
from ...options import MGRITOptions
from ..model import CommCost
from .recorder import Tracer
from .replay import replay
from .trace import Trace

__all__ = ["trace_resnet", "library_costs", "main", "CLOCKS"]

#: The clocks a traced run can use (command line ``--clock``).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def trace_resnet(comm: MPI.Comm, n_layers: int = 32, width: int = 4, batch: int = 8,
                 forward: MGRITOptions | None = None, backward: MGRITOptions | None = None,
                 steps: int = 1, seed: int = 0, dtype: torch.dtype = torch.float64,
                 act: str = "tanh", clock=None) -> tuple[Trace | None, LayerParallelResNet, Tracer]:
    """Build a dense ResNet (``n_layers`` :class:`~mgrit.nn.DenseStep` of ``width``, tanh,
    ``T = 1``) on the ranks of ``comm``, run ``steps`` forward+backward passes of the loss
    ``sum(y**2) / batch`` on a seeded input ``(batch, width)``, recording both solvers.
    Collective over ``comm``.

    Args:
        forward, backward: solver options (default: 2 levels, ``cfactor=4``, 2 forward and
            1 backward fixed cycles, ``tol = 0``: inexact training, TorchBraid's setting).
        clock: the tracer's and the step times' clock (seconds; default
            ``time.perf_counter``; ``time.process_time``: this rank's CPU time, which a loaded
            machine perturbs less -- waits then count as the CPU MPI's polling spends).

    Returns:
        ``(trace on rank 0 / None elsewhere, the model, this rank's tracer)``; the model's
        ``forward_solver.stats`` and ``backward_solver.stats`` are the solver's own counters
        of the traced solves (fresh model: nothing else ran). Solves are labelled
        ``"forward"`` and ``"adjoint"``. The trace's ``meta["step_walls"]``: each training
        step's time on ``clock`` (seconds, forward + backward with the untraced bridge, the
        largest over the ranks; measured).

    Raises:
        ValueError: both solves have one level (nothing to trace: the one-level exact path
            runs no MGRIT solve) -- on every rank.
    """
    fwd = forward or MGRITOptions(max_levels=2, cfactor=4, max_iter=2, tol=0.0)
    bwd = backward or MGRITOptions(max_levels=2, cfactor=4, max_iter=1, tol=0.0)
    model = LayerParallelResNet.build(lambda k: DenseStep(width, act).to(dtype), n_layers,
                                      (width,), comm=comm, seed=seed, forward=fwd, backward=bwd)
    if model.n_levels == (1, 1):
        raise ValueError(f"forward={fwd!r} and backward={bwd!r} have one level each: the "
                         f"ResNet then runs its one-level exact path, which has no MGRIT solve "
                         f"to trace; use max_levels >= 2")
    tracer = Tracer() if clock is None else Tracer(clock=clock)
    tracer.attach(model.forward_solver, "forward")
    tracer.attach(model.backward_solver, "adjoint")
    x = torch.randn(batch, width, dtype=dtype, generator=torch.Generator().manual_seed(seed + 1))
    walls = []
    for _ in range(steps):
        t0 = tracer.clock()
        y = model(x if model.is_first else None, batch_size=batch)
        (y.square().sum() / batch if model.is_last else y.sum()).backward()
        walls.append(tracer.clock() - t0)
    walls = [max(v) for v in zip(*comm.allgather(walls))]  # the slowest rank's step
    meta = {"network": f"dense ResNet, {n_layers} layers, width {width}, {act}",
            "batch": batch, "dtype": str(dtype), "steps": steps, "P": comm.Get_size(),
            "forward": repr(fwd), "backward": repr(bwd), "n_layers": n_layers,
            "step_walls": walls, "clock": getattr(tracer.clock, "__name__", str(tracer.clock))}
    return tracer.gather(comm, 0, meta), model, tracer


def library_costs(comm: MPI.Comm, clock=time.perf_counter, repeats: int = 200,
                  nbytes: int = 512) -> CommCost | None:
    """The message and collective costs of the solver's own exchange between ranks 0 and 1
    (collective over ``comm``; ``None`` on fewer than 2 ranks): latency and bandwidth of raw
    MPI messages (round trips of 8 B and 64 KiB, as :func:`~mgrit.perf.model.pingpong`),
    ``host`` = (half the round trip of an :class:`~mgrit.comm.Exchanger` message of ``nbytes``
    - half a raw one) / 2 (each end's library work), ``collective`` = the mean of the solver's
    two small collectives (the residual's ``allreduce`` of 3 numbers and the validation's
    :func:`~mgrit.collective.allgather_within`). Each the minimum of ``repeats`` timings on
    ``clock``, each after a barrier: the run in which neither rank lost its core (on a loaded
    machine a busy-polling wait for a descheduled partner costs CPU time too)."""
    if comm.Get_size() < 2:
        return None
    import numpy as np

    from ...collective import allgather_within
    from ...comm import Exchanger
    from ...stats import SolverStats
    rank = comm.Get_rank()
    ex = Exchanger(comm, (nbytes // 8,), torch.float64, "cpu", SolverStats())
    t = torch.zeros(nbytes // 8, dtype=torch.float64)
    local = np.zeros(3)

    def raw(n):
        buf = np.zeros(n, dtype=np.uint8)

        def rt():
            if rank < 2:  # rank 0 sends first, rank 1 answers
                (comm.Send if rank == 0 else comm.Recv)(buf, 1 - rank, 7)
                (comm.Recv if rank == 0 else comm.Send)(buf, 1 - rank, 7)
        return rt

    def lib():
        if rank == 0:
            ex.isend(t, 1, 5)
            ex.recv(1, 5)
        elif rank == 1:
            ex.recv(0, 5)
            ex.isend(t, 0, 5)
        ex.waitall()

    def best(fn):
        fn()  # warm-up
        out = []
        for _ in range(repeats):
            comm.Barrier()
            t0 = clock()
            fn()
            out.append(clock() - t0)
        return min(out)
    big = 1 << 16
    r8, rbig, rlib = best(raw(8)) / 2, best(raw(big)) / 2, best(lib) / 2
    coll = (best(lambda: comm.allreduce(local)) +
            best(lambda: allgather_within(comm, (None, (1,)), "a costs probe"))) / 2
    r8, rbig, rlib, coll = comm.bcast((r8, rbig, rlib, coll), root=0)
    bw = (big - 8) / max(rbig - r8, 1e-12)
    lat = max(r8 - 8 / bw, 0.0)
    host = max((rlib - (lat + nbytes / bw)) / 2, 0.0)
    return CommCost(lat, bw, host, coll)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mgrit.perf.trace.resnet",
                                 description="Record the MGRIT forward and adjoint solves of a "
                                             "layer-parallel dense ResNet on every rank.")
    ap.add_argument("--layers", type=int, default=32, help="N, number of layers (default 32)")
    ap.add_argument("--width", type=int, default=4, help="state width (default 4)")
    ap.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    ap.add_argument("--cfactor", type=int, default=4, help="coarsening factor (default 4)")
    ap.add_argument("--levels", type=int, default=2, help="max levels (default 2)")
    ap.add_argument("--iters", type=int, default=2, help="forward cycles (default 2)")
    ap.add_argument("--adjoint-iters", type=int, default=1, help="adjoint cycles (default 1)")
    ap.add_argument("--steps", type=int, default=1, help="training steps (default 1)")
    ap.add_argument("--pingpong", action="store_true",
                    help="also measure the message costs between ranks 0 and 1 (P >= 2; "
                         "library_costs) and store latency (s), bandwidth (B/s), host (s per "
                         "message end) and collective (s) in the trace's meta")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall (time.perf_counter) or cpu (time.process_time: per-rank CPU "
                         "time; also the ping-pong's clock); default wall")
    ap.add_argument("--out", required=True, help="JSON file written by rank 0")
    a = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    opts = dict(max_levels=a.levels, cfactor=a.cfactor, tol=0.0)
    trace, _, _ = trace_resnet(comm, a.layers, a.width, a.batch,
                               MGRITOptions(max_iter=a.iters, **opts),
                               MGRITOptions(max_iter=a.adjoint_iters, **opts), a.steps,
                               clock=CLOCKS[a.clock])
    pp = library_costs(comm, CLOCKS[a.clock]) if a.pingpong else None
    if trace is not None:
        if pp is not None:
            trace.meta["pingpong"] = {"latency": pp.latency, "bandwidth": pp.bandwidth,
                                      "host": pp.host, "collective": pp.collective}
        trace.messages()  # every send matched by its receive, or ValueError
        trace.to_json(a.out)
        res = replay(trace)
        print(f"P={trace.nprocs}: wrote {a.out}; unit-cost critical path {res.critical_path:g} "
              f"steps; recorded wall {res.recorded:.4f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
