"""Study 1: Kirby et al. 2020 (arXiv 2007.07336, HPEC): two-level FAS-MGRIT forward over the layers
of an MNIST conv ResNet vs layer-wise model parallelism (the blocking chain).

Launch::

    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_kirby.py                 # default
    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_kirby.py --full          # the record
    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_kirby.py --full --part timing
    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_kirby.py --smoke --out /tmp/x

Their setting: opening conv 1->20 channels 7x7, N residual 7x7 conv layers of 20 channels
(x + h ReLU(K x + b), h = 1e-3), closing linear, batch 1, SGD, float32; MGRIT two levels,
m = 64 layers per block, <= 2 iterations (FCF), warm start from the previous sample, serial
backward. Baseline: the same partition as a blocking chain. Claim: 10.2x forward speedup with the
same number of GPUs (blocks of a GPU run concurrently on CUDA streams).

Two parts (``--part``; each replaces only its own group of ``results.h5``, then ``table.md`` and
``summary.md`` are rebuilt from everything stored):

* ``accuracy``: train the same initialization serially and layer-parallel (MGRIT forward with
  2 warm-started FCF iterations, serial backward), batch 1, SGD, for each ``(N, m)`` of
  ``--acc``; the default settings have N/m >= 8 coarse blocks, where 2 iterations are NOT exact.
  Records test accuracy of the serial net, of the MGRIT-trained net evaluated with its inexact
  MGRIT forward and with the exact forward, the relative output error of the MGRIT forward, and
  the forward residuals. Not timing-sensitive: valid on a loaded machine.
* ``timing`` (``kirby_timing``): wall times at P = 1 and the world size, ``--reps`` (``--full``:
  10) interleaved repeats, median with IQR, raw per-repeat numbers in ``timing.raw.json``: the
  forward of MGRIT (batched; looped relaxation up to ``--loop-max`` = 1024, beyond which it is
  4x slower than batched in the earlier records), the blocking chain and, on one rank, plain
  ``nn.Sequential`` and ``torch.compile`` (the strongest baseline is the fastest of these; at
  batch 1 there is no data parallelism); the training step (forward + backward) at
  ``--train-depths`` of the chain, Kirby's own variant (MGRIT forward + serial adjoint, with
  its relative gradient error against exact backprop beside its time), ``nn.Sequential`` and
  compiled. Then ``--calibrations`` (3) calibrations of the CPU model (``mgrit.perf.simulate``
  with step costs measured here and the ping-pong measured here): its predicted/measured ratio
  at every measured point and the min-max over calibrations of every extrapolated number
  (``model_check``; a model off by more than 25% is flagged NOT validated and its
  extrapolations are not results). The *count model* (critical path counted in step
  applications, a batched call over B intervals counted as ONE step, messages free -- no
  measured cost in it; Kirby's CUDA streams in the ideal limit) is written by every run, with
  its error at the measured points. Timing-sensitive: refresh on a quiet machine.

Run time of ``--full`` (both parts): 947 s (16 min) measured at 48a9d82, 2 idle cores
(``results/manifest.json``). ``--smoke`` (eager backend instead of inductor): ~45 s on a loaded
machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "experiments", "results", "reproductions")  # default results base

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

from data import load_dataset  # noqa: E402
from experiments.reproductions import kirby_report, kirby_timing  # noqa: E402
from mgrit import perf  # noqa: E402
from mgrit.nn import ConvStep, LayerParallelNet, LayerParallelResNet, serial_resnet  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402

STUDY = "kirby2020"
PARTS = ("accuracy", "timing")  # plus "count" (the count model), written by every run


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    reporting.add_study_flags(
        p, "the record: timing N = 128..4096, accuracy on 500 samples at N = 512, m = 64 and 16")
    p.add_argument("--part", choices=("all",) + PARTS, default="all")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild table.md, summary.md, plots from results.h5 without running")
    p.add_argument("--channels", type=int, default=4, help="(paper: 20)")
    p.add_argument("--kernel", type=int, default=3, help="(paper: 7)")
    p.add_argument("--h", type=float, default=1e-3, help="step size (paper: 1e-3)")
    p.add_argument("--cfactor", type=int, default=64, help="m of the timing runs (paper: 64)")
    p.add_argument("--iters", type=int, default=2, help="MGRIT forward iterations (paper: <= 2)")
    p.add_argument("--depths", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--reps", type=int, default=3,
                   help="interleaved timed repeats per variant (--full: 10)")
    p.add_argument("--train-depths", type=int, nargs="+", default=[512],
                   help="depths whose training step (Kirby's variant and the baselines) is timed")
    p.add_argument("--loop-max", type=int, default=1024,
                   help="time the looped-relaxation MGRIT forward only up to this depth")
    p.add_argument("--calibrations", type=int, default=3,
                   help="repeated calibrations of the cost model (the extrapolations' spread)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled baseline ('' = none; --smoke: "
                        "eager: dynamo without a compiler, the code path only)")
    p.add_argument("--acc", nargs="+", default=["512:64", "512:16"],
                   help="accuracy runs N:m (N/m >= 8 blocks: 2 iterations are not exact)")
    p.add_argument("--train-samples", type=int, default=200)
    p.add_argument("--test-samples", type=int, default=300)
    p.add_argument("--lr", type=float, default=5e-3, help="SGD learning rate, batch 1")
    p.add_argument("--model-ranks", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.full:
        a.depths = [128, 256, 512, 1024, 2048, 4096]
        a.train_samples, a.test_samples, a.reps = 500, 500, 10
        a.train_depths = [1024, 4096]
    if a.smoke:
        a.cfactor, a.depths, a.reps, a.acc = 4, [16], 2, ["32:4"]
        a.train_depths, a.compile_backend = [16], "eager"
        a.train_samples, a.test_samples, a.model_ranks = 8, 20, 4
    a.acc_runs = []
    for s in a.acc:
        N, m = (int(v) for v in s.split(":"))
        if N < 2 * m or m < 2:
            raise SystemExit(f"--acc {s}: need m >= 2 and N >= 2 m")
        a.acc_runs.append((N, m))
    return a


def cf(args, N):
    """Layers per block: the paper's m, reduced only when N has fewer than 2 blocks."""
    return max(2, min(args.cfactor, N // 2))


def fwd_opts(iters, m, levels=2, batched=True):
    if levels == 1:
        return MGRITOptions(max_levels=1)
    return MGRITOptions(max_levels=2, cfactor=m, tol=0, max_iter=iters, relax="FCF",
                        batched=batched)


def make_step(args):
    return lambda k: ConvStep(args.channels, args.kernel, "relu")


def opening(args):
    return nn.Sequential(nn.Conv2d(1, args.channels, args.kernel, padding=args.kernel // 2), nn.ReLU())


def closing(args):
    return nn.Sequential(nn.Flatten(), nn.Linear(args.channels * 784, 10))


# ------------------------------------------------------------------------------ timing part
def calibrate(args, x):
    """Step cost of the forward chain on this rank (single step and batched over B intervals)."""
    n = 16 if args.smoke else 64
    rn = LayerParallelResNet.build(make_step(args), n, (args.channels, 28, 28), comm=MPI.COMM_SELF,
                                   seed=args.seed, T=n * args.h)
    ch = rn.chain
    ch.refresh()
    sizes = (2, 8, 16) if args.smoke else (2, 8, 32, 64)
    with torch.no_grad():
        U = x.unsqueeze(0).expand(n, *x.shape).contiguous()  # (intervals, batch, C, H, W)
        return perf.calibrate_step(lambda: ch.step(x, 0, 1, 0),
                                   lambda B: ch.step_batch(U[:B], list(range(B)),
                                                           list(range(1, B + 1)), 0),
                                   sizes=sizes, repeats=3, inner=2 if args.smoke else 5)


def count_units(N, P, opts, iters):
    """COUNT MODEL: critical path of the replayed solve in step applications (a single step = 1,
    a batched call over any number of intervals = 1, messages free) -- no measured cost."""
    return perf.simulate(N, P, opts, iterations=iters, batched=True,
                         tau=perf.StepCost(1.0, 1.0, 0.0), comm=perf.CommCost(0.0, 1.0),
                         nbytes=0).critical_path


def model_grid(args):
    """(N, P) pairs of the modeled tables: the measured depths and 256..4096, P = 1, 2, 4, ..."""
    depths = sorted(set(args.depths) | ({256, 512, 1024, 2048, 4096} if not args.smoke else set()))
    ranks = [2 ** k for k in range(20) if 2 ** k <= args.model_ranks]
    return [(N, P) for N in depths for P in ranks if P <= N]


def count_part(args, world):
    """The COUNT MODEL table (deterministic, no measurement; computed on rank 0)."""
    rows = []
    if world.Get_rank() == 0:
        rows = [(N, P, count_units(N, P, fwd_opts(args.iters, cf(args, N)), args.iters))
                for N, P in model_grid(args)]
    series = {"N": [r[0] for r in rows], "P": [r[1] for r in rows],
              "units": [r[2] for r in rows], "speedup": [r[0] / r[2] for r in rows]}
    return series, {"iters": args.iters, "cfactor": args.cfactor}


def timing_part(args, world):
    """Measured forward and training-step times (``kirby_timing.measure``) at P = 1 and the
    world size, the gradient error of Kirby's inexact training variant, ``--calibrations``
    calibrations of the CPU cost model and its predictions on the model grid. The raw
    per-repeat times go to ``timing.raw.json`` beside ``results.h5``."""
    rank, W = world.Get_rank(), world.Get_size()
    tr, _ = load_dataset("mnist5k")
    lift = opening(args)
    n_in = args.reps + 1
    raw = [torch.as_tensor(tr.get_batch(np.array([i]))[0]) for i in range(n_in)]
    lab = [torch.as_tensor(tr.get_batch(np.array([i]))[1], dtype=torch.long) for i in range(n_in)]
    with torch.no_grad():
        xs = [lift(x) for x in raw]
    ctx = types.SimpleNamespace(ARGS=args, make_step=make_step, fwd_opts=fwd_opts, cf=cf,
                                opening=opening, closing=closing, calibrate=calibrate,
                                model_grid=model_grid)
    rows, gerr, samples, notes = [], [], {}, {}
    for P in sorted({1, W}):
        sub = world.Split(0 if rank < P else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            for N in args.depths:
                if N < P or N // cf(args, N) < 2:
                    continue
                got, ge, note = kirby_timing.measure(ctx, sub, N, xs, (raw, lab),
                                                     N in args.train_depths,
                                                     args.compile_backend if P == 1 else "")
                notes.update({f"{k} N={N}": v for k, v in note.items()})
                for k, v in got.items():
                    samples[f"P={P}/N={N}/{k}"] = v
                    sp = reporting.spread(v)
                    rows.append((P, N, kirby_timing.VARIANTS.index(k), sp["median"], sp["q1"],
                                 sp["q3"], sp["min"], sp["max"]))
                if N in args.train_depths:
                    gerr.append((P, N, ge))
            sub.Free()
        world.Barrier()
    # the other ranks' rows (P = 1 ran on rank 0 only): rank 0 holds everything it needs
    taus = kirby_timing.calibrations(ctx, xs[0], args.calibrations) if rank == 0 else None
    taus = world.bcast(taus, root=0)
    measured_comm = perf.pingpong(world)
    comm_cost = measured_comm or perf.CommCost()
    nbytes = args.channels * 784 * 4
    model = kirby_timing.modeled(ctx, taus, comm_cost, nbytes) if rank == 0 else []
    series = {f"meas_{k}": [r[i] for r in rows] for i, k in enumerate(
        ("P", "N", "variant", "median", "q1", "q3", "min", "max"))}
    series.update({f"gerr_{k}": [g[i] for g in gerr] for i, k in enumerate(("P", "N", "value"))})
    series.update({f"model_{k}": [m[i] for m in model] for i, k in enumerate(
        ("cal", "N", "P", "t_chain", "t_mgrit"))})
    extra = {"variants": list(kirby_timing.VARIANTS), "reps": args.reps,
             "step_costs": [{"single": t.single, "call": t.call, "item": t.item} for t in taus],
             "comm_cost": {"latency": comm_cost.latency, "bandwidth": comm_cost.bandwidth,
                           "source": "ping-pong measured here" if measured_comm else
                           "assumed (1 rank: no ping-pong)"},
             "compile": notes, "iters": args.iters, "cfactor": args.cfactor,
             "channels": args.channels, "kernel": args.kernel, "h": args.h,
             "train_depths": args.train_depths, "loop_max": args.loop_max}
    if rank == 0:
        meta = reporting.run_metadata(world_size=W)
        meta.update(extra)
        d = reporting.results_dir(STUDY, args.out or OUT)
        reporting.write_raw(d / "timing.raw.json", samples, meta)
    return series, extra



# ---------------------------------------------------------------------------- accuracy part
def accuracy_run(args, world, tr, te, N, m):
    """Train serial (rank 0) and layer-parallel (all ranks) from the same init and sample order."""
    rank = world.Get_rank()
    order = np.random.default_rng(args.seed).permutation(len(tr))[:args.train_samples]
    Xte = torch.as_tensor(te.x[:args.test_samples])
    Yte = torch.as_tensor(te.y[:args.test_samples], dtype=torch.long)
    out = {}
    if rank == 0:
        torch.manual_seed(args.seed + 1)
        op, cl = opening(args), closing(args)
        net = nn.Sequential(op, *serial_resnet(make_step(args), N, T=N * args.h, seed=args.seed), cl)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        for i in order:
            xb, yb = tr.get_batch(np.array([i]))
            opt.zero_grad()
            nn.functional.cross_entropy(net(torch.as_tensor(xb)),
                                        torch.as_tensor(yb, dtype=torch.long)).backward()
            opt.step()
        with torch.no_grad():
            out["serial_acc"] = float((net(Xte).argmax(1) == Yte).float().mean())
    world.Barrier()
    torch.manual_seed(args.seed + 1)
    op, cl = opening(args), closing(args)
    rn = LayerParallelResNet.build(make_step(args), N, (args.channels, 28, 28), comm=world,
                                   seed=args.seed, T=N * args.h,
                                   forward=fwd_opts(args.iters, m, batched=False), adjoint="serial")
    net = LayerParallelNet(op, rn, cl)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    res = []
    for i in order:
        xb, yb = tr.get_batch(np.array([i]))
        opt.zero_grad()
        net.loss(net(torch.as_tensor(xb)), torch.as_tensor(yb, dtype=torch.long)).backward()
        opt.step()
        r = rn.last_forward.residuals
        res.append(r[-1] if r else float("nan"))
    with torch.no_grad():
        o = net(Xte)  # inexact MGRIT forward (2 iterations), as in training
        acc = float((o.argmax(1) == Yte).float().mean()) if net.is_last else None
        o_exact = net.to_serial()(Xte)
        err = float((o - o_exact).norm() / o_exact.norm()) if net.is_last else None
    out.update(parallel_acc_mgrit=net.from_last(acc),
               parallel_acc_exact=float((o_exact.argmax(1) == Yte).float().mean()),
               rel_output_error=net.from_last(err),
               residual_median=float(np.median(res[len(res) // 2:])),
               residual_max=float(np.max(res)))
    return out


def accuracy_part(args, world):
    tr, te = load_dataset("mnist5k")
    runs = [accuracy_run(args, world, tr, te, N, m) for N, m in args.acc_runs]
    keys = ("serial_acc", "parallel_acc_mgrit", "parallel_acc_exact", "rel_output_error",
            "residual_median", "residual_max")
    series = {"N": [N for N, _ in args.acc_runs], "m": [m for _, m in args.acc_runs]}
    series.update({k: [r.get(k, float("nan")) for r in runs] for k in keys})
    extra = {"train_samples": args.train_samples, "test_samples": args.test_samples,
             "lr": args.lr, "iters": args.iters, "channels": args.channels,
             "kernel": args.kernel, "h": args.h}
    return series, extra


def main(argv=None):
    args = parse(argv)
    world = MPI.COMM_WORLD
    if args.report_only:
        if world.Get_rank() == 0:
            kirby_report.write(reporting.results_dir(STUDY, args.out or OUT))
        return
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    parts = PARTS if args.part == "all" else (args.part,)
    done = {"count": count_part(args, world)}
    for part in parts:
        series, extra = {"accuracy": accuracy_part, "timing": timing_part}[part](args, world)
        done[part] = (series, extra)
    if world.Get_rank() == 0:
        d = reporting.results_dir(STUDY, args.out or OUT)
        for part, (series, extra) in done.items():
            meta = reporting.run_metadata(world_size=world.Get_size())
            meta.update(extra)
            kirby_report.store(d, part, series, meta)
        kirby_report.write(d)
        print(f"wrote {d} in {time.perf_counter() - t_start:.1f}s")


if __name__ == "__main__":
    main()
