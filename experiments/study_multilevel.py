"""Multilevel training in depth: (a) multilevel initialization (nested iteration in depth, Cyr,
Guenther & Schroder 2019) against training from scratch, and (b) MG/Opt (Nash 2000) against its
inner optimizer alone.

Launch (1 rank: serial networks; K ranks: layer-parallel networks over K layer ranks, inexact
MGRIT with 2 forward / 1 backward cycles unless ``--exact``)::

    python experiments/study_multilevel.py                      # default, 3 seeds
    python experiments/study_multilevel.py --full               # deeper, longer
    python experiments/study_multilevel.py --smoke --out /tmp/x # seconds, for the tests
    mpiexec -n 2 python -m mpi4py experiments/study_multilevel.py

(a) MNIST subset (``mnist5k``: 4,000 train / 1,000 test, flattened): ``Linear(784, w)`` ->
``N`` dense tanh residual layers (``T = 1``) -> ``Linear(w, 10)``; Adam, minibatches, same seed
for both runs. Scratch: ``--epochs`` epochs at depth ``N``. Multilevel: ``--init-epochs`` epochs at
``N / 2^(L-1)``, prolonged (``--prolong``) to twice the depth at half the step, ... then up to
``--epochs`` epochs at ``N`` (a fresh Adam after each prolongation). Test accuracy after every
epoch; clock = training time only. Target = the scratch run's final test accuracy; time to
accuracy = first time a run reaches it (coarse training included), ``inf`` if never.

(b) Full-batch objectives: Peaks (``--peaks-points`` points, width 8, ``N`` = 32) and the MNIST
subset (``--mnist-points`` images, width 16, ``N`` = 16). MG/Opt V-cycles with 2 and 3 levels
(``MGOptOptions`` defaults: 1 pre/1 post step, 2 coarsest steps, constant P, average R,
``R_g = P^T``, Armijo line search) against the inner optimizer alone (SGD with momentum and Adam),
until ``--budget`` fine gradient evaluations. Training loss after every cycle/step against fine
gradient evaluations, modelled work (``MGOpt.work``: coarse levels by depth, forward-only line
search values 1/3) and wall time.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from data import GlobalBatchSampler, load_dataset  # noqa: E402
from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, serial_resnet  # noqa: E402
from mgrit.nn.depth import prolong  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.training import report as reporting  # noqa: E402
from mgrit.training.mgopt import MGOpt  # noqa: E402

STUDY = "multilevel"
INNER = {"sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
         "adam": lambda ps, lr: torch.optim.Adam(ps, lr=lr)}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    reporting.add_study_flags(p, "deeper networks, longer training", "tiny settings (seconds)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--width", type=int, default=32, help="(a) residual width")
    p.add_argument("--layers", type=int, default=32, help="(a) final depth N")
    p.add_argument("--levels", type=int, default=3, help="(a) depths N/2^(L-1) .. N")
    p.add_argument("--epochs", type=int, default=8, help="(a) epochs at the final depth (max)")
    p.add_argument("--init-epochs", type=int, default=2, help="(a) epochs per coarse depth")
    p.add_argument("--prolong", choices=["constant", "linear"], default="constant")
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3, help="(a) Adam learning rate")
    p.add_argument("--train-images", type=int, default=None, help="(a) use the first n only")
    p.add_argument("--budget", type=int, default=150, help="(b) fine gradient evaluations")
    p.add_argument("--peaks-points", type=int, default=1000)
    p.add_argument("--mnist-points", type=int, default=1000)
    p.add_argument("--inner", nargs="+", choices=sorted(INNER), default=["sgd", "adam"])
    p.add_argument("--exact", action="store_true", help="MGRIT to 1e-10 (multi-rank runs)")
    a = p.parse_args(argv)
    a.inner_lr = {"sgd": 0.05, "adam": 0.01}
    if a.smoke:
        a.seeds, a.width, a.layers, a.levels, a.epochs, a.init_epochs = [0], 8, 4, 2, 1, 1
        a.train_images, a.budget, a.peaks_points, a.mnist_points = 300, 6, 100, 60
        a.inner = ["sgd"]
    elif a.full:
        a.layers, a.levels, a.epochs, a.budget = 64, 4, 12, 400
    return a


class Nets:
    """Builds serial (1 rank) or layer-parallel (``comm`` size > 1) classifiers."""

    def __init__(self, args, comm):
        self.comm, self.args = comm, args
        self.parallel = comm.Get_size() > 1
        kw = dict(tol=1e-10, max_iter=50) if args.exact else dict(tol=0.0)
        self.fwd = MGRITOptions(max_levels=2, cfactor=2, **({"max_iter": 2} | kw))
        self.bwd = MGRITOptions(max_levels=2, cfactor=2, **({"max_iter": 1} | kw))

    def build(self, d_in, width, n_layers, classes, seed):
        torch.manual_seed(seed + 1000)
        opening, closing = nn.Linear(d_in, width), nn.Linear(width, classes)
        step = lambda k: DenseStep(width, "tanh")  # noqa: E731
        if not self.parallel:
            return nn.Sequential(opening, *serial_resnet(step, n_layers, 1.0, seed), closing)
        resnet = LayerParallelResNet.build(step, n_layers, (width,), comm=self.comm, seed=seed,
                                           forward=self.fwd, backward=self.bwd)
        return LayerParallelNet(opening, resnet, closing)


def objective(model, x, y, backward):
    """Mean cross-entropy (the same float on every layer rank); ``.backward()`` if asked."""
    if isinstance(model, LayerParallelNet):
        loss = model.loss(model(x), y)
        if backward:
            loss.backward()
        return model.from_last(loss.item() if model.is_last else None)
    loss = F.cross_entropy(model(x), y)
    if backward:
        loss.backward()
    return loss.item()


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        out = model(x)
    if isinstance(model, LayerParallelNet):
        acc = (out.argmax(1) == y).double().mean().item() if model.is_last else None
        return model.from_last(acc)
    return (out.argmax(1) == y).double().mean().item()


_LOADED: dict = {}


def _load(name):
    """``load_dataset(name, flatten=True)``, once per process."""
    if name not in _LOADED:
        _LOADED[name] = load_dataset(name, flatten=True)
    return _LOADED[name]


def _tensors(split, n=None):
    x = torch.as_tensor(split.x[:n], dtype=torch.float32)
    return x, torch.as_tensor(split.y[:n], dtype=torch.long)


# -- (a) multilevel initialization -------------------------------------------------------------
def train_curve(model, args, x, y, xt, yt, epochs, seed, clock, curve, comm):
    """Adam minibatch epochs; appends (training seconds so far, test accuracy) per epoch."""
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sampler = GlobalBatchSampler(len(x), args.batch, seed=seed)
    for epoch in range(epochs):
        comm.Barrier()
        t0 = time.perf_counter()
        sampler.set_epoch(len(curve))
        for idx in sampler:
            idx = torch.as_tensor(idx)
            opt.zero_grad()
            objective(model, x[idx], y[idx], True)
            opt.step()
        comm.Barrier()
        clock[0] += time.perf_counter() - t0
        curve.append((clock[0], accuracy(model, xt, yt)))


def time_to(curve, target):
    return next((t for t, acc in curve if acc >= target - 1e-12), math.inf)


def study_init(args, comm, nets, series):
    train, test = _load("mnist5k")
    x, y = _tensors(train, args.train_images)
    xt, yt = _tensors(test)
    rows = []
    for seed in args.seeds:
        scratch = nets.build(784, args.width, args.layers, 10, seed)
        c_s, clock = [], [0.0]
        train_curve(scratch, args, x, y, xt, yt, args.epochs, seed, clock, c_s, comm)
        target = c_s[-1][1]
        depth = args.layers // 2 ** (args.levels - 1)
        model = nets.build(784, args.width, depth, 10, seed)
        c_m, clock, switches = [], [0.0], []
        for _ in range(args.levels - 1):
            train_curve(model, args, x, y, xt, yt, args.init_epochs, seed, clock, c_m, comm)
            comm.Barrier()
            t0 = time.perf_counter()
            model = prolong(model, 2, args.prolong)
            clock[0] += time.perf_counter() - t0
            switches.append(clock[0])
        for _ in range(args.epochs):
            train_curve(model, args, x, y, xt, yt, 1, seed, clock, c_m, comm)
            if c_m[-1][1] >= target:
                break
        ts, tm = time_to(c_s, target), time_to(c_m, target)
        rows.append([seed, args.layers, f"{target:.4f}", f"{ts:.2f}", f"{tm:.2f}",
                     f"{ts / tm:.2f}" if math.isfinite(tm) else "never",
                     f"{c_m[-1][1]:.4f}"])
        for name, c in (("scratch", c_s), ("multilevel", c_m)):
            series[f"init/seed{seed}/{name}/time"] = [t for t, _ in c]
            series[f"init/seed{seed}/{name}/test_acc"] = [a for _, a in c]
        series[f"init/seed{seed}/multilevel/prolongation_times"] = switches
    return rows


# -- (b) MG/Opt ------------------------------------------------------------------------------
def run_mgopt(args, comm, nets, x, y, width, n_layers, classes, inner, levels, seed):
    """Loss after every cycle (levels >= 2) or inner step (levels == 1) against fine gradient
    evaluations, modelled work and wall time."""
    model = nets.build(x.shape[1], width, n_layers, classes, seed)
    lr = args.inner_lr[inner]
    mg = MGOpt.from_fine(model, levels, lambda ps, l: INNER[inner](ps, lr))

    def closure(m, backward):
        return objective(m, x, y, backward)

    grads, work, wall, loss = [0], [0.0], [0.0], [objective(model, x, y, False)]
    while mg.fine_gradient_evaluations < args.budget:
        comm.Barrier()
        t0 = time.perf_counter()
        mg.step(closure)
        comm.Barrier()
        wall.append(wall[-1] + time.perf_counter() - t0)
        grads.append(mg.fine_gradient_evaluations)
        work.append(mg.work)
        with torch.no_grad():
            loss.append(objective(model, x, y, False))
    return dict(grads=grads, work=work, wall=wall, loss=loss)


def study_mgopt(args, comm, nets, series, plots):
    rows = []
    sets = {"peaks": (args.peaks_points, 8, 4 if args.smoke else 32, 5),
            "mnist5k": (args.mnist_points, 16, 4 if args.smoke else 16, 10)}
    for name, (npts, width, n_layers, classes) in sets.items():
        x, y = _tensors(_load(name)[0], npts)
        curves_work, curves_wall = {}, {}
        for inner in args.inner:
            for levels in (1, 2, 3):
                if n_layers // 2 ** (levels - 1) < comm.Get_size():
                    continue  # a coarse level needs a layer per rank
                label = f"{inner} alone" if levels == 1 else f"MG/Opt {levels}L + {inner}"
                finals = []
                for seed in args.seeds:
                    r = run_mgopt(args, comm, nets, x, y, width, n_layers, classes, inner,
                                  levels, seed)
                    for k, v in r.items():
                        series[f"mgopt/{name}/{inner}/L{levels}/seed{seed}/{k}"] = v
                    finals.append((r["loss"][-1], r["grads"][-1], r["work"][-1], r["wall"][-1]))
                    if seed == args.seeds[0]:
                        curves_work[label] = (r["work"], r["loss"])
                        curves_wall[label] = (r["wall"], r["loss"])
                f = np.array(finals)
                method = "inner alone" if levels == 1 else f"MG/Opt {levels} levels"
                rows.append([name, inner, method,
                             f"{f[:, 0].mean():.4f} ± {f[:, 0].std():.4f}", int(f[:, 1].mean()),
                             f"{f[:, 2].mean():.1f}", f"{f[:, 3].mean():.2f}"])
        plots[f"mgopt_{name}_loss_vs_work.png"] = (curves_work, "work (fine-gradient equivalents)")
        plots[f"mgopt_{name}_loss_vs_time.png"] = (curves_wall, "wall time [s]")
    return rows


def main(argv=None):
    args = parse(argv)
    comm = MPI.COMM_WORLD
    torch.set_default_dtype(torch.float32)
    nets = Nets(args, comm)
    series, plots = {}, {}
    init_rows = study_init(args, comm, nets, series)
    mg_rows = study_mgopt(args, comm, nets, series, plots)
    if comm.Get_rank() != 0:
        return
    out = reporting.results_dir(STUDY, args.out)
    meta = reporting.run_metadata(argv if argv is None else ["study_multilevel.py", *argv],
                                  comm.Get_size())
    reporting.save_series(out / "results.h5", series, meta)
    curves = {f"seed {s} {k}": (series[f"init/seed{s}/{k}/time"],
                                series[f"init/seed{s}/{k}/test_acc"])
              for s in args.seeds for k in ("scratch", "multilevel")}
    reporting.plot_lines(out / "init_accuracy_vs_time.png", curves, "training time [s]",
                         "test accuracy", title="MNIST subset: multilevel init vs scratch")
    for fname, (c, xlabel) in plots.items():
        reporting.plot_lines(out / fname, c, xlabel, "training loss", logy=True,
                             title=fname.split("_")[1])
    body = ["## (a) Multilevel initialization, MNIST subset (time to accuracy)", "",
            reporting.markdown_table(["seed", "N", "target acc (scratch final)", "scratch [s]",
                                      "multilevel [s]", "speedup", "multilevel final acc"],
                                     init_rows), "",
            "## (b) MG/Opt vs the inner optimizer alone (full-batch loss at the budget)", "",
            reporting.markdown_table(["data", "inner", "method", "final loss (mean ± std)",
                                      "fine gradients", "work", "wall [s]"], mg_rows)]
    reporting.write_table(out / "table.md", "Multilevel training in depth", meta, "\n".join(body))


if __name__ == "__main__":
    main()
