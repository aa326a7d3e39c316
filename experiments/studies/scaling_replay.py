"""Scaling by trace replay (issue 24, item 5): record a layer-parallel ResNet's training step
(MGRIT forward + adjoint MGRIT) at P = 1, 2, 4, 8, 16 ranks and replay each trace.

This machine has 2 cores: runs on more ranks are oversubscribed, so their wall clocks are not
times of dedicated cores; their traces (the operations, their order and the messages) are what
the real code did at that P. Each trace is replayed (:func:`mgrit.perf.trace.replay`) with

* unit costs (``tau = 1``, free messages), beside :func:`mgrit.perf.model.simulate`'s critical
  path for the same N, P and options (the cost model's prediction; they should agree);
* step costs fitted to the P = 1 trace's recorded steps (:func:`mgrit.perf.trace.step_costs`,
  forward and adjoint separately; modeled) and the ping-pong of the P = 2 run
  (:func:`mgrit.perf.model.pingpong`), beside the recorded wall clock (measured; meaningful at
  P <= 2 only, where the replay's error is stated), and replayed once more with each step's
  recorded duration and the recorded host time between events (at P = 1 that is the wall
  clock by construction; at P = 2 the difference is the error of the message costs).

Launch (plain python; it starts its own ``mpiexec`` jobs)::

    python experiments/studies/scaling_replay.py                  # N = 64, P = 1..16
    python experiments/studies/scaling_replay.py --smoke --out /tmp/x   # N = 16, P = 1, 2, 4 (seconds)

Writes ``<out>/scaling_replay/scaling_replay.md`` and the traces (``trace_P{P}.json``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, ROOT)

from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.perf.model import CommCost, simulate  # noqa: E402
from mgrit.perf.trace import UNIT, Trace, replay, step_costs  # noqa: E402
from mgrit.training import report as reporting  # noqa: E402

STUDY = "scaling_replay"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    reporting.add_study_flags(p, "the same as the default (N = 64, P up to 16)",
                              "N = 16, P = 1, 2, 4 (seconds)")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="P values (1 and 2 needed)")
    p.add_argument("--layers", type=int, default=None, help="N (default 64; smoke 16)")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cfactor", type=int, default=4)
    p.add_argument("--iters", type=int, default=2, help="forward cycles (adjoint: 1)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per mpiexec job")
    a = p.parse_args(argv)
    a.ranks = a.ranks or ([1, 2, 4] if a.smoke else [1, 2, 4, 8, 16])
    a.layers = a.layers or (16 if a.smoke else 64)
    if 1 not in a.ranks or 2 not in a.ranks:
        p.error("--ranks must include 1 (the step costs) and 2 (the ping-pong)")
    return a


def _mpiexec() -> str:
    env = os.environ.get("LAYERPAR_MPIEXEC")
    venv = Path(sys.executable).parent / "mpiexec"
    return env or (str(venv) if venv.exists() else "mpiexec")


def record(P: int, a, out: Path) -> Trace:
    """One mpiexec job of ``P`` ranks running ``mgrit.perf.trace.resnet``; returns its trace."""
    path = out / f"trace_P{P}.json"
    cmd = [_mpiexec(), "-n", str(P), sys.executable, "-m", "mpi4py", "-m",
           "mgrit.perf.trace.resnet", "--layers", str(a.layers), "--width", str(a.width),
           "--batch", str(a.batch), "--cfactor", str(a.cfactor), "--iters", str(a.iters),
           "--out", str(path)] + (["--pingpong"] if P == 2 else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=a.timeout)
    return Trace.from_json(path)


def main(argv=None) -> int:
    a = parse(argv)
    out = reporting.results_dir(STUDY, a.out or os.path.join(ROOT, "experiments", "results",
                                                            "studies"))
    traces = {P: record(P, a, out) for P in a.ranks}
    fwd = MGRITOptions(max_levels=2, cfactor=a.cfactor, max_iter=a.iters, tol=0.0)
    bwd = MGRITOptions(max_levels=2, cfactor=a.cfactor, max_iter=1, tol=0.0)
    tau = {lab: step_costs(traces[1], 0, lab) for lab in ("forward", "adjoint")}
    pp = traces[2].meta["pingpong"]
    comm = CommCost(pp["latency"], pp["bandwidth"])
    nbytes = a.batch * a.width * 8
    rows = []
    for P, tr in traces.items():
        unit = sum(replay(tr, UNIT, label=lab).critical_path for lab in tau)
        sim_unit = sum(simulate(a.layers, P, o, tau=UNIT, comm=CommCost(0.0, float("inf")))
                       .critical_path for o in (fwd, bwd))
        model = sum(replay(tr, tau[lab], comm, label=lab).critical_path for lab in tau)
        sim = sum(simulate(a.layers, P, o, tau=tau[lab], comm=comm, nbytes=nbytes).critical_path
                  for lab, o in (("forward", fwd), ("adjoint", bwd)))
        host = sum(replay(tr, "recorded", comm, overhead=True, label=lab).critical_path
                   for lab in tau)
        wall = max(tr.wall(r) for r in range(P))
        err = f"{(model - wall) / wall:+.1%}" if P <= 2 else "(oversubscribed)"
        msgs = sum(tr.counts(r)["messages"] for r in range(P))
        rows.append([P, msgs, f"{unit:g}", f"{sim_unit:g}", f"{model * 1e3:.3f}",
                     f"{sim * 1e3:.3f}", f"{host * 1e3:.3f}", f"{wall * 1e3:.3f}", err])
    body = reporting.markdown_table(
        ["P", "messages", "replay, unit costs (steps)", "simulate, unit costs (steps)",
         "replay, fitted costs (ms, modeled)", "simulate, fitted costs (ms, modeled)",
         "replay, recorded step and host times (ms)", "recorded wall (ms, measured)",
         "fitted replay's error vs wall"], rows)
    costs = (f"Step costs fitted to the P = 1 trace: forward {tau['forward']}, adjoint "
             f"{tau['adjoint']}; messages {comm} (ping-pong of the P = 2 run). The fitted "
             f"replay charges the steps, messages and collectives only; the solver's host "
             f"work between them (FAS arithmetic, copies, Python) is what separates it from "
             f"the replay with recorded step and host times, which equals the wall clock at "
             f"P = 1 by construction.")
    meta = reporting.run_metadata(sys.argv[1:] if argv is None else argv)
    reporting.write_table(out / f"{STUDY}.md",
                          f"Trace replay of a dense ResNet training step (N = {a.layers}, width "
                          f"{a.width}, batch {a.batch}, m = {a.cfactor}, {a.iters} forward / 1 "
                          f"adjoint cycles)", meta, body + "\n\n" + costs + "\n")
    print(body)
    print(costs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
