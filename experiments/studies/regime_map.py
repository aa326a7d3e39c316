"""Study: the regime map -- where the MGRIT training step wins or loses against the strongest
baseline on the same 2 ranks, over depth x width (issue 34, item 2).

Launch (2 ranks)::

    mpiexec -n 2 python -m mpi4py experiments/studies/regime_map.py --full
    mpiexec -n 2 python -m mpi4py experiments/studies/regime_map.py --smoke --out /tmp/x

Cells: dense tanh ResNets (``T = 1``, float32, batch 64, loss ``mean(out^2)``, momentum SGD lr
1e-3 momentum 0.9 for every option), ``N`` in {64, 256, 1024, 4096} x width in {4, 8, 32, 128}
(``--smoke``: N = 32 x width in {4, 8}, 2 repeats, GPipe and ZBV with M in {2, 4}). Options per cell:

* serial on rank 0 (rank 1 idle): ``lean`` (:class:`~experiments.benchmarks.strong_baselines.
  LeanOptim`) and ``compiled lean`` (blocks of 16 layers);
* data parallel on lean replicas (one ``Allreduce`` of the stacked gradient): ``lean DP``;
* ``pipeline``: ``torch.distributed.pipelining`` over gloo (GPipe, 1F1B, interleaved zero
  bubble, ZBV) with M in {2, 4, 8}: the schedule and M with the lowest pilot step (one timed
  step after one warm-up step each)
  (every candidate's time reported);
* ``MGRIT``: :class:`mgrit.nn.LayerParallelResNet`, 2 levels, F-relaxation, 2 forward / 1
  adjoint cycles (inexact), warm start; coarsening factor m in {16, 64} (those dividing N with
  N / m >= 2) chosen on the same kind of pilot steps (separate from the timed repeats).

Timing (:mod:`experiments.measure`): ``--reps`` interleaved repeats (rotated order, one untimed
warm-up step before every timed one), per repeat the wall time and the process CPU time, each
the max over the ranks (the slowest rank; serial options: rank 0). The strongest baseline of a
cell: the baseline with the lowest median wall time. Speed-up of MGRIT = baseline / MGRIT per
paired repeat, median and 95% paired log-ratio interval (wall and CPU). One fresh inductor
cache for the run, dynamo reset per cell (compilation never inside a timed step). Load gate per
cell: a cell whose 1-minute load exceeded 2.5 is marked unreliable and gets no verdict.

Verdict declared before the run (:data:`DECLARED`): per cell, MGRIT faster than the strongest
baseline when the speed-up interval's lower end is above 1 (wall; CPU reported beside).

Output (``experiments/results/studies/regime_map/``): ``table.md``, ``results.json``,
``regime_map.png``, ``declared.json``, ``headline.json``.

Cost (measured at load 6-27 on 2 shared cores; CPU time per rank is the quiet estimate):
``--smoke`` 442 s wall, about 1 min CPU per rank; the cell N = 4096, width 128 alone with 1
repeat 748 s wall, 2.6 min CPU per rank (steps: lean 0.8 s, MGRIT 1.6 s CPU). ``--full`` with 5
repeats: estimated 9-12 min on 2 quiet cores, a third of it that cell; ``--reps 3`` or
``--schedules GPipe 1F1B ZBV`` to shorten.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from experiments import measure  # noqa: E402
from experiments.benchmarks import torch_pipeline as tp  # noqa: E402
from experiments.benchmarks.strong_baselines import LeanDataParallel, LeanOptim  # noqa: E402
from experiments.reports import regime_map_report as rep  # noqa: E402
from experiments.verdicts import Comparison, Declaration  # noqa: E402
from mgrit.nn import DenseStep, LayerParallelResNet  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.perf.lean import LeanResNet  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402

STUDY = "regime_map"
OUT = os.path.join(ROOT, "experiments", "results", "studies")
BATCH, LR, MOMENTUM, BLOCK = 64, 1e-3, 0.9, 16
FULL = dict(Ns=(64, 256, 1024, 4096), widths=(4, 8, 32, 128), reps=5, micro=(2, 4, 8),
            schedules=tuple(tp.SCHEDULES))
SMOKE = dict(Ns=(32,), widths=(4, 8), reps=2, micro=(2, 4), schedules=("GPipe", "ZBV"))
MS = (16, 64)
BASELINES = ("lean", "compiled lean", "lean DP", "pipeline")
DECLARED = Declaration(
    "experiments/studies/regime_map.py",
    Comparison("regime cell, wall", "MGRIT", "strongest baseline",
               "wall time per step (max over ranks)", "faster", 1.0,
               candidates=len(MS), chosen_on="validation"),
    Comparison("regime cell, CPU", "MGRIT", "strongest baseline",
               "process CPU time per step (max over ranks)", "faster", 1.0,
               candidates=len(MS), chosen_on="validation"))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    reporting.add_study_flags(p, "the record: 4 x 4 cells (the default)",
                              "2 x 2 tiny cells, 2 repeats")
    p.add_argument("--reps", type=int, default=None, help="interleaved repeats (full: 5)")
    p.add_argument("--schedules", nargs="+", choices=tuple(tp.SCHEDULES), default=None,
                   help="pipelining schedules tried (full: all four; smoke: GPipe, ZBV)")
    p.add_argument("--no-compile", action="store_true", help="leave out compiled lean")
    p.add_argument("--Ns", type=int, nargs="+", default=None, help="depths (override)")
    p.add_argument("--widths", type=int, nargs="+", default=None, help="widths (override)")
    a = p.parse_args(argv)
    s = dict(SMOKE if a.smoke else FULL)
    if a.reps is not None:
        s["reps"] = a.reps
    for k in ("Ns", "widths"):
        if getattr(a, k) is not None:
            s[k] = tuple(getattr(a, k))
    if a.schedules is not None:
        s["schedules"] = tuple(a.schedules)
    a.settings = s
    return a


def mgrit_net(N, w, m, comm):
    def o(it):
        return MGRITOptions(max_levels=2, cfactor=m, tol=0, max_iter=it, relax="F")
    return LayerParallelResNet.build(lambda k: DenseStep(w, "tanh"), N, (w,), comm=comm,
                                     forward=o(2), backward=o(1))


class MGRITStep:
    def __init__(self, lp, x):
        self.lp, self.x = lp, x
        self.opt = torch.optim.SGD(lp.parameters(), lr=LR, momentum=MOMENTUM, foreach=True)

    def __call__(self):
        lp = self.lp
        self.opt.zero_grad(set_to_none=True)
        out = lp(self.x if lp.is_first else None, batch_size=BATCH)
        ((out ** 2).mean() if lp.is_last else out.sum()).backward()
        self.opt.step()


def pilot(make, candidates, comm, steps=1):
    """``(best, fn, {candidate: median wall s or error})``: one untimed and ``steps`` timed
    steps of each candidate (max over the ranks), the fastest median wins."""
    times, built = {}, {}
    for c in candidates:
        try:
            fn, err = make(c), None
        except (ValueError, RuntimeError) as e:
            fn, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
        errs = [e for e in comm.allgather(err) if e]
        if errs:
            times[c] = errs[0]
            continue
        fn()
        ts = sorted(measure.clock(fn, comm)[0] for _ in range(steps))
        times[c], built[c] = ts[len(ts) // 2], fn
    ok = {c: t for c, t in times.items() if not isinstance(t, str)}
    if not ok:
        raise RuntimeError(f"no candidate ran: {times}")
    best = min(ok, key=ok.get)
    return best, built[best], times


def cell(N, w, a, comm):
    """Every option of one cell, timed; ``dict`` for the report (every rank)."""
    rank = comm.Get_rank()
    torch._dynamo.reset()
    gate = measure.LoadGate(comm.Get_size())
    torch.manual_seed(N * 1000 + w)
    x = torch.randn(BATCH, w)
    notes = {}
    ms = [m for m in MS if N % m == 0 and N // m >= 2]
    m_best, mg, m_times = pilot(lambda m: MGRITStep(mgrit_net(N, w, m, comm), x), ms, comm)
    W0 = LeanResNet.from_sequential(mg.lp.to_serial())  # collective; the same weights
    W, b = W0.weights()

    def lean():
        return LeanResNet(W, b, W0.h)
    timers = {}
    if rank == 0:
        serial = LeanOptim(lean(), "sgd", LR, MOMENTUM)
        timers["lean"] = lambda: serial.step(x)
    else:
        timers["lean"] = lambda: None
    if not a.no_compile and N % BLOCK == 0:
        comp, notes["compiled lean"] = (LeanOptim.try_compiled(lean(), x, kind="sgd", lr=LR,
                                                               momentum=MOMENTUM, block=BLOCK)
                                        if rank == 0 else (None, ""))
        ok = comm.bcast(comp is not None, root=0)
        if ok:
            timers["compiled lean"] = (lambda: comp.step(x)) if rank == 0 else (lambda: None)
    dp = LeanDataParallel(lean(), comm, BATCH, "sgd", LR, MOMENTUM)
    timers["lean DP"] = lambda: dp.step(x)
    cands = [(s, M) for s in a.settings["schedules"] for M in a.settings["micro"]]

    def make_pipe(c):
        p = tp.TorchPipeline(lean(), comm, c[0], c[1], BATCH, "sgd", LR, MOMENTUM)
        return lambda: p.step(x)
    p_best, pipe, p_times = pilot(make_pipe, cands, comm)
    timers["pipeline"] = pipe
    timers["MGRIT"] = mg
    gate.sample()
    raw = measure.interleave(timers, a.settings["reps"], comm)
    gate.sample()
    return {"N": N, "width": w, "raw": raw, "gate": gate.result(), "notes": notes,
            "mgrit_m": m_best, "mgrit_m_pilot": m_times,
            "pipeline": f"{p_best[0]} M={p_best[1]}",
            "pipeline_pilot": {f"{s} M={M}": t for (s, M), t in p_times.items()}}


def main(argv=None) -> int:
    world = MPI.COMM_WORLD
    a = parse(argv)
    if world.Get_size() != 2:
        if world.Get_rank() == 0:
            print(f"regime_map.py needs 2 ranks (mpiexec -n 2), got {world.Get_size()}",
                  file=sys.stderr, flush=True)
        return 2
    ok, why = tp.available()
    if not ok:
        raise SystemExit(f"torch.distributed.pipelining is not usable here: {why}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    out_dir = reporting.results_dir(STUDY, a.out or OUT) if world.Get_rank() == 0 else None
    DECLARED.freeze(out_dir)  # the verdicts, fixed before the first measurement
    meta = reporting.run_metadata(world_size=world.Get_size())
    t0 = time.perf_counter()
    cells = []
    with measure.compile_cache("fresh"):
        for N in a.settings["Ns"]:
            for w in a.settings["widths"]:
                c = cell(N, w, a, world)
                cells.append(c)
                if world.Get_rank() == 0:
                    print(rep.progress(c), flush=True)
    if world.Get_rank() == 0:
        res = {"settings": {k: list(v) if isinstance(v, tuple) else v
                            for k, v in a.settings.items()},
               "batch": BATCH, "lr": LR, "momentum": MOMENTUM, "block": BLOCK,
               "baselines": BASELINES, "ms": MS,
               "declared": DECLARED.as_dict(), "cells": cells,
               "seconds": time.perf_counter() - t0}
        rep.write(res, reporting.finish_metadata(meta), out_dir, DECLARED)
        print(f"[{STUDY}] wrote {out_dir} in {res['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
