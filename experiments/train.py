"""Main job: train a deep ResNet layer-parallel with MGRIT (or serially / layer-wise) on real data.

Launch (the README's first command; default: mnist5k, dense ResNet of 32 tanh steps, width 32,
2 epochs, 3 levels / cfactor 4 / 2+1 iterations; 2 ranks in about 1-2 minutes)::

    mpiexec -n 2 python -m mpi4py experiments/train.py
    python experiments/train.py --serial                   # the serial reference, 1 rank
    mpiexec -n 4 python -m mpi4py experiments/train.py --dp 2   # 2 layer ranks x 2 replicas

Methods (``--method``):

* ``mgrit`` (default): ``LayerParallelNet(opening, LayerParallelResNet, closing)``; the N
  residual layers are split over the ``P_L = world / dp`` ranks of each layer-parallel group,
  the forward pass is an MGRIT solve, the backward pass an adjoint-MGRIT solve (or a serial
  sweep, ``--adjoint serial``). ``--tol 0`` (default) = inexact training with fixed iteration
  counts (``--fwd-iters``/``--bwd-iters``, warm start from the previous batch), ``--tol > 0`` =
  iterate to that tolerance (exact up to tol; at most 50 cycles).
* ``serial`` (``--serial``): plain ``nn.Sequential`` (opening, ``mgrit.nn.serial_resnet``,
  closing) with the same seeds, hence the same initial weights as ``mgrit``; with several ranks
  it is replicated (data parallel, ``dp = world size``).
* ``sequential`` / ``decoupled``: layer-wise training (``layerwise.train_layerwise``) of the
  same layers (opening + residual steps); ``sequential`` uses replicas only (``dp = world``),
  ``decoupled`` pipelines ``--stages`` stages over ``world / dp`` ranks.

Data: every layer rank of a replica loads the same data set (bundled ``mnist5k``, ``digits``,
``peaks``; any name of ``data.available_datasets()`` with ``--data-root``), split with
``--seed``; every global batch (``--batch-size``) is sharded over the ``dp`` replicas by
``data.GlobalBatchSampler``; gradients are averaged with ``mgrit.parallel.dataparallel.GradientBuckets``
(shard-size weighted, so any dp gives the single-replica update).

Threads: with more than one rank torch is set to one intra-op thread per rank
(``torch.set_num_threads(1)``), since ranks usually fill the cores (2 ranks on 2 cores);
``--threads`` overrides.

Output (world rank 0 only): a run directory ``--out`` (default ``runs/<method>-<timestamp>``)
with ``metrics.h5`` (one dataset per metric, one entry per epoch; config in attrs, rewritten
after every epoch), ``summary.json`` (config, final metrics, times, command line, git commit,
world size, dp) and ``curves.png`` (loss and accuracy per epoch).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # plain ``python experiments/train.py`` from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_parts, when imported by path
from train_parts import (default_out, features_of, git_commit,  # noqa: E402
                         run_end_to_end, run_layerwise, write_curves,
                         write_metrics)

METHODS = ("serial", "mgrit", "sequential", "decoupled")
BUNDLED = ("mnist5k", "digits", "peaks")


# ----------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="experiments/train.py",
        description="Train a deep ResNet layer-parallel with MGRIT over MPI (or serially / "
                    "layer-wise). Run as: mpiexec -n P python -m mpi4py experiments/train.py ...",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="mnist5k",
                   help="data set name (bundled, no download: mnist5k, digits, peaks; others "
                        "from data.available_datasets() need --data-root)")
    g.add_argument("--data-root", default=None, help="folder with the data set's files "
                   "(mnist, fashion-mnist, cifar10, hdf5); ignored by bundled sets")
    g.add_argument("--test-fraction", type=float, default=0.2,
                   help="test share for sets without a shipped split (seeded stratified split)")
    g.add_argument("--limit-train", type=int, default=0,
                   help="use only the first N training samples (0 = all)")
    g.add_argument("--limit-test", type=int, default=0,
                   help="use only the first N test samples (0 = all)")

    g = p.add_argument_group("network")
    g.add_argument("--step", choices=("dense", "conv", "twoconv"), default="dense",
                   help="residual step F: dense act(Wx+b), conv act(K*x+b), twoconv "
                        "act(K2*act(K1*x)) (TorchBraid's MNIST block)")
    g.add_argument("--layers", type=int, default=32, help="N, number of residual steps")
    g.add_argument("--width", type=int, default=32, help="state width of dense steps")
    g.add_argument("--channels", type=int, default=4, help="channels of conv steps")
    g.add_argument("--kernel", type=int, default=3, help="kernel size of conv steps (odd)")
    g.add_argument("--T", type=float, default=1.0, help="final time; step size h = T / N")
    g.add_argument("--activation", choices=("tanh", "relu", "smoothrelu"), default="tanh",
                   help="activation of the steps and the opening layer")

    g = p.add_argument_group("MGRIT (--method mgrit)")
    g.add_argument("--levels", type=int, default=3, help="maximum number of MGRIT levels")
    g.add_argument("--cfactor", type=int, default=4, help="coarsening factor")
    g.add_argument("--fwd-iters", type=int, default=2,
                   help="forward MGRIT cycles (with --tol 0: exactly this many; with --tol > 0 the cap is "
                        "max(this, 50))")
    g.add_argument("--bwd-iters", type=int, default=1,
                   help="backward (adjoint) MGRIT cycles (with --tol 0: exactly this many; with --tol > 0 "
                        "the cap is max(this, 50))")
    g.add_argument("--relax", default="F,FCF",
                   help="relaxation per level, comma separated, last repeated (F, FCF, FCFCF...)")
    g.add_argument("--tol", type=float, default=0.0,
                   help="0 = inexact training (fixed --fwd-iters/--bwd-iters cycles); > 0 = "
                        "iterate to this absolute residual tolerance (exact mode)")
    g.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=None,
                   help="start each forward solve from the previous batch's states "
                        "(default: on in inexact mode, off with --tol > 0)")
    g.add_argument("--warm-start-adjoint", action="store_true",
                   help="also start each adjoint solve from the previous batch's adjoints "
                        "(Guenther et al. 2020)")
    g.add_argument("--adjoint", choices=("mgrit", "serial"), default="mgrit",
                   help="backward solve: adjoint MGRIT, or a serial sweep across ranks")
    g.add_argument("--skip-first-relaxation", action="store_true",
                   help="skip relaxation on the first down-cycle (XBraid's skip)")

    g = p.add_argument_group("training")
    g.add_argument("--method", choices=METHODS, default="mgrit", help="training method")
    g.add_argument("--serial", action="store_true", help="shortcut for --method serial")
    g.add_argument("--epochs", type=int, default=2,
                   help="epochs (sequential: epochs per layer)")
    g.add_argument("--batch-size", type=int, default=50, help="global batch size")
    g.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="optimizer")
    g.add_argument("--lr", type=float, default=0.01, help="learning rate")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--seed", type=int, default=0, help="seed of data split, batches and weights")
    g.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="parameter and state dtype")
    g.add_argument("--eval-batch-size", type=int, default=500,
                   help="batch size of the test-set evaluation")
    g.add_argument("--stages", type=int, default=0,
                   help="decoupled: number of stages K (0 = one per layer rank)")

    g = p.add_argument_group("parallelism and output")
    g.add_argument("--dp", type=int, default=0,
                   help="data-parallel replicas P_D (P_L = world size / dp); 0 = 1 for mgrit "
                        "and decoupled, world size for serial and sequential")
    g.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads per rank (0 = 1 when world size > 1, else "
                        "torch's default)")
    g = p.add_argument_group("reliability")
    g.add_argument("--guard", choices=("off", "warn", "add_iterations", "serial"), default="warn",
                   help="convergence guard action when the MGRIT residual grows over 3 cycles "
                        "(logged to RUN/guard.jsonl); NaN/Inf always stops the run with the layer "
                        "named")
    g.add_argument("--checkpoint-every", type=int, default=0,
                   help="--method mgrit: save RUN/checkpoint.pt every K optimizer steps and at the "
                        "end of every epoch (0 = no checkpoints); atomic, resumable on any P")
    g.add_argument("--resume", default=None,
                   help="--method mgrit: checkpoint file to resume from (same flags otherwise; any "
                        "number of layer ranks)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None,
                   help="run directory (default runs/<method>-<timestamp>)")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def validate(p: argparse.ArgumentParser, a: argparse.Namespace, world: int) -> None:
    """Check the flags (no communication; the same verdict on every rank)."""
    if a.serial:
        if a.method not in ("mgrit", "serial"):
            p.error(f"--serial conflicts with --method {a.method}")
        a.method = "serial"
        a.serial = False
    for name in ("layers", "width", "channels", "kernel", "levels", "fwd_iters", "bwd_iters",
                 "epochs", "batch_size", "eval_batch_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} is not allowed: use an int >= 1")
    if a.cfactor < 2:
        p.error(f"--cfactor={a.cfactor} is not allowed: use an int >= 2")
    if a.kernel % 2 == 0:
        p.error(f"--kernel={a.kernel} is not allowed: use an odd int")
    if (a.checkpoint_every or a.resume) and a.method != "mgrit":
        p.error(f"--checkpoint-every/--resume are supported with --method mgrit only, "
                f"got --method {a.method}")
    if a.resume and not os.path.isfile(a.resume):
        p.error(f"--resume={a.resume!r}: no such checkpoint file")
    for name in ("limit_train", "limit_test", "seed", "threads", "dp", "stages",
                 "checkpoint_every"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} is not allowed: use an int >= 0")
    for name in ("T", "lr"):
        v = getattr(a, name)
        if not (math.isfinite(v) and v > 0):
            p.error(f"--{name}={v} is not allowed: use a finite number > 0")
    if not (math.isfinite(a.tol) and a.tol >= 0):
        p.error(f"--tol={a.tol} is not allowed: use 0 (inexact) or a number > 0")
    if not (math.isfinite(a.momentum) and 0 <= a.momentum < 1):
        p.error(f"--momentum={a.momentum} is not allowed: use a number in [0, 1)")
    if not 0 < a.test_fraction < 1:
        p.error(f"--test-fraction={a.test_fraction} is not allowed: use a number in (0, 1)")
    from mgrit.options import relaxation_sweeps
    relax = [r.strip() for r in a.relax.split(",")]
    try:
        for r in relax:
            relaxation_sweeps(r)
    except ValueError as e:
        p.error(f"--relax={a.relax!r}: {e}")
    a.relax_list = relax
    if a.dp == 0:
        a.dp = world if a.method in ("serial", "sequential") else 1
    if world % a.dp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        p.error(f"--dp={a.dp} does not divide the world size {world}: use one of {divisors}")
    P_L = world // a.dp
    if a.method in ("serial", "sequential") and P_L != 1:
        p.error(f"--method {a.method} has no layer parallelism: use --dp {world} (= world size; "
                f"replicas only), got --dp {a.dp}")
    if a.method == "mgrit" and a.layers < P_L:
        p.error(f"--layers={a.layers} is smaller than the {P_L} layer ranks (world {world} / dp "
                f"{a.dp}): use --layers >= {P_L} or fewer ranks")
    if a.method == "decoupled":
        K = a.stages or P_L
        if K % P_L:
            p.error(f"--stages={K} is not a multiple of the {P_L} layer ranks (world {world} / "
                    f"dp {a.dp})")
        if K > a.layers + 1:
            p.error(f"--stages={K} exceeds the {a.layers + 1} layers (opening + {a.layers} steps)")
        a.stages = K
    if a.dataset not in BUNDLED and a.dataset != "hdf5":
        from data import available_datasets
        names = available_datasets()
        if a.dataset not in names:
            p.error(f"--dataset={a.dataset!r} is unknown: use one of {names}")
    if a.batch_size < a.dp:
        p.error(f"--batch-size={a.batch_size} is smaller than --dp={a.dp}: every replica needs "
                f"a sample of every batch")



# ----------------------------------------------------------------------------- training
def main(argv=None) -> int:
    from mgrit.training.faults import fail_fast
    fail_fast(MPI.COMM_WORLD)  # an exception on any rank ends the job, naming rank and phase
    world_comm = MPI.COMM_WORLD
    world, wrank = world_comm.Get_size(), world_comm.Get_rank()
    parser = build_parser()
    a = parser.parse_args(argv)
    validate(parser, a, world)

    if a.threads:
        torch.set_num_threads(a.threads)
    elif world > 1:
        torch.set_num_threads(1)  # ranks share the cores; oversubscription slows every rank
    dtype = torch.float64 if a.dtype == "float64" else torch.float32
    torch.set_default_dtype(dtype)
    rank0 = wrank == 0
    say = (lambda *s: print(*s, flush=True)) if rank0 else (lambda *s: None)

    from mgrit.parallel.procgrid import ProcessGrid
    grid = ProcessGrid(world_comm, data_parallel=a.dp)

    # run directory first, so a failing run still leaves its config
    run = None
    if rank0:
        run = Path(a.out) if a.out else default_out(a.method)
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text(json.dumps(
            {"argv": sys.argv, "world_size": world,
             **{k: v for k, v in vars(a).items() if k != "relax_list"}}, indent=2, default=str))
    run = Path(world_comm.bcast(None if run is None else str(run), root=0))

    from data import load_dataset
    from mgrit.training.faults import phase
    t_load = time.perf_counter()
    with phase("data loading"):
        train, test = load_dataset(a.dataset, root=a.data_root, seed=a.seed,
                                   test_fraction=a.test_fraction, normalize=True,
                                   flatten=False)
    xtr, ytr = np.asarray(train.x), np.asarray(train.y)
    xte, yte = np.asarray(test.x), np.asarray(test.y)
    if a.limit_train:
        xtr, ytr = xtr[:a.limit_train], ytr[:a.limit_train]
    if a.limit_test:
        xte, yte = xte[:a.limit_test], yte[:a.limit_test]
    num_classes = train.num_classes
    in_shape = tuple(xtr.shape[1:])
    t_load = time.perf_counter() - t_load
    xtr_t = torch.as_tensor(xtr, dtype=dtype)
    ytr_t = torch.as_tensor(ytr, dtype=torch.long)
    xte_t = torch.as_tensor(xte, dtype=dtype)
    yte_t = torch.as_tensor(yte, dtype=torch.long)

    config = {k: v for k, v in vars(a).items() if k not in ("serial", "relax_list")}
    config.update(world_size=world, P_L=grid.layer_size, P_D=grid.data_size,
                  n_train=len(ytr), n_test=len(yte), input_shape=list(in_shape),
                  num_classes=num_classes, out=str(run), h=a.T / a.layers,
                  torch_threads=torch.get_num_threads())
    say(f"[train] {a.method} on {a.dataset}: {len(ytr)} train / {len(yte)} test {in_shape}, "
        f"{a.layers} x {a.step} steps ({features_of(a)} features), world {world} = "
        f"P_L {grid.layer_size} x P_D {grid.data_size}, run dir {run}")

    t_start = time.perf_counter()
    if a.method in ("sequential", "decoupled"):
        hist, final, extra = run_layerwise(a, grid, xtr_t, ytr_t, xte_t, yte_t, in_shape,
                                           num_classes)
    else:
        hist, final, extra = run_end_to_end(a, grid, xtr_t, ytr_t, xte_t, yte_t, in_shape,
                                            num_classes, dtype, run, config, rank0, say)
    total = time.perf_counter() - t_start

    if rank0:
        write_metrics(run, hist, config)
        summary = {
            "config": config, "method": a.method, "final": final,
            "epochs": hist, "times": {"total_s": total, "load_s": t_load,
                                      "train_s": float(np.nansum(hist["epoch_time"])),
                                      "mean_epoch_s": float(np.nanmean(hist["epoch_time"]))},
            "command": ((f"mpiexec -n {world} python -m mpi4py " if world > 1 else "python ")
                        + " ".join(shlex.quote(x) for x in sys.argv)),
            "argv": sys.argv, "git_commit": git_commit(), "world_size": world, "dp": a.dp,
            "P_L": grid.layer_size, "host": platform.node(), "platform": platform.platform(),
            "torch": torch.__version__, "date": _dt.datetime.now().isoformat(timespec="seconds"),
            **extra}
        (run / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        write_curves(run, hist, f"{a.method} {a.dataset} N={a.layers} world={world} dp={a.dp}")
        say(f"[train] done in {total:.1f}s: loss {final['loss']:.4f} train_acc "
            f"{final['train_acc']:.4f} test_acc {final['test_acc']:.4f} -> {run}")
    grid.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
