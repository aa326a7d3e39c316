"""Study 4: layer-wise training -- Kim 2019 sequential training and decoupled greedy learning
(DGL, Belilovsky et al. ICML 2020) versus end-to-end backpropagation on digits, MNIST-5k and
Peaks.

Every method trains the same MLP (``depth`` hidden blocks ``Linear + ReLU`` of ``width`` units,
identical initial weights per seed) with a linear output head, SGD (momentum 0.9), the same
batch size, learning rate and number of epochs:

* ``end-to-end``: plain backpropagation through the whole network for ``epochs`` epochs
  (independent runs, spread round-robin over the ranks).
* ``sequential`` (Kim 2019, grow-at-top): layer k is trained with a fresh linear head on the
  cached outputs of the frozen layers below for ``epochs`` epochs, then the output head is
  re-fitted for ``epochs`` epochs (``layerwise.train_layerwise(method="sequential")``;
  independent runs, spread round-robin over the ranks like end-to-end).
* ``DGL`` (decoupled greedy): K stages with auxiliary linear heads trained simultaneously, the
  stages **pipelined over the ranks** (``train_layerwise(method="decoupled", grid=ProcessGrid)``,
  K = P x stages_per_rank, one layer per stage where the depth allows).

Outputs under ``experiments/results/layerwise/``: ``results.h5`` (final accuracies and test
accuracy curves), ``table.md`` (mean/std over seeds next to the notes' pilot and published
numbers) and PNG curves.

Run::

    mpiexec -n 2 python -m mpi4py experiments/reproduce_layerwise.py           # small default
    mpiexec -n 2 python -m mpi4py experiments/reproduce_layerwise.py --full    # 5 seeds, more epochs
    mpiexec -n 2 python -m mpi4py experiments/reproduce_layerwise.py --smoke --out /tmp/x
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


STUDY = "layerwise"
METHODS = ("end-to-end", "sequential", "DGL")
# (task, depth, width): the notes' pilot used digits 3x64 and 6x16.
CONFIGS = {"digits": [(3, 64), (6, 16)], "mnist5k": [(4, 64)], "peaks": [(4, 32)]}
PILOT = {("digits", 3, 64): ("97.3%", "97.5%", "97.4%"),
         ("digits", 6, 16): ("90.5%", "95.9%", "94.8%"),
         ("peaks", 4, 32): ("MSE 0.0014 (regression)", "MSE 0.0136", "MSE 0.0038")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Layer-wise training study: end-to-end vs Kim 2019 sequential vs DGL "
                    "(pipelined over the MPI ranks) on digits, MNIST-5k and Peaks. Defaults are "
                    "small (2 ranks, minutes); --full: 5 seeds, more epochs; --smoke: tiny.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", default="digits,mnist5k,peaks", help="comma list")
    p.add_argument("--seeds", type=int, default=None, help="seeds per setting (default 2; --full 5)")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs (per layer for sequential; default 10, peaks x2; --full 30)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    reporting.add_study_flags(p, "5 seeds, 30 epochs", "tiny: digits 3x16, 1 seed, 1 epoch")
    a = p.parse_args(argv)
    if a.seeds is None:
        a.seeds = 1 if a.smoke else (5 if a.full else 2)
    if a.epochs is None:
        a.epochs = 1 if a.smoke else (30 if a.full else 10)
    a.task_list = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if a.smoke:
        a.task_list = ["digits"]
    for t in a.task_list:
        if t not in CONFIGS:
            raise SystemExit(f"unknown task {t!r}: use {', '.join(CONFIGS)}")
    return a


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mgrit.training import report as reporting  # noqa: E402  (light: stdlib + numpy)

# --help must not pay for torch/MPI start-up: answer it before the heavy imports
if __name__ == "__main__" and any(a in ("-h", "--help") for a in sys.argv[1:]):
    parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402



def load(task, seed=0):
    from data import load_dataset

    tr, te = load_dataset(task, seed=seed, flatten=True)
    f = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float32))  # noqa: E731
    return f(tr.x), torch.as_tensor(tr.y), f(te.x), torch.as_tensor(te.y), tr.num_classes


def build_layers(in_dim, depth, width, seed):
    torch.manual_seed(1000 + seed)
    layers, d = [], in_dim
    for _ in range(depth):
        layers.append(nn.Sequential(nn.Linear(d, width), nn.ReLU()))
        d = width
    return layers


def epochs_for(task, args):
    return args.epochs * (2 if task == "peaks" and not args.smoke else 1)


def end_to_end(task, depth, width, seed, args, data):
    """Plain backprop through layers + linear head; returns (final acc, curve, seconds)."""
    from layerwise import global_batches, make_head
    from layerwise.common import make_optimizer

    xtr, ytr, xte, yte, C = data
    layers = build_layers(xtr.shape[1], depth, width, seed)
    torch.manual_seed(seed + 7919 * depth)
    net = nn.Sequential(*layers, make_head("linear", (width,), C))
    opt = make_optimizer("sgd", net.parameters(), args.lr, args.momentum, 0.0)
    curve, t0 = [], time.perf_counter()
    for e in range(epochs_for(task, args)):
        net.train()
        for b in global_batches(len(xtr), args.batch_size, seed, e):
            b = torch.as_tensor(b)
            opt.zero_grad()
            F.cross_entropy(net(xtr[b]), ytr[b]).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            curve.append(float((net(xte).argmax(1) == yte).float().mean()))
    return curve[-1], curve, time.perf_counter() - t0


def sequential(task, depth, width, seed, args, data):
    """Kim 2019 grow-at-top, single process; returns (final acc, curve, seconds)."""
    from layerwise import train_layerwise

    xtr, ytr, xte, yte, C = data
    t0 = time.perf_counter()
    out = train_layerwise("sequential", build_layers(xtr.shape[1], depth, width, seed), C, xtr,
                          ytr, xte, yte, epochs=epochs_for(task, args), batch_size=args.batch_size,
                          optimizer="sgd", lr=args.lr, momentum=args.momentum, seed=seed,
                          progress=False)
    return out["final"]["acc"], list(out["test_acc"]), time.perf_counter() - t0


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    from layerwise import train_layerwise
    from mgrit.parallel.procgrid import ProcessGrid

    meta = reporting.run_metadata(world_size=P)
    meta.update({f"setting_{k}": v for k, v in vars(args).items() if k != "task_list"})
    settings = []
    for task in args.task_list:
        cfgs = [(3, 16)] if args.smoke else CONFIGS[task]
        for depth, width in cfgs:
            settings.append((task, depth, width))
    data = {t: load(t) for t in args.task_list}
    results = {}  # (task, depth, width, method) -> list of (acc, curve, seconds)
    # end-to-end and sequential runs are independent single-process jobs: round-robin over
    # the ranks (sequential training's stages run one after another by definition; its
    # data-parallel mode, a per-step allreduce, was far slower on the shared 2-core machine)
    jobs = [(s, seed, m) for s in settings for seed in range(args.seeds)
            for m in ("end-to-end", "sequential")]
    mine = [(s, seed, m, (end_to_end if m == "end-to-end" else sequential)(
                s[0], s[1], s[2], seed, args, data[s[0]]))
            for i, (s, seed, m) in enumerate(jobs) if i % P == rank]
    for part in comm.allgather(mine):
        for s, seed, m, r in part:
            results.setdefault((*s, m), []).append((seed, *r))
    for k in results:
        results[k].sort(key=lambda r: r[0])
    pipe_grid = ProcessGrid(comm, data_parallel=1)  # DGL: one pipeline over all ranks
    stage_info = {}
    for task, depth, width in settings:
        xtr, ytr, xte, yte, C = data[task]
        E = epochs_for(task, args)
        for seed in range(args.seeds):
            common = dict(epochs=E, batch_size=args.batch_size, optimizer="sgd", lr=args.lr,
                          momentum=args.momentum, seed=seed, progress=False)
            spr = max(1, depth // P)
            comm.Barrier()
            t0 = time.perf_counter()
            out = train_layerwise("decoupled", build_layers(xtr.shape[1], depth, width, seed), C,
                                  xtr, ytr, xte, yte, grid=pipe_grid, stages_per_rank=spr, **common)
            dt = time.perf_counter() - t0
            stage_info[(task, depth, width)] = P * spr
            results.setdefault((task, depth, width, "DGL"), []).append(
                (seed, out["final"]["acc"], list(out["test_acc"]), dt))
            if rank == 0:
                r = {m: results[(task, depth, width, m)][seed][1] for m in METHODS}
                print(f"[{task} {depth}x{width} seed {seed}] " +
                      " ".join(f"{m}={v:.4f}" for m, v in r.items()), flush=True)
    if rank != 0:
        return
    outdir = reporting.results_dir(STUDY, args.out)
    series, rows = {}, []
    for task, depth, width in settings:
        key = f"{task}_{depth}x{width}"
        accs = {}
        for m in METHODS:
            rs = results[(task, depth, width, m)]
            accs[m] = np.array([r[1] for r in rs])
            series[f"{key}/{m}/final_acc"] = accs[m]
            series[f"{key}/{m}/seconds"] = [r[3] for r in rs]
            for seed, _, curve, _ in rs:
                series[f"{key}/{m}/test_acc_seed{seed}"] = curve
        pilot = PILOT.get((task, depth, width), ("-", "-", "-"))
        row = [task, f"{depth}x{width}", stage_info[(task, depth, width)], epochs_for(task, args),
               len(accs["end-to-end"])]
        for m in METHODS:
            a = accs[m]
            row.append(f"{100 * a.mean():.1f}% ± {100 * a.std():.1f}")
        row += list(pilot)
        row += [f"{np.mean([r[3] for r in results[(task, depth, width, m)]]):.1f}" for m in METHODS]
        rows.append(row)
        # curves of seed 0: e2e and DGL per epoch; sequential per stage epoch
        curves = {}
        for m in METHODS:
            c = results[(task, depth, width, m)][0][2]
            if m == "sequential":
                c = [v for v in c if v is not None]
            curves[m] = (list(range(1, len(c) + 1)), c)
        reporting.plot_lines(outdir / f"{key}_test_acc.png", curves,
                             "epoch (sequential: layer-epochs, then head re-fit)", "test accuracy",
                             f"{task} MLP {depth}x{width}, seed 0")
    reporting.save_series(outdir / "results.h5", series, meta)
    header = ["task", "MLP", "DGL stages K", "epochs", "seeds", "end-to-end (ours)",
              "sequential (ours)", "DGL (ours)", "end-to-end (pilot)", "sequential (pilot)",
              "DGL (pilot)", "e2e s", "seq s", "DGL s"]
    pub = [["DGL (Belilovsky 2020), CIFAR-10 ResNet-32 error, K=2/4/8/16 vs e2e",
            "8.69 / 11.48 / 14.17 / 16.21% vs 7.37%", "not run (needs CIFAR-10 files, GPU scale)"],
           ["Greedy layerwise (Belilovsky 2019), CIFAR-10 acc, k=1/2/3", "88.3 / 90.4 / 91.7%",
            "not run"],
           ["DGL ImageNet VGG-13 K=4 vs backprop", "67.8 vs 66.6%", "not run"],
           ["Kim 2019 sequential", "no numbers retrievable (abstract only)", "direct reading, "
            "grow-at-top"]]
    # Average over all DGL-per-rank timings is a measurement on a shared machine.
    body = ["## Test accuracy, mean ± std over seeds (ours) next to the notes' pilot", "",
            reporting.markdown_table(header, rows), "",
            "Pilot numbers: the notes' pilot on this kind of machine (5 seeds, small MLPs); its "
            "Peaks row is a regression task (test MSE), ours is the 5-class Peaks classification "
            "(accuracy), so they are not comparable. Seconds are measured wall time per run on "
            f"a shared 2-core machine (load average {meta['loadavg']}); end-to-end and sequential ran as "
            f"independent single-process jobs (round-robin over the {P} ranks), DGL "
            f"pipelined over {P} ranks.", "",
            "## Published numbers (not reproduced here)", "",
            reporting.markdown_table(["paper / setting", "published", "ours"], pub), ""]
    reporting.write_table(outdir / "table.md", "Layer-wise training: end-to-end vs sequential "
                          "(Kim 2019) vs DGL (Belilovsky 2020)", meta, "\n".join(body))
    print(f"wrote {outdir}", flush=True)


if __name__ == "__main__":
    main()
