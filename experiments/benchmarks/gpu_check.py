"""GPU check: a 2-rank layer-parallel step and a 2-rank data-parallel step on CUDA equal the CPU
result (float64, exact MGRIT solves).

Usage (from the repository root, on a machine with a GPU and the venv)::

    python experiments/benchmarks/gpu_check.py            # exit 0: PASS or SKIP (no CUDA); exit 1: FAIL
    python experiments/benchmarks/gpu_check.py --dry-run    # the same path with "device" = cpu (alias --force-cpu)

The driver launches ``mpiexec -n 2 python -m mpi4py experiments/benchmarks/gpu_check.py --worker`` (venv's
mpiexec; ``$LAYERPAR_MPIEXEC`` overrides). Each rank takes its device from
:func:`mgrit.parallel.procgrid.device_for_rank` (local rank modulo the visible GPUs: both ranks share a
single GPU) and checks, against the same computation on the CPU in the same process:

1. ``P_L = 2 x P_D = 1``: one SGD step of opening -> 8-layer MGRIT ResNet -> closing, state
   messages between the ranks staged through host memory (or CUDA-aware MPI);
2. ``P_L = 1 x P_D = 2``: two SGD steps with gradients averaged over the 2 replicas by
   :func:`mgrit.parallel.dataparallel.average_gradients` on CUDA buffers (CUDA-aware MPI when
   ``mgrit.comm.cuda_aware()``, else staged through host memory).

Tolerance: 1e-10 relative on every parameter after the step(s) (GPU kernels round differently
from the CPU ones; exact-mode MGRIT converges to 1e-13). Runs in well under a minute.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))

import mpi4py  # noqa: E402
import torch  # noqa: E402

if "--worker" not in sys.argv:
    mpi4py.rc.initialize = False  # the driver launches mpiexec and must not start MPI itself
from mpi4py import MPI  # noqa: E402

from mgrit.comm import cuda_aware  # noqa: E402
from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.parallel.dataparallel import average_gradients  # noqa: E402
from mgrit.parallel.procgrid import ProcessGrid  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402
from mgrit.training.support.faults import fail_fast  # noqa: E402

TOL = 1e-10


def _batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (n,), generator=g))


def _layer_parallel_step(comm, device, steps=1):
    width = 8
    torch.manual_seed(5)
    opening = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, width)).double().to(device)
    torch.manual_seed(6)
    closing = torch.nn.Linear(width, 10).double().to(device)
    exact = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=50)
    resnet = LayerParallelResNet.build(lambda k: DenseStep(width, "tanh").double().to(device), 8,
                                       (width,), comm=comm, seed=2, forward=exact, backward=exact)
    net = LayerParallelNet(opening, resnet, closing)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        x, y = _batch(16, seed=s)
        opt.zero_grad()
        net.loss(net(x.to(device)), y.to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in net.to_serial().parameters()]


def _data_parallel_steps(comm, device, steps=2):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Tanh(),
                              torch.nn.Flatten(), torch.nn.Linear(256, 10)).double().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    r, P = comm.Get_rank(), comm.Get_size()
    calls = 0
    for s in range(steps):
        x, y = _batch(16, seed=10 + s)
        sl = slice(r * 16 // P, (r + 1) * 16 // P)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[sl].to(device)), y[sl].to(device)).backward()
        calls += average_gradients(net.parameters(), comm)
        opt.step()
    return [p.detach().cpu() for p in net.parameters()], calls


def _rel(a, b):
    return max(((p - q).abs().max() / q.abs().max().clamp_min(1e-300)).item() for p, q in zip(a, b))


def worker(force_cpu: bool) -> int:
    fail_fast(MPI.COMM_WORLD)
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("gpu_check worker needs exactly 2 ranks")
    lp = ProcessGrid(comm, data_parallel=1)   # P_L = 2
    dp = ProcessGrid(comm, data_parallel=2)   # P_D = 2
    device = torch.device("cpu") if force_cpu else lp.device
    rank = comm.Get_rank()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    errs = {
        "layer-parallel P_L=2": _rel(_layer_parallel_step(lp.layer_comm, device),
                                     _layer_parallel_step(lp.layer_comm, torch.device("cpu"))),
    }
    got, calls = _data_parallel_steps(dp.data_comm, device)
    ref, _ = _data_parallel_steps(dp.data_comm, torch.device("cpu"))
    errs["data-parallel P_D=2"] = _rel(got, ref)
    allerrs = comm.gather(errs, root=0)
    ok = all(e <= TOL for d in allerrs or [errs] for e in d.values()) and calls == 2
    ok = comm.bcast(ok, root=0)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
        print(f"device: {device} ({name}); CUDA-aware MPI: {cuda_aware()} "
              f"({'GPU buffers passed to MPI' if cuda_aware() else 'staged through host memory'})")
        for r, d in enumerate(allerrs):
            for k, e in d.items():
                print(f"  rank {r} {k}: max rel diff vs CPU {e:.2e} (tol {TOL:g})")
        print(f"{'PASS' if ok else 'FAIL'}: 2-rank layer-parallel and data-parallel steps on {device} "
              f"{'equal' if ok else 'differ from'} the CPU result")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--force-cpu", "--dry-run", action="store_true", dest="force_cpu",
                    help="run the comparison with device = cpu (a dry run without a GPU)")
    args = ap.parse_args()
    if args.worker:
        return worker(args.force_cpu)
    if not args.force_cpu and not torch.cuda.is_available():
        return reporting.skip("no CUDA device (torch.cuda.is_available() is False); nothing to "
                              "check on this machine")
    mpiexec = os.environ.get("LAYERPAR_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()),
           "--worker"] + (["--force-cpu"] if args.force_cpu else [])
    try:
        return subprocess.run(cmd, env=env, cwd=ROOT, timeout=300).returncode
    except subprocess.TimeoutExpired:
        print("FAIL: the 2-rank check timed out after 300 s")
        return 1


if __name__ == "__main__":
    sys.exit(main())
