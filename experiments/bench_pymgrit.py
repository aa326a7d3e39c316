"""Benchmark: our MGRIT solver vs PyMGRIT 1.0.6 on the same problems, serial and on 2 ranks.

Usage (from the repository root):

    /work/venv/bin/python experiments/bench_pymgrit.py            # writes experiments/results/bench_pymgrit.md
    /work/venv/bin/python experiments/bench_pymgrit.py --ranks 1 2 4 --repeat 3

The script launches itself once per rank count as
``OMP_NUM_THREADS=1 mpiexec -n P python -m mpi4py experiments/bench_pymgrit.py --worker``
(the venv's mpiexec; override with ``$LAYERPAR_MPIEXEC``). A worker runs every case with both
solvers on ``MPI.COMM_WORLD`` and reports, from rank 0, the iteration counts, the final residuals
and the wall time of setup + solve (PyMGRIT's nested iteration runs in its constructor, ours in
``solve``; both are included), the maximum over ranks, best of ``--repeat`` runs.

Cases (FCF relaxation, zero initial guess, PyMGRIT's time grid ``np.linspace``):

* ``dahlquist-L2`` / ``dahlquist-L3``: u' = -u, u(0) = 1 on [0, 5], backward Euler,
  nt = 16385 (``--nt``), cfactor 2, 2 or 3 levels, V-cycle, nested iteration, tol 1e-10;
* ``heat-L5``: PyMGRIT's Heat1D, nx = 1001, nt = 65 on [0, 2], 5 levels, cfactor 2, F-cycle,
  no nested iteration, tol 1e-7.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))  # the shared reporting helper


def cases(nt: int) -> dict:
    d = dict(problem="dahlquist", t_start=0.0, t_stop=5.0, nt=nt, cycle="V", nested=True, tol=1e-10)
    return {
        "dahlquist-L2": dict(d, cfactors=[2]),
        "dahlquist-L3": dict(d, cfactors=[2, 2]),
        "heat-L5": dict(problem="heat", t_start=0.0, t_stop=2.0, nt=65, nx=1001,
                        cfactors=[2, 2, 2, 2], cycle="F", nested=False, tol=1e-7),
    }


def run_ours(c: dict, comm):
    import torch
    from mgrit.options import MGRITOptions
    from mgrit.problems import Dahlquist, Heat1D
    from mgrit.solver import MGRIT
    n = c["nt"] - 1
    if c["problem"] == "dahlquist":
        prop = Dahlquist(lam=-1.0, t_start=c["t_start"], t_stop=c["t_stop"], n_intervals=n)
    else:
        prop = Heat1D(nx=c["nx"], t_start=c["t_start"], t_stop=c["t_stop"], n_intervals=n)
    opts = MGRITOptions(max_levels=len(c["cfactors"]) + 1, cfactor=list(c["cfactors"]),
                        min_coarse=1, relax="FCF", cycle=c["cycle"], nested_iteration=c["nested"],
                        tol=c["tol"], max_iter=100)
    comm.Barrier()
    t0 = time.perf_counter()
    solver = MGRIT(prop, n_intervals=n, state_shape=prop.state_shape, dtype=torch.float64,
                   options=opts, comm=comm)
    res = solver.solve(prop.initial_value() if comm.Get_rank() == 0 else None)
    elapsed = comm.allreduce(time.perf_counter() - t0, op=max_op())
    return res.iterations, [float(r) for r in res.residuals], elapsed


def run_pymgrit(c: dict, comm):
    from tests.pymgrit_ref import run_pymgrit as ref
    kw = {k: v for k, v in c.items()}
    comm.Barrier()
    t0 = time.perf_counter()
    out = ref(**kw, max_iter=100, comm=comm)
    elapsed = comm.allreduce(time.perf_counter() - t0, op=max_op())
    return out["iterations"], out["conv"], elapsed


def max_op():
    from mpi4py import MPI
    return MPI.MAX


def worker(args) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    import torch  # noqa: F401  -- imports outside the timed regions
    import mgrit.solver  # noqa: F401
    from tests.pymgrit_ref import _pymgrit
    _pymgrit()
    out = {}
    for name, c in cases(args.nt).items():
        if args.cases and name not in args.cases:
            continue
        best = {}
        for label, fn in (("ours", run_ours), ("pymgrit", run_pymgrit)):
            runs = [fn(c, comm) for _ in range(args.repeat)]
            it, hist, _ = runs[0]
            best[label] = dict(iterations=it, final=hist[-1] if hist else None,
                               time=min(r[2] for r in runs), history=hist)
        out[name] = best
    if comm.Get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(out))


def launch(nprocs: int, args) -> dict:
    mpiexec = os.environ.get("LAYERPAR_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    out = ROOT / "experiments" / "results" / f".bench_pymgrit_P{nprocs}.json"
    cmd = [mpiexec, "-n", str(nprocs), sys.executable, "-m", "mpi4py", str(Path(__file__)),
           "--worker", "--worker-out", str(out), "--nt", str(args.nt), "--repeat", str(args.repeat)]
    if args.cases:
        cmd += ["--cases", *args.cases]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, cwd=ROOT, check=True)
    data = json.loads(out.read_text())
    out.unlink()
    return data


def git_commit() -> str:
    from mgrit.training import report as reporting
    return reporting.run_metadata()["commit"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the cases and timing rules.")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts (default 1 2)")
    ap.add_argument("--nt", type=int, default=16385, help="Dahlquist time points (default 16385)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per solver, best time kept (default 2)")
    ap.add_argument("--cases", nargs="*", default=None, help="subset of case names")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "bench_pymgrit.md"),
                    help="markdown table to write")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    load0 = os.getloadavg()[0]
    results = {p: launch(p, args) for p in args.ranks}
    load1 = os.getloadavg()[0]
    rows = ["| case | ranks | iterations ours / PyMGRIT | final residual ours / PyMGRIT | "
            "max rel. diff of histories | time ours (s) | time PyMGRIT (s) | speedup |",
            "|---|---|---|---|---|---|---|---|"]
    for p, data in results.items():
        for name, r in data.items():
            o, g = r["ours"], r["pymgrit"]
            ho = [x for x in o["history"] if x != 0.0]  # PyMGRIT drops exact zeros
            diff = (max(abs(a - b) / abs(b) for a, b in zip(ho, g["history"]))
                    if len(ho) == len(g["history"]) else float("nan"))
            rows.append(f"| {name} | {p} | {o['iterations']} / {g['iterations']} | "
                        f"{o['final']:.6e} / {g['final']:.6e} | {diff:.1e} | {o['time']:.3f} | "
                        f"{g['time']:.3f} | {g['time'] / o['time']:.1f}x |")
    cmd = "/work/venv/bin/python experiments/bench_pymgrit.py " + " ".join(sys.argv[1:])
    head = [
        "# Our MGRIT vs PyMGRIT 1.0.6",
        "",
        f"- command: `{cmd.strip()}`",
        f"- commit: {git_commit()}",
        f"- machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; Python {platform.python_version()}",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- timing: setup + solve (incl. nested iteration), max over ranks, best of "
        f"{args.repeat}; OMP_NUM_THREADS=1; launched with `mpiexec -n P python -m mpi4py`",
        f"- 1-min load average before/after: {load0:.1f} / {load1:.1f} (shared machine: other "
        f"jobs ran concurrently, so times are noisy; iteration counts are exact)",
        "- cases: see the docstring of experiments/bench_pymgrit.py (FCF, cfactor 2; Dahlquist "
        f"nt={args.nt} on [0,5] BE V-cycle nested tol 1e-10; heat nx=1001 nt=65 5 levels "
        "F-cycle tol 1e-7)",
        "",
    ]
    text = "\n".join(head + rows) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
