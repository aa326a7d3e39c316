"""Study 4: layer-wise training -- our reading of Kim 2019 (sequential training), decoupled greedy
learning (DGL, Belilovsky et al. ICML 2020) and end-to-end backpropagation, at equal epoch budgets
with every method's learning rate tuned on a validation split.

Every method trains the same MLP (``depth`` blocks ``Linear + ReLU`` of ``width`` units,
identical initial weights per seed, Kaiming-normal by default: ``--init``) with linear heads,
SGD momentum 0.9, batch 64:

* ``end-to-end``: backpropagation through the whole network for B epochs, and for (L + 1) B
  epochs (``e2e_long``: the same passes over the data as sequential with B per stage);
* ``sequential`` (our reading of Kim 2019; only the abstract is checkable; grow-at-top): layer k
  with a fresh linear head on the cached outputs of the frozen layers below, then the output
  head re-fitted (``layerwise.train_layerwise("sequential")``), for B / (L + 1) epochs per stage
  (B passes over the data in all) and for B per stage ((L + 1) B passes; ``seq_long``);
* ``DGL``: one stage per layer, each with an auxiliary linear head, trained simultaneously for
  B epochs (``train_layerwise("decoupled")``; single process for the accuracy part -- the MPI
  pipeline gives the same updates -- and pipelined over the ranks in the timing part).

Budgets are equal in passes over the training data: {end-to-end, sequential, DGL} at B and
{end-to-end, sequential} at (L + 1) B (a pass through one layer costs less than one through the
network: the timing part measures the time). Learning rate: each (setting, method) picks from ``--lrs`` the value with the best mean
validation metric over the seeds (20 % of the training split held out, fixed across seeds);
test numbers are reported at that rate only. Settings: digits 3x64 and 6x16, MNIST-5k 4x64,
Peaks 4x32 (5 classes) and Peaks regression 4x32 (MSE on standardized ``peaks(x, y)`` values).

Parts (``--part``; each replaces its own group of ``results.h5``; ``table.md``/``summary.md``
are rebuilt from the file):

* ``accuracy``: the learning-rate sweep, test metrics at the selected rate, and the memory
  accounting of :mod:`layerwise_memory` (trainable parameters per stage, model state,
  autograd-saved activations, feature cache). Valid on a loaded machine.
* ``timing``: seconds to train B epochs per method at its selected rate (``--reps`` interleaved
  repeats, median; DGL also pipelined over the ranks). Refresh on a quiet machine.

Seeds and intervals (issue 24, item 2): every accuracy run takes under a minute, so ``--full``
has 5 seeds; tables give mean and Student-t 95% interval per method, the paired interval of each
method's difference to end-to-end at the same budget (same seeds: same initial weights) with
a verdict computed from it (margin +-1 point, fixed in advance), and the gap pass by pass on
the validation split (every seed's validation curve at the selected rate is stored). The
learning rates are the only choice, made on the validation split. Run time of ``--full`` (both
parts): 1227 s (20 min) measured at 48a9d82, 2 idle cores (``results/manifest.json``).
``--smoke``: 2 seeds, ~25 s on an idle machine.

Run::

    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_layerwise.py --full --part accuracy
    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_layerwise.py --full --part timing
    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_layerwise.py --smoke --out /tmp/x
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "reproductions"  # default results base folder
from mgrit.reporting import writers as reporting  # noqa: E402  (light: stdlib + numpy)

STUDY = "layerwise"
#: name -> (task, depth, width, kind)
SETTINGS = {"digits_3x64": ("digits", 3, 64, "cls"), "digits_6x16": ("digits", 6, 16, "cls"),
            "mnist5k_4x64": ("mnist5k", 4, 64, "cls"), "peaks_4x32": ("peaks", 4, 32, "cls"),
            "peaksreg_4x32": ("peaks", 4, 32, "reg")}
#: slug -> label
METHODS = {"e2e": "end-to-end", "seq": "sequential (B / (L+1) per stage)", "dgl": "DGL",
           "e2e_long": "end-to-end ((L+1) B epochs)", "seq_long": "sequential (B per stage)"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--part", choices=("all", "accuracy", "timing"), default="all")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild table.md, summary.md, plots from results.h5 without running")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list")
    p.add_argument("--seeds", type=int, default=None, help="default 3; --full 5; --smoke 2")
    p.add_argument("--budget", type=int, default=None,
                   help="epoch budget B (default 20, --full 30)")
    p.add_argument("--lrs", default="0.003,0.01,0.03,0.1", help="SGD learning rates swept")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="methods to (re)run; the stored results of the others, and of the "
                        "settings not in --settings, are kept when their rates, seeds, init, "
                        "budget, batch size and momentum match")
    p.add_argument("--init", choices=("he", "default"), default="he",
                   help="layer initialization, the same for every method (see build_layers)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--reps", type=int, default=3, help="timing repeats")
    reporting.add_study_flags(p, "5 seeds, B = 30", "tiny: digits 3x16, 2 seeds, 2 rates, B = 2")
    a = p.parse_args(argv)
    a.seeds = a.seeds or (2 if a.smoke else 5 if a.full else 3)
    a.budget = a.budget or (2 if a.smoke else 30 if a.full else 20)
    a.lr_list = [float(v) for v in a.lrs.split(",")]
    a.setting_list = [s.strip() for s in a.settings.split(",") if s.strip()]
    a.method_list = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in a.method_list:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}: use {', '.join(METHODS)}")
    if a.smoke:
        a.lr_list, a.reps = [0.01, 0.1], 1
        a.setting_list = ["digits_3x16", "peaksreg_2x8"]
    for s in a.setting_list:
        if s not in SETTINGS and s not in ("digits_3x16", "peaksreg_2x8"):
            raise SystemExit(f"unknown setting {s!r}: use {', '.join(SETTINGS)}")
    return a


SETTINGS_SMOKE = {"digits_3x16": ("digits", 3, 16, "cls"), "peaksreg_2x8": ("peaks", 2, 8, "reg")}

# --help must not pay for torch/MPI start-up: answer it before the heavy imports
if __name__ == "__main__" and any(a in ("-h", "--help") for a in sys.argv[1:]):
    parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from data import load_dataset  # noqa: E402
from data.peaks import make_peaks, peaks  # noqa: E402
from experiments.reports.study_parts import idle_barrier, read_part, write_part  # noqa: E402
from experiments.reproductions import layerwise_report  # noqa: E402
from experiments.reproductions.layerwise_memory import memory_table  # noqa: E402
from layerwise import global_batches, make_head, train_layerwise  # noqa: E402
from layerwise.common import make_optimizer  # noqa: E402
from mgrit.parallel.procgrid import ProcessGrid  # noqa: E402

#: whether layerwise.train_layerwise has the regression path (``loss="mse"``)
LIB_MSE = "loss" in inspect.signature(train_layerwise).parameters


def setting(name):
    return SETTINGS.get(name) or SETTINGS_SMOKE[name]


def budget(args, name):
    return args.budget


def seq_epochs(args, name):
    """Per-stage epochs of sequential training with equal passes: B / (L + 1), at least 1."""
    return max(1, round(budget(args, name) / (setting(name)[1] + 1)))


def load(task, kind):
    """Train / validation / test tensors (float32 inputs; int64 labels or float32 targets)."""
    if kind == "reg":
        xtr, _ = make_peaks(5000, 0, 0)
        xte, _ = make_peaks(1000, 0, 1)
        ytr, yte = peaks(xtr[:, 0], xtr[:, 1]), peaks(xte[:, 0], xte[:, 1])
        mu, sd = ytr.mean(), ytr.std()
        f = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float32))  # noqa: E731
        xtr, xte, ytr, yte, C = f(xtr), f(xte), f((ytr - mu) / sd)[:, None], f((yte - mu) / sd)[:, None], 1
    else:
        tr, te = load_dataset(task, seed=0, flatten=True)
        f = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float32))  # noqa: E731
        xtr, ytr, xte, yte, C = f(tr.x), torch.as_tensor(tr.y), f(te.x), torch.as_tensor(te.y), tr.num_classes
    perm = torch.as_tensor(np.random.default_rng(1234).permutation(len(xtr)))
    nva = len(xtr) // 5
    va, tr_ = perm[:nva], perm[nva:]
    return dict(xtr=xtr[tr_], ytr=ytr[tr_], xva=xtr[va], yva=ytr[va], xte=xte, yte=yte, C=C,
                kind=kind)


def build_layers(in_dim, depth, width, seed, init="he"):
    """``depth`` blocks Linear + ReLU, seeded; ``init="he"``: Kaiming-normal weights for ReLU
    (std sqrt(2 / fan_in)) and zero biases; ``"default"``: PyTorch's ``nn.Linear`` default
    (Kaiming-uniform with a = sqrt(5), variance 1 / (3 fan_in): ReLU signals shrink layer by
    layer, which stalls deep narrow end-to-end training for many epochs)."""
    torch.manual_seed(1000 + seed)
    layers, d = [], in_dim
    for _ in range(depth):
        lin = nn.Linear(d, width)
        if init == "he":
            nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")
            nn.init.zeros_(lin.bias)
        layers.append(nn.Sequential(lin, nn.ReLU()))
        d = width
    return layers


def loss_fn(kind):
    return F.mse_loss if kind == "reg" else F.cross_entropy


def metric(model, x, y, kind):
    """Accuracy (classification) or MSE (regression) of ``model`` on ``(x, y)``."""
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    if kind == "reg":
        return float(F.mse_loss(out, y))
    return float((out.argmax(1) == y).float().mean())


def end_to_end(name, seed, lr, args, D, eval_every=True, long=False):
    task, depth, width, kind = setting(name)
    layers = build_layers(D["xtr"].shape[1], depth, width, seed, args.init)
    torch.manual_seed(seed + 7919 * depth)
    net = nn.Sequential(*layers, make_head("linear", (width,), D["C"]))
    opt = make_optimizer("sgd", net.parameters(), lr, args.momentum, 0.0)
    lf, curve = loss_fn(kind), []
    for e in range(budget(args, name) * ((depth + 1) if long else 1)):
        for b in global_batches(len(D["xtr"]), args.batch_size, seed, e):
            b = torch.as_tensor(b)
            opt.zero_grad()
            lf(net(D["xtr"][b]), D["ytr"][b]).backward()
            opt.step()
        if eval_every:
            curve.append(metric(net, D["xva"], D["yva"], kind))
    return net, curve


def layerwise_run(name, method, seed, lr, args, D, grid=None, eval_every=True):
    """``train_layerwise`` for ``seq``/``seq_long``/``dgl``; returns (model, validation curve)."""
    task, depth, width, kind = setting(name)
    kw = {}
    if kind == "reg":
        kw["loss"] = "mse"
    if method == "dgl":
        kw.update(grid=grid, epochs=budget(args, name))
        if grid is not None:
            kw["stages_per_rank"] = depth // grid.layer_size
    else:
        e = seq_epochs(args, name) if method == "seq" else budget(args, name)
        kw.update(epochs=e, head_epochs=e)
    out = train_layerwise("decoupled" if method == "dgl" else "sequential",
                          build_layers(D["xtr"].shape[1], depth, width, seed, args.init), D["C"],
                          D["xtr"], D["ytr"], D["xva"] if eval_every else None,
                          D["yva"] if eval_every else None, batch_size=args.batch_size,
                          optimizer="sgd", lr=lr, momentum=args.momentum, seed=seed,
                          progress=False, **kw)
    curve = [v for v in (out["test_loss" if kind == "reg" else "test_acc"] if eval_every else [])
             if v is not None]
    return out["model"], curve


def run(name, method, lr, seed, args, D):
    """One accuracy job: (validation metric, test metric, validation curve); NaN when the
    library lacks the regression path."""
    if setting(name)[3] == "reg" and not method.startswith("e2e") and not LIB_MSE:
        return float("nan"), float("nan"), []
    if method in ("e2e", "e2e_long"):
        model, curve = end_to_end(name, seed, lr, args, D, long=method == "e2e_long")
    else:
        model, curve = layerwise_run(name, method, seed, lr, args, D)
    kind = D["kind"]
    return metric(model, D["xva"], D["yva"], kind), metric(model, D["xte"], D["yte"], kind), curve


def accuracy_part(args, comm):
    rank, P = comm.Get_rank(), comm.Get_size()
    data = {n: load(setting(n)[0], setting(n)[3]) for n in args.setting_list}
    jobs = [(n, m, lr, s) for n in args.setting_list for m in args.method_list
            for lr in args.lr_list for s in range(args.seeds)]
    mine = []
    for i, j in enumerate(jobs):
        if i % P == rank:
            mine.append((j, run(*j, args, data[j[0]])))
            if rank == 0 and len(mine) % 10 == 0:
                print(f"[accuracy] {len(mine) * P}/{len(jobs)} jobs", flush=True)
    res = {}
    for part in comm.allgather(mine):
        res.update(dict(part))
    series, kept = kept_results(args, comm)
    for n in args.setting_list:
        kind = setting(n)[3]
        for m in args.method_list:
            val = np.array([[res[(n, m, lr, s)][0] for s in range(args.seeds)] for lr in args.lr_list])
            test = np.array([[res[(n, m, lr, s)][1] for s in range(args.seeds)] for lr in args.lr_list])
            mean = val.mean(1)
            if np.all(np.isnan(mean)):
                best = -1
            else:
                best = int(np.nanargmin(mean) if kind == "reg" else np.nanargmax(mean))
            series[f"{n}/{m}/val"], series[f"{n}/{m}/test"] = val, test
            series[f"{n}/{m}/selected"] = [best]
            if best >= 0:
                series[f"{n}/{m}/curve_seed0"] = res[(n, m, args.lr_list[best], 0)][2] or [np.nan]
                # every seed's validation curve at the selected rate (seeds x passes): the gap
                # to end-to-end pass by pass (layerwise_report.gap_tables)
                cs = [res[(n, m, args.lr_list[best], s)][2] for s in range(args.seeds)]
                if all(cs) and len({len(c) for c in cs}) == 1:
                    series[f"{n}/{m}/curves"] = np.asarray(cs, dtype=float)
        D = data[n]
        task, depth, width, kind = setting(n)
        layers = build_layers(D["xtr"].shape[1], depth, width, 0, args.init)
        heads = [make_head("linear", (width,), D["C"]) for _ in range(depth)]
        mem = memory_table(layers, heads, D["xtr"][:args.batch_size], D["ytr"][:args.batch_size],
                           loss_fn(kind), len(D["xtr"]), P)
        for i, (mname, v) in enumerate(mem.items()):
            for k in ("state", "activations", "cache", "total"):
                series[f"{n}/memory/{i}/{k}"] = [v[k]]
            series[f"{n}/memory/{i}/trainable_per_stage"] = v["trainable_per_stage"]
        series[f"{n}/memory_names"] = np.array(list(mem), dtype="S")
        series[f"{n}/sizes"] = [len(D["xtr"]), len(D["xva"]), len(D["xte"])]
        series[f"{n}/epochs"] = [budget(args, n), seq_epochs(args, n)]
    extra = {"lrs": args.lr_list, "seeds": args.seeds, "budget": args.budget, "init": args.init,
             "batch_size": args.batch_size, "momentum": args.momentum,
             "settings": args.setting_list, "lib_mse": LIB_MSE,
             "methods": [m for m in METHODS if any(k.split("/")[1] == m for k in series
                                                   if k.endswith("/selected"))], **kept}
    return series, extra


def kept_results(args, comm):
    """The stored accuracy cells not rerun now (rank 0): every stored setting not in
    ``--settings`` (all its series: methods, memory, sizes) and, for the settings rerun, the
    methods not in ``--methods`` -- kept when the stored run used the same rates, seeds, init,
    budget, batch size and momentum; else nothing. Returns ``(series, meta entries)``; the
    meta's ``settings`` become the stored ones followed by the new ones."""
    if comm.Get_rank() != 0:
        return {}, {}
    d = reporting.results_dir(STUDY, args.out or OUT)
    old = read_part(d / "results.h5", "accuracy")
    if old is None:
        return {}, {}
    s, meta = old
    same = (meta["lrs"] == args.lr_list and meta["seeds"] == args.seeds
            and meta.get("init", "default") == args.init
            and meta["budget"] == args.budget and meta["batch_size"] == args.batch_size
            and meta["momentum"] == args.momentum)
    if not same:
        print("stored accuracy results have other rates, seeds, init, budget, batch size or "
              "momentum: not kept", flush=True)
        return {}, {}
    stored = list(meta["settings"])
    whole = [n for n in stored if n not in args.setting_list]
    cells = {n: [m for m in METHODS if m not in args.method_list and f"{n}/{m}/selected" in s]
             for n in stored if n in args.setting_list}
    series = {}
    for k, v in s.items():
        n, rest = k.split("/", 1)
        if n in whole or rest.split("/", 1)[0] in cells.get(n, ()):
            series[k] = v
    kept = {n: [m for m in METHODS if f"{n}/{m}/selected" in s] for n in whole}
    kept.update({n: ms for n, ms in cells.items() if ms})
    if not kept:
        return {}, {}
    info = {"kept_cells": kept, "settings": stored + [n for n in args.setting_list
                                                      if n not in stored],
            "kept_from": {k: meta.get(k) for k in ("commit", "date", "command")}}
    if meta.get("kept_cells") or meta.get("kept_methods"):  # cells kept by the stored run
        info["kept_before"] = {k: meta.get(k) for k in ("kept_cells", "kept_methods", "kept_from")}
    return series, info


def timing_part(args, comm, d):
    rank, P = comm.Get_rank(), comm.Get_size()
    acc = read_part(d / "results.h5", "accuracy") if rank == 0 else None
    acc = comm.bcast(acc[0] if acc else None, root=0)
    grid = ProcessGrid(comm, data_parallel=1)
    series = {}
    for n in args.setting_list:
        D = load(setting(n)[0], setting(n)[3])
        kind, depth = setting(n)[3], setting(n)[1]

        def lr_of(m):
            sel = -1 if acc is None or f"{n}/{m}/selected" not in acc else int(acc[f"{n}/{m}/selected"][0])
            return args.lr_list[sel] if sel >= 0 else 0.01
        methods = [m for m in args.method_list if kind == "cls" or m.startswith("e2e") or LIB_MSE]
        times = {m: [] for m in methods}
        times["dgl_pipe"] = []
        for _ in range(args.reps):
            for m in methods:
                idle_barrier(comm)
                if rank == 0:
                    t0 = time.perf_counter()
                    if m.startswith("e2e"):
                        end_to_end(n, 0, lr_of(m), args, D, eval_every=False,
                                   long=m == "e2e_long")
                    else:
                        layerwise_run(n, m, 0, lr_of(m), args, D, eval_every=False)
                    times[m].append(time.perf_counter() - t0)
            if depth % P == 0 and (kind == "cls" or LIB_MSE):
                idle_barrier(comm)
                t0 = time.perf_counter()
                layerwise_run(n, "dgl", 0, lr_of("dgl"), args, D, grid=grid, eval_every=False)
                times["dgl_pipe"].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        for m, t in times.items():
            if t:
                series[f"{n}/{m}/seconds"] = t
    grid.free()
    return series, {"reps": args.reps, "budget": args.budget, "ranks": P,
                    "settings": args.setting_list}


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    d = reporting.results_dir(STUDY, args.out or OUT) if comm.Get_rank() == 0 else None
    d = comm.bcast(d, root=0)
    parts = ("accuracy", "timing") if args.part == "all" else (args.part,)
    for part in () if args.report_only else parts:
        t0 = time.perf_counter()
        series, extra = accuracy_part(args, comm) if part == "accuracy" else timing_part(args, comm, d)
        if comm.Get_rank() == 0:
            meta = reporting.run_metadata(world_size=comm.Get_size())
            meta.update(extra, seconds=time.perf_counter() - t0)
            write_part(d / "results.h5", part, series, meta)
    if comm.Get_rank() == 0:
        layerwise_report.write(d)
        print(f"wrote {d}", flush=True)


if __name__ == "__main__":
    main()
