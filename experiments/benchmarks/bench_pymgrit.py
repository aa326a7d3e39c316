"""Benchmark: our MGRIT solver vs PyMGRIT 1.0.6, solver against solver on the SAME problem code,
and the two problem implementations against each other, serial and on 2 ranks.

Usage (from the repository root)::

    python experiments/benchmarks/bench_pymgrit.py                 # writes experiments/results/benchmarks/bench_pymgrit.md
    python experiments/benchmarks/bench_pymgrit.py --quick --out /tmp/b.md   # seconds (CI smoke)
    python experiments/benchmarks/bench_pymgrit.py --ranks 1 2 4 --repeat 3

The script launches itself once per rank count as
``OMP_NUM_THREADS=1 mpiexec -n P python -m mpi4py experiments/benchmarks/bench_pymgrit.py --worker``
(the venv's mpiexec; override with ``$LAYERPAR_MPIEXEC``).

Why a 2 x 2 table: the two packages ship their own problem classes. Ours (``mgrit.problems``)
caches the Dahlquist amplification factor and one factorization of ``I + dt L`` per step size
for the heat equation; PyMGRIT's recompute them every step (``1 / (1 - z)``; ``spsolve`` of a
new sparse matrix). Timing "our solver + our problem" against "PyMGRIT + PyMGRIT's problem"
compares problem implementations as much as solvers. So every case runs all four combinations
of {our solver, PyMGRIT's solver} x {our problem code, PyMGRIT's problem code}, through thin
adapters (``PyMGRITProblem``: PyMGRIT's application as our ``Propagator``; ``OurProblemApp``: our
propagator as a PyMGRIT ``Application``); the adapters convert between torch tensors and
PyMGRIT vectors every step, a cost that lands on the adapted side (measured apart, below).

* solver vs solver = the same column (same problem code): ``time(PyMGRIT solver) / time(ours)``;
* problem vs problem = a serial sweep of the N fine steps with each implementation, natively and
  through the adapters (microseconds per step), no solver involved.

Every combination must give the same iteration count and residual history (checked: the
largest relative difference of the histories is reported). Timing: setup + solve (PyMGRIT's
nested iteration runs in its constructor, ours in ``solve``), max over ranks, best of
``--repeat``; meaningful on a quiet machine only.

Cases (FCF relaxation, zero initial guess, PyMGRIT's time grid ``np.linspace``):

* ``dahlquist-L2`` / ``dahlquist-L3``: u' = -u, u(0) = 1 on [0, 5], backward Euler,
  nt = 16385 (``--nt``), cfactor 2, 2 or 3 levels, V-cycle, nested iteration, tol 1e-10;
* ``heat-L5``: Heat1D, nx = 1001 (``--nx``), nt = 65 on [0, 2], 5 levels, cfactor 2, F-cycle,
  no nested iteration, tol 1e-7.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "benchmarks"  # default results base folder

import numpy as np  # noqa: E402
import mpi4py  # noqa: E402
import torch  # noqa: E402

if "--worker" not in sys.argv:
    mpi4py.rc.initialize = False  # the driver launches mpiexec and must not start MPI itself
from mpi4py import MPI  # noqa: E402

from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.problems import Dahlquist, Heat1D  # noqa: E402
from mgrit.propagator import Propagator  # noqa: E402
from mgrit.solver import MGRIT  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402
from tests.pymgrit_ref import _pymgrit, build_pymgrit_levels  # noqa: E402

from experiments.reports.study_parts import write_headline  # noqa: E402

SOLVERS = ("ours", "pymgrit")
PROBLEMS = ("ours", "pymgrit")


def cases(nt: int, nx: int) -> dict:
    d = dict(problem="dahlquist", t_start=0.0, t_stop=5.0, nt=nt, cycle="V", nested=True, tol=1e-10)
    return {"dahlquist-L2": dict(d, cfactors=[2]),
            "dahlquist-L3": dict(d, cfactors=[2, 2]),
            "heat-L5": dict(problem="heat", t_start=0.0, t_stop=2.0, nt=65, nx=nx,
                            cfactors=[2, 2, 2, 2], cycle="F", nested=False, tol=1e-7)}


# ------------------------------------------------------------------------------ adapters
def our_problem(c):
    n = c["nt"] - 1
    if c["problem"] == "dahlquist":
        return Dahlquist(lam=-1.0, t_start=c["t_start"], t_stop=c["t_stop"], n_intervals=n)
    return Heat1D(nx=c["nx"], t_start=c["t_start"], t_stop=c["t_stop"], n_intervals=n)


def pymgrit_apps(c):
    """PyMGRIT's own application objects, one per level (tests/pymgrit_ref.py)."""
    return build_pymgrit_levels(c["problem"], c["t_start"], c["t_stop"], c["nt"], c["cfactors"],
                                nx=c.get("nx", 1001))


def make_adapters():
    """The two adapter classes (built on call: they subclass PyMGRIT's ``Application``, an
    optional dependency -- the ``dev`` extra -- imported only when the benchmark runs)."""
    _pymgrit()  # PyMGRIT 1.0.6 with NumPy's in1d restored
    from pymgrit.core.application import Application  # optional dependency (see above)

    class PyMGRITProblem(Propagator):
        """PyMGRIT's application (its ``step`` and vector class) as our ``Propagator``."""

        def __init__(self, apps):
            self.apps, self.t = apps, apps[0].t
            v = apps[0].vector_t_start
            self.scalar = hasattr(v, "value")
            self.state_shape = () if self.scalar else (len(v.get_values()),)

        def _vec(self, u):
            v = self.apps[0].vector_template.clone_zero()
            v.set_values(float(u) if self.scalar else u.numpy())
            return v

        def initial_value(self):
            return torch.as_tensor(np.asarray(self.apps[0].vector_t_start.get_values(), dtype=np.float64))

        def step(self, u, start, stop, level=0):
            out = self.apps[0].step(self._vec(u), float(self.t[start]), float(self.t[stop]))
            return torch.as_tensor(np.asarray(out.get_values(), dtype=np.float64))

    class OurProblemApp(Application):
        """Our propagator as a PyMGRIT application on the time points ``t_interval``."""

        def __init__(self, prop, template, t_interval):
            super().__init__(t_interval=t_interval)
            self.prop, self.index = prop, {float(t): i for i, t in enumerate(prop.t)}
            self.vector_template = template.clone_zero()
            self.vector_t_start = template.clone()
            self.scalar = hasattr(template, "value")

        def step(self, u_start, t_start, t_stop):
            u = torch.as_tensor(np.asarray(u_start.get_values(), dtype=np.float64))
            out = self.prop.step(u, self.index[float(t_start)], self.index[float(t_stop)], 0)
            v = self.vector_template.clone_zero()
            v.set_values(float(out) if self.scalar else out.numpy())
            return v

    return PyMGRITProblem, OurProblemApp


def run(c, comm, solver, problem):
    """One solve; returns (iterations, residual history, seconds = max over ranks)."""
    Mgrit = _pymgrit()[0]
    PyMGRITProblem, OurProblemApp = make_adapters()
    comm.Barrier()
    t0 = time.perf_counter()
    if solver == "ours":
        prop = our_problem(c) if problem == "ours" else PyMGRITProblem(pymgrit_apps(c))
        n = c["nt"] - 1
        opts = MGRITOptions(max_levels=len(c["cfactors"]) + 1, cfactor=list(c["cfactors"]),
                            min_coarse=1, relax="FCF", cycle=c["cycle"],
                            nested_iteration=c["nested"], tol=c["tol"], max_iter=100)
        s = MGRIT(prop, n_intervals=n, state_shape=prop.state_shape, dtype=torch.float64,
                  options=opts, comm=comm)
        res = s.solve(prop.initial_value() if comm.Get_rank() == 0 else None)
        its, hist = res.iterations, [float(r) for r in res.residuals if r != 0.0]
    else:
        apps = pymgrit_apps(c)
        if problem == "ours":
            prop, t = our_problem(c), apps[0].t
            start = apps[0].vector_t_start
            apps = []
            for lvl in range(len(c["cfactors"]) + 1):
                apps.append(OurProblemApp(prop, start, t))
                if lvl < len(c["cfactors"]):
                    t = t[::c["cfactors"][lvl]]
        m = Mgrit(problem=apps, cf_iter=1, cycle_type=c["cycle"], nested_iteration=c["nested"],
                  tol=c["tol"], max_iter=100, logging_lvl=logging.WARNING, comm_time=comm)
        info = m.solve()
        its, hist = m.solve_iter, [float(v) for v in info["conv"]]
    return its, hist, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def step_speed(c, repeat):
    """Microseconds per fine step of a serial sweep: each implementation natively and through
    its adapter (rank 0, no solver)."""
    PyMGRITProblem, OurProblemApp = make_adapters()
    ours, apps = our_problem(c), pymgrit_apps(c)
    app, t, n = apps[0], apps[0].t, c["nt"] - 1
    wrapped_theirs = PyMGRITProblem(apps)
    wrapped_ours = OurProblemApp(ours, app.vector_t_start, t)

    def sweep_torch(p):
        u = ours.initial_value()
        for i in range(n):
            u = p.step(u, i, i + 1, 0)

    def sweep_app(a):
        v = app.vector_t_start.clone()
        for i in range(n):
            v = a.step(v, float(t[i]), float(t[i + 1]))

    fns = {"ours (native)": lambda: sweep_torch(ours),
           "PyMGRIT (native)": lambda: sweep_app(app),
           "ours via adapter (PyMGRIT vectors)": lambda: sweep_app(wrapped_ours),
           "PyMGRIT via adapter (torch tensors)": lambda: sweep_torch(wrapped_theirs)}
    out = {}
    with torch.no_grad():
        for k, f in fns.items():
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                f()
                best = min(best, time.perf_counter() - t0)
            out[k] = 1e6 * best / n
    return out


def worker(args) -> None:
    comm = MPI.COMM_WORLD
    out = {}
    for name, c in cases(args.nt, args.nx).items():
        if args.cases and name not in args.cases:
            continue
        r = {}
        for sv in SOLVERS:
            for pb in PROBLEMS:
                runs = [run(c, comm, sv, pb) for _ in range(args.repeat)]
                r[f"{sv}/{pb}"] = dict(iterations=runs[0][0], history=runs[0][1],
                                       time=min(x[2] for x in runs))
        if comm.Get_rank() == 0 and comm.Get_size() == 1:
            r["steps_us"] = step_speed(c, args.repeat)
        out[name] = r
    if comm.Get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(out))


def launch(nprocs: int, args) -> dict:
    mpiexec = os.environ.get("LAYERPAR_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    out = Path(args.out).with_suffix(f".P{nprocs}.json")
    cmd = [mpiexec, "-n", str(nprocs), sys.executable, "-m", "mpi4py", str(Path(__file__)),
           "--worker", "--worker-out", str(out), "--nt", str(args.nt), "--nx", str(args.nx),
           "--repeat", str(args.repeat)] + (["--cases", *args.cases] if args.cases else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=3600)
    data = json.loads(out.read_text())
    out.unlink()
    return data


def rel_diff(a, b):
    if len(a) != len(b):
        return float("nan")
    return max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=0.0)


def write_report(path: Path, results: dict, meta: dict) -> None:
    """The markdown table (and ``<stem>.h5``) from the workers' results."""
    rows, steps, series = [], [], {}
    for p, data in results.items():
        for name, r in data.items():
            ref = r["pymgrit/pymgrit"]
            cells = {k: r[f"{k}"] for k in (f"{s}/{q}" for s in SOLVERS for q in PROBLEMS)}
            diff = max(rel_diff(v["history"], ref["history"]) for v in cells.values())
            its = "/".join(str(v["iterations"]) for v in cells.values())
            t = {k: v["time"] for k, v in cells.items()}
            rows.append([name, p, its, f"{ref['history'][-1]:.6e}", f"{diff:.1e}",
                         f"{t['ours/ours']:.3f}", f"{t['pymgrit/ours']:.3f}",
                         f"{t['pymgrit/ours'] / t['ours/ours']:.2f}x",
                         f"{t['ours/pymgrit']:.3f}", f"{t['pymgrit/pymgrit']:.3f}",
                         f"{t['pymgrit/pymgrit'] / t['ours/pymgrit']:.2f}x",
                         f"{t['pymgrit/pymgrit'] / t['ours/ours']:.2f}x"])
            for k, v in t.items():
                series[f"P{p}/{name}/time/{k}"] = [v]
            series[f"P{p}/{name}/max_rel_history_diff"] = [diff]
            if "steps_us" in r:
                steps.append([name] + [f"{v:.2f}" for v in r["steps_us"].values()])
                hdr = list(r["steps_us"])
                for k, v in r["steps_us"].items():
                    series[f"P{p}/{name}/step_us/{k}"] = [v]
    body = ["## Solver vs solver on the same problem code (setup + solve, s)", "",
            "iterations: ours+ours / ours+PyMGRIT's problem / PyMGRIT+ours / PyMGRIT+PyMGRIT's "
            "(solver+problem); history diff = largest relative difference of any combination's "
            "residual history from PyMGRIT's own run. Solver ratio = PyMGRIT solver time / our "
            "solver time with the same problem code; the last column is the old, mixed "
            "comparison (each package with its own problem code).", "",
            reporting.markdown_table(
                ["case", "ranks", "iterations", "final residual", "history diff",
                 "ours, our problem", "PyMGRIT, our problem", "solver ratio (our problem)",
                 "ours, PyMGRIT problem", "PyMGRIT, PyMGRIT problem",
                 "solver ratio (PyMGRIT problem)", "mixed ratio"], rows), ""]
    if steps:
        body += ["## Problem implementations apart: serial sweep of the fine steps (us per step, "
                 "best of repeats, 1 rank, no solver)", "",
                 "The adapter rows include the torch <-> PyMGRIT vector conversion that the "
                 "same-problem solver columns above pay on the adapted side.", "",
                 reporting.markdown_table(["case"] + hdr, steps)]
    reporting.write_table(path, "Our MGRIT vs PyMGRIT 1.0.6", meta, "\n".join(body))
    head = [{"claim": "our solver vs PyMGRIT 1.0.6's on the same problem code (same iterations "
                      "and residual histories)",
             "ours": "; ".join(f"{r[0]} P={r[1]}: {r[7]} (our problem code), {r[10]} (PyMGRIT's)"
                               for r in rows) + f" (load {meta['loadavg']})",
             "kind": "timing"}]
    write_headline(path.with_suffix(".headline.json"), head, [meta])
    reporting.save_series(path.with_suffix(".h5"), series,
                          {k: v for k, v in meta.items() if isinstance(v, (int, float, str))})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the cases and timing rules.")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts (default 1 2)")
    ap.add_argument("--nt", type=int, default=16385, help="Dahlquist time points (default 16385)")
    ap.add_argument("--nx", type=int, default=1001, help="heat grid points (default 1001)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per combination, best kept")
    ap.add_argument("--cases", nargs="*", default=None, help="subset of case names")
    ap.add_argument("--quick", "--smoke", action="store_true",
                    help="CI smoke: nt = 257, nx = 101, 1 repeat")
    ap.add_argument("--out", default=str(OUT / "bench_pymgrit.md"),
                    help="markdown table to write (an .h5 with the numbers goes beside it)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.nt, args.nx, args.repeat = 257, 101, 1
    if args.worker:
        worker(args)
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = reporting.run_metadata()
    meta["timing"] = (f"setup + solve (incl. nested iteration), max over ranks, best of "
                      f"{args.repeat}; OMP_NUM_THREADS=1; mpiexec -n P python -m mpi4py")
    meta["cases"] = (f"FCF, cfactor 2; Dahlquist nt={args.nt} on [0,5] BE V-cycle nested tol 1e-10; "
                     f"heat nx={args.nx} nt=65 5 levels F-cycle tol 1e-7")
    results = {p: launch(p, args) for p in args.ranks}
    meta["loadavg_after"] = reporting.run_metadata()["loadavg"]
    write_report(Path(args.out), results, meta)
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
