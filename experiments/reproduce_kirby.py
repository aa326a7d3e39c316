"""Study 1: reproduce Kirby et al. 2020 (arXiv 2007.07336, HPEC): two-level FAS-MGRIT forward over
the layers of an MNIST conv ResNet vs layer-wise model parallelism (the blocking chain).

Launch::

    mpiexec -n 2 python -m mpi4py experiments/reproduce_kirby.py            # default, ~2-3 min
    mpiexec -n 2 python -m mpi4py experiments/reproduce_kirby.py --full     # 20 ch 7x7, N to 4096
    mpiexec -n 2 python -m mpi4py experiments/reproduce_kirby.py --smoke --out /tmp/x

Their setting: opening conv 1->20 channels 7x7, N residual 7x7 conv layers of 20 channels
(x + h ReLU(K x + b), h = 1e-3), closing linear, batch 1, SGD, float32; MGRIT two levels,
m = 64 layers per block, <= 2 iterations (FCF), warm start from the previous sample, serial
backward. Baseline: the same partition as a blocking chain. Claim: 10.2x forward speedup with the
same number of GPUs (blocks of a GPU run concurrently on CUDA streams).

What this script measures (P = 1 and P = world size <= 2 ranks):
  * forward time of MGRIT (2 levels, m, 2 FCF iterations, warm start) and of the blocking chain
    (``MGRITOptions(max_levels=1)``, one level = sequential stepping across ranks) vs depth N;
    the ratio is the measured speedup. Our "streams" are the batched step over the intervals of a rank
    (``MGRITOptions.batched``: the step's native batched kernel, e.g. a grouped convolution,
    or ``vmap``).
  * modeled speedup to P = 128 with :mod:`mgrit.perf` (replay of the solver's control flow),
    once with the step cost calibrated on this CPU and once with ideal concurrency (a batched
    call over B intervals costs one step, as B CUDA streams on an idle GPU). MODELED numbers.
  * test accuracy after training the same initialization serially and layer-parallel (MGRIT
    forward, serial backward), batch 1, SGD. The training run relaxes with a loop over the
    intervals (``batched=False``: the same arithmetic; on a CPU the batched call has no
    concurrency to exploit).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

from mgrit.training import report as reporting  # noqa: E402
from mgrit import perf  # noqa: E402
from mgrit.nn import ConvStep, LayerParallelNet, LayerParallelResNet, serial_resnet  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402

STUDY = "kirby2020"
PUBLISHED = {"speedup_same_gpus": 10.2, "N": 4096, "m": 64, "iterations": 2}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    reporting.add_study_flags(
        p, "paper scale: 20 channels 7x7, N = 256..4096, 257-layer accuracy run")
    p.add_argument("--channels", type=int, default=4, help="(paper: 20)")
    p.add_argument("--kernel", type=int, default=3, help="(paper: 7)")
    p.add_argument("--h", type=float, default=1e-3, help="step size (paper: 1e-3)")
    p.add_argument("--cfactor", type=int, default=64, help="layers per block m (paper: 64)")
    p.add_argument("--iters", type=int, default=2, help="MGRIT forward iterations (paper: <= 2)")
    p.add_argument("--depths", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--reps", type=int, default=3, help="timed forwards per configuration")
    p.add_argument("--acc-depth", type=int, default=128, help="depth of the accuracy run (paper: 257)")
    p.add_argument("--train-samples", type=int, default=200)
    p.add_argument("--test-samples", type=int, default=300)
    p.add_argument("--lr", type=float, default=5e-3, help="SGD learning rate, batch 1")
    p.add_argument("--model-ranks", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.full:
        a.channels, a.kernel, a.depths = 20, 7, [256, 512, 1024, 2048, 4096]
        a.acc_depth, a.train_samples, a.test_samples = 256, 4000, 1000
    if a.smoke:
        a.cfactor, a.depths, a.reps, a.acc_depth = 4, [16], 2, 16
        a.train_samples, a.test_samples, a.model_ranks = 8, 20, 4
    return a


def cf(args, N):
    """Layers per block: the paper's m, reduced only when N has fewer than 2 blocks."""
    return max(2, min(args.cfactor, N // 2))


def fwd_opts(args, N, levels=2, batched=True):
    if levels == 1:
        return MGRITOptions(max_levels=1)
    return MGRITOptions(max_levels=2, cfactor=cf(args, N), tol=0, max_iter=args.iters, relax="FCF",
                        batched=batched)


def make_step(args):
    return lambda k: ConvStep(args.channels, args.kernel, "relu")


def time_forwards(args, comm, N, variants, xs):
    """Median wall time (max over ranks) of a no-grad forward for each ``(levels, batched)``
    variant; the variants run interleaved (sample i of every variant, then sample i + 1), so the
    load of a shared machine hits them alike. Consecutive samples: warm start from the previous.
    Returns the medians and the networks."""
    nets = [LayerParallelResNet.build(make_step(args), N, (args.channels, 28, 28), comm=comm,
                                      seed=args.seed, T=N * args.h,
                                      forward=fwd_opts(args, N, lv, b), adjoint="serial")
            for lv, b in variants]
    ts = [[] for _ in nets]
    with torch.no_grad():
        for i in range(args.reps + 1):
            for rn, t in zip(nets, ts):
                comm.Barrier()
                t0 = time.perf_counter()
                rn(xs[i] if rn.is_first else None, batch_size=1)
                dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                if i:  # the first forward has no warm start: excluded
                    t.append(dt)
    return [float(np.median(t)) for t in ts], nets


def calibrate(args, x):
    """Step cost of the forward chain on this rank (single step and batched over B intervals)."""
    n = 64
    rn = LayerParallelResNet.build(make_step(args), n, (args.channels, 28, 28), comm=MPI.COMM_SELF,
                                   seed=args.seed, T=n * args.h)
    ch = rn._chain
    ch.refresh()
    with torch.no_grad():
        U = x.unsqueeze(0).expand(n, *x.shape).contiguous()  # (intervals, batch, C, H, W)
        return perf.calibrate_step(lambda: ch.step(x, 0, 1, 0),
                                   lambda B: ch.step_batch(U[:B], list(range(B)),
                                                           list(range(1, B + 1)), 0),
                                   sizes=(2, 8, 32, 64), repeats=3, inner=5)


def opening(args):
    return nn.Sequential(nn.Conv2d(1, args.channels, args.kernel, padding=args.kernel // 2), nn.ReLU())


def closing(args):
    return nn.Sequential(nn.Flatten(), nn.Linear(args.channels * 784, 10))


def accuracy_run(args, world, tr, te):
    """Train serial (rank 0) and layer-parallel (all ranks) from the same init; test accuracy."""
    N, rank = args.acc_depth, world.Get_rank()
    order = np.random.default_rng(args.seed).permutation(len(tr))[:args.train_samples]
    Xte = torch.as_tensor(te.x[:args.test_samples])
    Yte = torch.as_tensor(te.y[:args.test_samples], dtype=torch.long)
    out = {}
    # serial reference
    if rank == 0:
        torch.manual_seed(args.seed + 1)
        op, cl = opening(args), closing(args)
        net = nn.Sequential(op, *serial_resnet(make_step(args), N, T=N * args.h, seed=args.seed), cl)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        t0 = time.perf_counter()
        for i in order:
            xb, yb = tr.get_batch(np.array([i]))
            opt.zero_grad()
            nn.functional.cross_entropy(net(torch.as_tensor(xb)), torch.as_tensor(yb, dtype=torch.long)).backward()
            opt.step()
        out["serial_train_s"] = time.perf_counter() - t0
        with torch.no_grad():
            out["serial_acc"] = float((net(Xte).argmax(1) == Yte).float().mean())
    world.Barrier()
    # layer-parallel: MGRIT forward (2 levels, m, 2 iterations, warm start), serial backward
    torch.manual_seed(args.seed + 1)
    op, cl = opening(args), closing(args)
    rn = LayerParallelResNet.build(make_step(args), N, (args.channels, 28, 28), comm=world,
                                   seed=args.seed, T=N * args.h,
                                   forward=fwd_opts(args, N, batched=False), adjoint="serial")
    net = LayerParallelNet(op, rn, cl)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    res = []
    world.Barrier()
    t0 = time.perf_counter()
    for i in order:
        xb, yb = tr.get_batch(np.array([i]))
        opt.zero_grad()
        o = net(torch.as_tensor(xb))
        net.loss(o, torch.as_tensor(yb, dtype=torch.long)).backward()
        opt.step()
        res.append(rn.last_forward.residuals[-1] if rn.last_forward.residuals else float("nan"))
    t = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    with torch.no_grad():
        o = net(Xte)  # inexact MGRIT forward, as in training
        acc = float((o.argmax(1) == Yte).float().mean()) if net.is_last else None
    acc = net.from_last(acc)
    exact = net.to_serial()
    with torch.no_grad():
        acc_exact = float((exact(Xte).argmax(1) == Yte).float().mean())
    out.update(parallel_train_s=t, parallel_acc_mgrit=acc, parallel_acc_exact=acc_exact,
               final_residual_median=float(np.median(res[-50:])))
    return out


def main(argv=None):
    args = parse(argv)
    world = MPI.COMM_WORLD
    rank, W = world.Get_rank(), world.Get_size()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    from data import load_dataset
    tr, te = load_dataset("mnist5k")
    stream = [torch.as_tensor(tr.get_batch(np.array([i]))[0]) for i in range(args.reps + 1)]
    lift = opening(args)
    with torch.no_grad():
        xs = [lift(x) for x in stream]

    # -- measured forward times: P = 1 (rank 0 alone) and P = W ---------------------------
    meas = []  # (P, N, t_mgrit, t_layerwise, t_serial, residual, t_mgrit_unbatched)
    for P in sorted({1, W}):
        sub = world.Split(0 if rank < P else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            for N in args.depths:
                if N < P or N // cf(args, N) < 2:
                    continue
                (t_lw, t_mg, t_loop), nets = time_forwards(args, sub, N, [(1, True), (2, True),
                                                                         (2, False)], xs)
                rn = nets[1]
                t_se = float("nan")
                if P == 1:
                    net = serial_resnet(make_step(args), N, T=N * args.h, seed=args.seed)
                    with torch.no_grad():
                        net(xs[0])
                        t0 = time.perf_counter()
                        for x in xs[1:]:
                            net(x)
                    t_se = (time.perf_counter() - t0) / args.reps
                r = rn.last_forward.residuals
                meas.append((P, N, t_mg, t_lw, t_se, float(r[-1]) if r else float("nan"), t_loop))
            sub.Free()
        world.Barrier()

    # -- modeled speedups (mgrit.perf replay) -----------------------------------------------
    tau = calibrate(args, xs[0]) if rank == 0 else None
    tau = world.bcast(tau, root=0)
    measured_comm = perf.pingpong(world)
    # the model targets a cluster: messages at perf.CommCost()'s default (5 us, 5 GB/s); the
    # ping-pong between two ranks on this shared 2-core machine is recorded but not used
    comm_cost = perf.CommCost()
    nbytes = args.channels * 784 * 4
    ideal = perf.StepCost(tau.single, tau.single, 0.0)
    model_depths = sorted(set(args.depths) | ({256, 512, 1024, 2048, 4096} if not args.smoke else set()))
    model = []  # (N, P, speedup_cpu, speedup_ideal)
    ranks = [2 ** k for k in range(0, 20) if 2 ** k <= args.model_ranks]
    if rank == 0:
        for N in model_depths:
            o = fwd_opts(args, N)
            for P in ranks:
                if P > N:
                    continue
                lw = perf.layerwise_time(N, P, tau.single, comm_cost.message(nbytes))
                # CPU: the cheaper of batched and looped relaxation on this machine
                def crit(t, batched=None):
                    return perf.simulate(N, P, o, iterations=args.iters, batched=batched, tau=t,
                                         comm=comm_cost, nbytes=nbytes).critical_path
                mc = min(crit(tau), crit(tau, batched=False))
                mi = crit(ideal)
                model.append((N, P, lw / mc, lw / mi))

    acc = accuracy_run(args, world, tr, te)

    if rank == 0:
        meta = reporting.run_metadata(world_size=W)
        meta["setting"] = (f"MNIST(mnist5k) conv ResNet {args.channels} ch {args.kernel}x{args.kernel}, "
                           f"ReLU, h={args.h}, batch 1, float32, 2-level FCF m={args.cfactor}, "
                           f"{args.iters} its, warm start, serial backward")
        meta["step_cost"] = f"single {tau.single:.3e}s, batched {tau.call:.3e}s + {tau.item:.3e}s/interval"
        meta["comm_cost_model"] = f"latency {comm_cost.latency:.2e}s, bandwidth {comm_cost.bandwidth:.2e}B/s"
        if measured_comm is not None:
            meta["comm_cost_measured_here"] = (f"latency {measured_comm.latency:.2e}s, bandwidth "
                                               f"{measured_comm.bandwidth:.2e}B/s (not used)")
        d = reporting.results_dir(STUDY, args.out)
        mod = {(N, P): (c, i) for N, P, c, i in model}
        series = {"meas_P": [m[0] for m in meas], "meas_N": [m[1] for m in meas],
                  "meas_t_mgrit": [m[2] for m in meas], "meas_t_layerwise": [m[3] for m in meas],
                  "meas_t_serial": [m[4] for m in meas], "meas_residual": [m[5] for m in meas],
                  "meas_t_mgrit_unbatched": [m[6] for m in meas],
                  "model_N": [m[0] for m in model], "model_P": [m[1] for m in model],
                  "model_speedup_cpu": [m[2] for m in model],
                  "model_speedup_ideal": [m[3] for m in model]}
        series.update({k: [v] for k, v in acc.items()})
        reporting.save_series(d / "results.h5", series, meta)
        rows = [[P, N, cf(args, N), f"{1e3 * tl:.2f}", f"{1e3 * tm:.2f}", tl / tm, f"{1e3 * tu:.2f}", tl / tu,
                 mod.get((N, P), (float("nan"),) * 2)[0], mod.get((N, P), (float("nan"),) * 2)[1],
                 f"{r:.2e}"] for P, N, tm, tl, ts, r, tu in meas]
        body = ("## Forward time: MGRIT vs layer-wise model parallelism (measured)\n\n"
                "Median forward (batch 1) wall time, max over ranks, the variants timed interleaved; speedup = layer-wise / MGRIT at the "
                "same P. `model cpu`/`model ideal` = the mgrit.perf replay at the same (N, P) with the "
                "CPU-calibrated step cost / ideal concurrency (MODELED). residual = last MGRIT residual "
                "(warm started).\n\n")
        body += reporting.markdown_table(["P", "N", "m", "layer-wise ms", "MGRIT ms (batched)", "speedup",
                                          "MGRIT ms (loop)", "speedup (loop)",
                                          "model cpu", "model ideal", "residual"], rows)
        ser = [(N, ts) for P, N, tm, tl, ts, r, tu in meas if P == 1]
        if ser:
            body += "\n\nSerial (plain nn.Sequential, 1 rank) forward ms: " + ", ".join(
                f"N={N}: {1e3 * t:.2f}" for N, t in ser)
        body += ("\n\n## Modeled speedup over layer-wise vs ranks (MODELED, mgrit.perf)\n\n"
                 "ideal = a batched call over B intervals costs one step (Kirby's CUDA streams on a "
                 "GPU); cpu = step cost calibrated here (the cheaper of batched and loop relaxation). "
                 "Messages: perf.CommCost() default (5 us + bytes / 5 GB/s). Published: 10.2x (N = 4096, m = 64, "
                 "2 iterations, same number of GPUs).\n\n")
        Ps = [P for P in ranks]
        mrows = []
        for N in model_depths:
            mrows.append([N] + [f"{mod[N, P][1]:.2f} / {mod[N, P][0]:.2f}" if (N, P) in mod else "-"
                                for P in Ps])
        body += reporting.markdown_table(["N \\ P (ideal / cpu)"] + [str(P) for P in Ps], mrows)
        body += ("\n\n## Test accuracy (batch-1 SGD, same init and sample order; MGRIT relaxation as a loop)\n\n"
                 + reporting.markdown_table(
                     ["depth", "train samples", "test samples", "serial acc", "layer-parallel acc (MGRIT fwd)",
                      "layer-parallel acc (exact fwd)", "serial train s", "layer-parallel train s",
                      "median final residual"],
                     [[args.acc_depth, args.train_samples, args.test_samples, acc["serial_acc"],
                       acc["parallel_acc_mgrit"], acc["parallel_acc_exact"], acc["serial_train_s"],
                       acc["parallel_train_s"], f"{acc['final_residual_median']:.2e}"]]))
        reporting.write_table(d / "table.md", "Kirby et al. 2020 reproduction", meta, body)
        curves = {}
        for P in sorted({m[0] for m in meas}):
            sel = [m for m in meas if m[0] == P]
            curves[f"measured P={P}"] = ([m[1] for m in sel], [m[3] / m[2] for m in sel])
            curves[f"measured loop P={P}"] = ([m[1] for m in sel], [m[3] / m[6] for m in sel])
            curves[f"modeled cpu P={P}"] = ([m[1] for m in sel], [mod.get((m[1], P), (np.nan,))[0] for m in sel])
        curves["modeled ideal P=1 (streams)"] = (model_depths, [mod.get((N, 1), (np.nan, np.nan))[1]
                                                                for N in model_depths])
        curves["published (N=4096)"] = ([PUBLISHED["N"]], [PUBLISHED["speedup_same_gpus"]])
        reporting.plot_lines(d / "speedup_vs_depth.png", curves, "depth N",
                             "forward speedup over layer-wise", logx=True, logy=True,
                             title="Kirby 2020: MGRIT forward vs blocking chain")
        curves = {}
        for N in model_depths:
            sel = [m for m in model if m[0] == N]
            if N in (max(model_depths), min(model_depths), 1024):
                curves[f"ideal N={N}"] = ([m[1] for m in sel], [m[3] for m in sel])
                curves[f"cpu N={N}"] = ([m[1] for m in sel], [m[2] for m in sel])
        for N in args.depths:
            sel = [m for m in meas if m[1] == N]
            if sel:
                curves[f"measured N={N}"] = ([m[0] for m in sel], [m[3] / m[2] for m in sel])
        reporting.plot_lines(d / "speedup_vs_ranks.png", curves, "ranks P",
                             "forward speedup over layer-wise", logx=True, logy=True,
                             title="Kirby 2020: speedup vs ranks (P>2 modeled)")
        print(body)
        print(f"wrote {d} in {time.perf_counter() - t_start:.1f}s")


if __name__ == "__main__":
    main()
