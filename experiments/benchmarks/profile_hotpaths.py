"""Measurements behind the solver's fast paths (issue 14, targets T1-T3): interleaved A/B
repeats, medians of per-repeat ratios, one thread per process.

Network: dense tanh ResNet (``DenseStep``, width 8, batch 64, float32, T = 1), loss
``mean(out^2)``, SGD. Parts:

* ``t1`` -- one training step (zero_grad, forward, loss, backward, SGD step) of the 1-level exact
  path (``max_levels=1`` forward and backward) against serial ``nn.Sequential`` autograd, on
  one process (CPU time) or, under ``mpiexec -n 2``, on two ranks (``--clock`` wall or cpu,
  max over ranks; the serial step runs on rank 0 while rank 1 waits in a barrier).
* ``t2`` -- the single-process forward: batched MGRIT (2 levels, m = 64, F-relaxation, 2 cycles,
  tol 0, cold start) against the lean serial loop with in-place ops (``LeanResNet``; written
  here when ``mgrit.perf.lean`` is absent), and the bound: one batched step over ``N / m``
  intervals and one single step, timed alone, weighted with the solve's call counts.
* ``t3`` -- under ``mpiexec -n 2``: the MGRIT training step (2 levels, m = 64, F, 2 forward / 1
  adjoint cycles, warm start) on 2 ranks against the lean training step on rank 0 alone (rank 1
  waits in a barrier); ``--clock`` as t1; ``--profile`` adds a cProfile (CPU time) of rank 0.

Usage::

    OMP_NUM_THREADS=1 python experiments/benchmarks/profile_hotpaths.py t2 --layers 4096 --repeats 9
    OMP_NUM_THREADS=1 python experiments/benchmarks/profile_hotpaths.py t1 --layers 1024
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py experiments/benchmarks/profile_hotpaths.py t3 --layers 4096

Prints one line per quantity: median, min-max range of the per-repeat ratios. Not a benchmark
of record (``experiments/benchmarks/bench_layerparallel.py`` is); a tool for the solver's overheads.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
from mgrit.nn import DenseStep, LayerParallelResNet, serial_resnet  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.perf.lean import LeanResNet  # noqa: E402

WIDTH, BATCH, LR = 8, 64, 1e-3
med = statistics.median


def make_lp(N, comm, levels, m=64, kf=2, kb=1):
    if levels == 1:
        fo = bo = MGRITOptions(max_levels=1)
    else:
        fo, bo = (MGRITOptions(max_levels=levels, cfactor=m, tol=0, max_iter=k, relax="F")
                  for k in (kf, kb))
    return LayerParallelResNet.build(lambda k: DenseStep(WIDTH, "tanh"), N, (WIDTH,), comm=comm,
                                     forward=fo, backward=bo)


def lp_step(lp, x, opt):
    opt.zero_grad(set_to_none=True)
    out = lp(x if lp.is_first else None, batch_size=BATCH)
    ((out ** 2).mean() if lp.is_last else out.sum()).backward()
    opt.step()


def seq_step(net, x, opt):
    opt.zero_grad(set_to_none=True)
    (net(x) ** 2).mean().backward()
    opt.step()


def summary(name, base, other):
    """``base / other`` per repeat (speed of ``other`` relative to ``base``): median, range."""
    r = [b / o for b, o in zip(base, other)]
    print(f"{name}: {med(other) * 1e3:.2f} ms vs {med(base) * 1e3:.2f} ms; ratio base/this "
          f"median {med(r):.3f} range {min(r):.3f}-{max(r):.3f} ({len(r)} repeats)", flush=True)
    return med(r)


def cpu_timed(fn):
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def rank_timed(comm, fn, clock):
    """Seconds of ``fn`` on every rank after a barrier, max over ranks; ``clock``
    ``time.perf_counter`` (wall) or ``time.process_time`` (CPU time: MPICH busy-polls while
    a rank waits, so waiting counts, but other processes' load on the cores does not)."""
    comm.Barrier()
    t0 = clock()
    fn()
    t = clock() - t0
    return comm.allreduce(t, op=MPI.MAX)


def t1(a, comm):
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    net = serial_resnet(lambda k: DenseStep(WIDTH, "tanh"), a.layers)
    lp = make_lp(a.layers, comm, 1)
    o_s, o_l = torch.optim.SGD(net.parameters(), LR), torch.optim.SGD(lp.parameters(), LR)
    P = comm.Get_size()
    serial = (lambda: seq_step(net, x, o_s)) if comm.Get_rank() == 0 else (lambda: None)
    timed = cpu_timed if P == 1 else (lambda fn: rank_timed(comm, fn, a.clock))
    for fn in (serial, lambda: lp_step(lp, x, o_l)):
        fn()
    ts, tl = [], []
    for _ in range(a.repeats):
        ts.append(timed(serial))
        tl.append(timed(lambda: lp_step(lp, x, o_l)))
    if comm.Get_rank() == 0:
        summary(f"T1 N={a.layers} P={P}: exact 1-level step vs nn.Sequential step", ts, tl)


def batched_step_cost(N, m, reps):
    """Seconds of one batched step over ``N / m`` intervals (bmm with contiguous transposed
    weights, bias, tanh, add into the strided target rows: the in-place kernels the solver's
    F-relaxation uses), cycling through the ``m - 1`` row offsets of one ``(N + 1)``-state array
    as F-relaxation does (``hot``: always the same rows, all in cache), and of one lean single
    step (addmm, tanh_, add_)."""
    u = torch.randn(N + 1, BATCH, WIDTH)
    WT = torch.randn(N, WIDTH, WIDTH).transpose(1, 2).contiguous()
    b = torch.randn(N, WIDTH)
    z = torch.empty(N // m, BATCH, WIDTH)
    x1, z1 = torch.randn(BATCH, WIDTH), torch.empty(BATCH, WIDTH)

    def batched(k):
        src, tgt = u[k - 1:N:m], u[k:N + 1:m]
        torch.bmm(src, WT[k - 1:N:m], out=z)
        z.add_(b[k - 1:N:m].unsqueeze(1))
        z.tanh_()
        torch.add(src, z, alpha=1.0 / N, out=tgt)

    def single():
        torch.addmm(b[3], x1, WT[3], out=z1)
        z1.tanh_()
        x1.add_(z1, alpha=1.0 / N)

    cycle = [1 + i % (m - 1) for i in range(reps)]
    fns = {"rows": (lambda: [batched(k) for k in cycle], reps),
           "hot": (lambda: [batched(1) for _ in cycle], reps),
           "single": (lambda: [single() for _ in range(reps * 20)], reps * 20)}
    out = {}
    for name, (fn, n) in fns.items():
        fn()
        out[name] = med([cpu_timed(fn) / n for _ in range(5)])
    return out


def t2(a, comm):
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    N = a.layers
    net = serial_resnet(lambda k: DenseStep(WIDTH, "tanh"), N)
    lean = LeanResNet.from_sequential(net)
    lp = make_lp(N, comm, 2, a.m)
    lp.warm_start = False

    def mgrit():
        with torch.no_grad():
            lp(x)
    for fn in (mgrit, lambda: lean.forward(x)):
        fn()
    tl, tm = [], []
    for _ in range(a.repeats):
        tl.append(cpu_timed(lambda: lean.forward(x)))
        tm.append(cpu_timed(mgrit))
    with torch.no_grad():
        err = float((lp(x) - net(x)).norm() / net(x).norm())
    s = lp.last_forward.stats
    r = summary(f"T2 N={N} m={a.m}: MGRIT forward (2 levels, F, 2 cycles) vs lean loop", tl, tm)
    c = batched_step_cost(N, a.m, 63)
    t1_ = c["single"]
    bounds = {k: N * t1_ / (s.steps_batched_calls * c[k] + s.steps_single * t1_)
              for k in ("rows", "hot")}
    work = s.steps_batched_calls * c["rows"] + s.steps_single * t1_
    print(f"   calls: {s.steps_batched_calls} batched ({s.steps_batched_items} items), "
          f"{s.steps_single} single; one batched step over {N // a.m} intervals "
          f"{c['rows'] * 1e6:.1f} us = {c['rows'] / t1_:.1f} single steps ({t1_ * 1e6:.2f} us; "
          f"hot rows: {c['hot'] * 1e6:.1f} us = {c['hot'] / t1_:.1f}); bound lean/MGRIT = "
          f"{bounds['rows']:.3f} (hot: {bounds['hot']:.3f}); kernels alone {work * 1e3:.2f} ms, "
          f"solve {med(tm) * 1e3:.2f} ms; ratio/bound {r / bounds['rows']:.3f}; rel. error vs "
          f"serial {err:.2e}", flush=True)


def t3(a, comm):
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    N = a.layers
    net = serial_resnet(lambda k: DenseStep(WIDTH, "tanh"), N)
    lean = LeanResNet.from_sequential(net) if comm.Get_rank() == 0 else None
    lp = make_lp(N, comm, 2, a.m)
    opt = torch.optim.SGD(lp.parameters(), LR)
    lean_step = (lambda: lean.train_step(x, LR)) if lean is not None else (lambda: None)
    for fn in (lean_step, lambda: lp_step(lp, x, opt)):
        fn()
    tl, tm = [], []
    for _ in range(a.repeats):
        tl.append(rank_timed(comm, lean_step, a.clock))
        tm.append(rank_timed(comm, lambda: lp_step(lp, x, opt), a.clock))
    if comm.Get_rank() == 0:
        summary(f"T3 N={N} m={a.m} P={comm.Get_size()}: MGRIT training step vs lean step on "
                f"one rank", tl, tm)
    if a.profile:
        pr = cProfile.Profile(time.process_time)
        pr.enable()
        for _ in range(3):
            lp_step(lp, x, opt)
        pr.disable()
        if comm.Get_rank() == 0:
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=("t1", "t2", "t3"))
    ap.add_argument("--layers", type=int, default=None, help="N (t1: 1024, t2/t3: 4096)")
    ap.add_argument("--m", type=int, default=64, help="coarsening factor (t2, t3)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--profile", action="store_true", help="t3: cProfile of rank 0")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="2-rank parts: wall clock or CPU time, max over ranks (default wall)")
    a = ap.parse_args()
    a.clock = time.perf_counter if a.clock == "wall" else time.process_time
    a.layers = a.layers or (1024 if a.part == "t1" else 4096)
    torch.set_num_threads(1)
    {"t1": t1, "t2": t2, "t3": t3}[a.part](a, MPI.COMM_WORLD)


if __name__ == "__main__":
    main()
