"""Multilevel training in depth: (a) multilevel initialization (nested iteration in depth, Cyr,
Guenther & Schroder 2019) against training from scratch, and (b) MG/Opt (Nash 2000) against its
inner optimizer alone.

Launch (1 rank: serial networks; K ranks: layer-parallel networks over K layer ranks, inexact
MGRIT with 2 forward / 1 backward cycles unless ``--exact``)::

    python experiments/studies/study_multilevel.py                      # the record, 3 seeds
    python experiments/studies/study_multilevel.py --full               # (b) with 400 fine gradients
    python experiments/studies/study_multilevel.py --smoke --out /tmp/x # seconds, for the tests
    mpiexec -n 2 python -m mpi4py experiments/studies/study_multilevel.py

(a) Through the main job (``layerpar.job.run_job``, ``--multilevel-init``): MNIST subset
(``mnist5k``: 4,000 train / 1,000 test), opening ``Linear(784, w)`` + tanh -> ``N`` dense tanh
residual layers (``T = 1``) -> ``Linear(w, 10)``; SGD with momentum 0.9 (``--optimizer``,
``--lr``), batches of ``--batch``, the same seed for both runs. Scratch: ``--multilevel-init 1``
(plain training at depth ``N`` with the schedule's clocks), ``--epochs`` epochs. Multilevel:
``--multilevel-init L``: ``--init-epochs`` epochs at ``N / 2^(L-1)``, prolonged (``--prolong``)
to twice the depth at half the step, ..., then ``--epochs`` epochs at ``N`` (a fresh optimizer
after each prolongation). Test accuracy after every epoch; clock (``--clock``): ``cpu`` = CPU
seconds of the process in the training steps (``time.process_time``; the default, robust on a
loaded machine; with several ranks rank 0's, including its busy-waiting for messages) or
``wall``; prolongations included, evaluation excluded. Target = the scratch run's final test
accuracy; time to accuracy = the clock at the end of the first epoch whose test accuracy reaches
it (coarse training included), ``inf`` if never. Run directories: ``runs/<name>-seed<s>/``.
The target is a definition fixed in advance (no choice is made on the test data); the
schedule and optimizer settings are fixed in the script (issue 18), not chosen in the run.
Seeds (issue 24, item 2): a run takes well under a minute, so ``--full`` has 5 seeds for (a)
(``--init-seeds``); the table gives the final accuracy and its gap epoch by epoch at depth N and
the time to the target with paired 95% intervals, and verdicts computed from them.

(b) Full-batch objectives: Peaks (``--peaks-points`` points, width 8, ``N`` = 32) and the MNIST
subset (``--mnist-points`` images, width 16, ``N`` = 16). MG/Opt V-cycles with 2 and 3 levels
(``MGOptOptions`` defaults: 1 pre/1 post step, 2 coarsest steps, constant P, average R,
``R_g = P^T``, Armijo line search) against the inner optimizer alone (SGD with momentum and Adam),
until ``--budget`` fine gradient evaluations. Training loss after every cycle/step against fine
gradient evaluations, modelled work (``MGOpt.work``: coarse levels by depth, forward-only line
search values 1/3) and wall time. Whether MG/Opt pays (lower loss at equal work / wall time)
is read from the paired 95% interval of the difference over the 3 seeds (``--seeds``; training
losses, not accuracies: kept at 3 seeds for the run time).

Run time of ``--full`` on 2 ranks: 1156 s (19 min) measured at 48a9d82, 2 idle cores
(``results/manifest.json``). ``--smoke``: ~15 s.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "experiments", "results", "studies")  # default results base

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from data import load_dataset  # noqa: E402
from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, serial_resnet  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402
from layerpar.job import run_job  # noqa: E402
from layerpar.jobconfig import JobConfig  # noqa: E402
from mgrit.multilevel.mgopt import MGOpt  # noqa: E402
from experiments.reports.study_parts import write_headline  # noqa: E402
from experiments.studies.multilevel_report import (_diff, _pays, init_intervals,  # noqa: E402
                                                    time_to, write_summary)

STUDY = "multilevel"
INNER = {"sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
         "adam": lambda ps, lr: torch.optim.Adam(ps, lr=lr)}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    reporting.add_study_flags(p, "(b) a budget of 400 fine gradients", "tiny settings (seconds)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="(b) seeds")
    p.add_argument("--init-seeds", type=int, nargs="+", default=None,
                   help="(a) seeds (default: --seeds; --full 0-4: a run takes under a minute)")
    p.add_argument("--width", type=int, default=32, help="(a) residual width")
    p.add_argument("--layers", type=int, default=64, help="(a) final depth N")
    p.add_argument("--levels", type=int, default=4, help="(a) depths N/2^(L-1) .. N")
    p.add_argument("--epochs", type=int, default=8, help="(a) epochs at the final depth")
    p.add_argument("--init-epochs", default="8,2,1", help="(a) epochs per coarse depth, coarsest "
                   "first, comma separated (the job's --init-epochs)")
    p.add_argument("--prolong", choices=["constant", "linear"], default="constant")
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="(a)")
    p.add_argument("--lr", type=float, default=0.05, help="(a) learning rate")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="(a) time to accuracy")
    p.add_argument("--train-images", type=int, default=None, help="(a) use the first n only")
    p.add_argument("--budget", type=int, default=150, help="(b) fine gradient evaluations")
    p.add_argument("--peaks-points", type=int, default=1000)
    p.add_argument("--mnist-points", type=int, default=1000)
    p.add_argument("--inner", nargs="+", choices=sorted(INNER), default=["sgd", "adam"])
    p.add_argument("--exact", action="store_true", help="MGRIT to 1e-10 (multi-rank runs)")
    a = p.parse_args(argv)
    a.inner_lr = {"sgd": 0.05, "adam": 0.01}
    if a.smoke:
        a.seeds, a.width, a.layers, a.levels, a.epochs, a.init_epochs = [0], 8, 4, 2, 2, "1"
        a.init_seeds = a.init_seeds or [0, 1]
        a.train_images, a.budget, a.peaks_points, a.mnist_points = 300, 6, 100, 60
        a.inner = ["sgd"]
    elif a.full:
        a.budget = 400
        a.init_seeds = a.init_seeds or [0, 1, 2, 3, 4]
    a.init_seeds = a.init_seeds or a.seeds
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


_LOADED: dict = {}


def _load(name):
    """``load_dataset(name, flatten=True)``, once per process."""
    if name not in _LOADED:
        _LOADED[name] = load_dataset(name, flatten=True)
    return _LOADED[name]


def _tensors(split, n=None):
    x = torch.as_tensor(split.x[:n], dtype=torch.float32)
    return x, torch.as_tensor(split.y[:n], dtype=torch.long)


# -- (a) multilevel initialization, through the main job ---------------------------------------
def job_config(args, comm, seed, levels, out):
    """The main job's settings of one run (``--multilevel-init levels``; 1 = from scratch)."""
    mgrit = comm.Get_size() > 1
    return JobConfig(
        dataset="mnist5k", limit_train=args.train_images or 0, model="resnet", step="dense",
        layers=args.layers, width=args.width, T=1.0, activation="tanh",
        method="mgrit" if mgrit else "serial", levels=2, cfactor=2, relax="FCF", fwd_iters=2,
        bwd_iters=1, tol=1e-10 if args.exact else 0.0, epochs=args.epochs,
        batch_size=args.batch, optimizer=args.optimizer, lr=args.lr, momentum=0.9, seed=seed,
        multilevel_init=levels, init_epochs=args.init_epochs if levels > 1 else "1",
        prolong=args.prolong,
        out=str(out), no_progress=True, guard="off").validated(comm.Get_size())


def read_curve(run, clock: str) -> dict:
    """Per epoch of a job's ``metrics.h5``: cumulative training seconds (``clock``: ``cpu`` =
    the process's CPU time, ``wall``), test accuracy, depth."""
    with h5py.File(Path(run) / "metrics.h5", "r") as h:
        t = h["train_cpu_time" if clock == "cpu" else "train_time"][:]
        return {"time": [float(v) for v in t], "test_acc": [float(v) for v in h["test_acc"][:]],
                "depth": [int(v) for v in h["depth"][:]],
                "cpu": [float(v) for v in h["train_cpu_time"][:]],
                "wall": [float(v) for v in h["train_time"][:]]}


def study_init(args, comm, series, out):
    rows = []
    for seed in args.init_seeds:
        curves = {}
        for name, levels in (("scratch", 1), ("multilevel", args.levels)):
            run = out / "runs" / f"{name}-seed{seed}"
            run_job(job_config(args, comm, seed, levels, run), comm)
            curves[name] = read_curve(run, args.clock) if comm.Get_rank() == 0 else None
        if comm.Get_rank() != 0:
            continue
        c_s, c_m = curves["scratch"], curves["multilevel"]
        target = c_s["test_acc"][-1]
        ts, tm = time_to(c_s, target), time_to(c_m, target)
        hit = next((d for d, a in zip(c_m["depth"], c_m["test_acc"]) if a >= target - 1e-12),
                   None)
        rows.append([seed, args.layers, "→".join(str(d) for d in sorted(set(c_m["depth"]))),
                     f"{target:.4f}", f"{ts:.2f}", f"{tm:.2f}",
                     f"{ts / tm:.2f}" if math.isfinite(tm) else "never",
                     "-" if hit is None else hit,
                     f"{c_s['cpu'][-1]:.2f} / {c_m['cpu'][-1]:.2f}",
                     f"{c_m['test_acc'][-1]:.4f}", f"{max(c_m['test_acc']):.4f}"])
        for name, c in curves.items():
            for k in ("time", "test_acc", "depth", "cpu", "wall"):
                series[f"init/seed{seed}/{name}/{k}"] = c[k]
    return rows


# -- (b) MG/Opt ------------------------------------------------------------------------------
def run_mgopt(args, comm, nets, x, y, width, n_layers, classes, inner, levels, seed, budget):
    """Loss after every cycle (levels >= 2) or inner step (levels == 1) against fine gradient
    evaluations, modelled work and wall time, until ``budget`` fine gradients."""
    model = nets.build(x.shape[1], width, n_layers, classes, seed)
    lr = args.inner_lr[inner]
    mg = MGOpt.from_fine(model, levels, lambda ps, l: INNER[inner](ps, lr))

    def closure(m, backward):
        return objective(m, x, y, backward)

    grads, work, wall, loss = [0], [0.0], [0.0], [objective(model, x, y, False)]
    while mg.fine_gradient_evaluations < budget:
        comm.Barrier()
        t0 = time.perf_counter()
        mg.step(closure)
        comm.Barrier()
        wall.append(wall[-1] + time.perf_counter() - t0)
        grads.append(mg.fine_gradient_evaluations)
        work.append(mg.work)
        with torch.no_grad():  # measurement only: not in the work or the wall time
            loss.append(objective(model, x, y, False))
    return dict(grads=grads, work=work, wall=wall, loss=loss)


def _at(curve, key, value) -> float:
    """The inner optimizer's loss at ``curve[key] == value`` (linear interpolation)."""
    return float(np.interp(value, curve[key], curve["loss"]))


def _mean_std(v) -> str:
    v = np.asarray(v, dtype=float)
    return f"{v.mean():.4f} ± {v.std():.4f}"


def study_mgopt(args, comm, nets, series, plots):
    """Rows per data set, inner optimizer and level count; the inner optimizer alone runs
    twice the budget so that its curve covers MG/Opt's work and wall time, and MG/Opt's
    final loss is compared with it at the same fine gradients, work and wall time."""
    rows = []
    sets = {"peaks": (args.peaks_points, 8, 4 if args.smoke else 32, 5),
            "mnist5k": (args.mnist_points, 16, 4 if args.smoke else 16, 10)}
    for name, (npts, width, n_layers, classes) in sets.items():
        x, y = _tensors(_load(name)[0], npts)
        curves_work, curves_wall = {}, {}
        for inner in args.inner:
            alone = {}
            for levels in (1, 2, 3):
                if n_layers // 2 ** (levels - 1) < comm.Get_size():
                    continue  # a coarse level needs a layer per rank
                label = f"{inner} alone" if levels == 1 else f"MG/Opt {levels}L + {inner}"
                budget = 2 * args.budget if levels == 1 else args.budget
                finals = []
                for seed in args.seeds:
                    r = run_mgopt(args, comm, nets, x, y, width, n_layers, classes, inner,
                                  levels, seed, budget)
                    for k, v in r.items():
                        series[f"mgopt/{name}/{inner}/L{levels}/seed{seed}/{k}"] = v
                    if levels == 1:
                        alone[seed] = r
                        g = args.budget  # its row: at the MG/Opt budget
                        finals.append((_at(r, "grads", g), g, g, _at_wall(r, g)) + (None,) * 3)
                    else:
                        a = alone[seed]
                        finals.append((r["loss"][-1], r["grads"][-1], r["work"][-1],
                                       r["wall"][-1], _at(a, "grads", r["grads"][-1]),
                                       _at(a, "work", r["work"][-1]),
                                       _at(a, "wall", r["wall"][-1])))
                    if seed == args.seeds[0]:
                        curves_work[label] = (r["work"], r["loss"])
                        curves_wall[label] = (r["wall"], r["loss"])
                f = list(zip(*finals))
                method = "inner alone" if levels == 1 else f"MG/Opt {levels} levels"
                cmp = ["-"] * 5 if levels == 1 else [
                    _mean_std(f[4]), _mean_std(f[5]), _mean_std(f[6]),
                    _pays(f[0], f[5]) + " / " + _pays(f[0], f[6]),
                    _diff(f[0], f[5]) + " / " + _diff(f[0], f[6])]
                rows.append([name, inner, method, _mean_std(f[0]), int(np.mean(f[1])),
                             f"{np.mean(f[2]):.1f}", f"{np.mean(f[3]):.2f}", *cmp])
        plots[f"mgopt_{name}_loss_vs_work.png"] = (curves_work, "work (fine-gradient equivalents)")
        plots[f"mgopt_{name}_loss_vs_time.png"] = (curves_wall, "wall time [s]")
    return rows


def _at_wall(r, g) -> float:
    """Wall seconds of the inner optimizer alone at ``g`` fine gradients."""
    return float(np.interp(g, r["grads"], r["wall"]))


def main(argv=None):
    args = parse(argv)
    comm = MPI.COMM_WORLD
    torch.set_default_dtype(torch.float32)
    nets = Nets(args, comm)
    series, plots = {}, {}
    out = reporting.results_dir(STUDY, args.out or OUT) if comm.Get_rank() == 0 else None
    out = Path(comm.bcast(None if out is None else str(out), root=0))
    init_rows = study_init(args, comm, series, out)
    mg_rows = study_mgopt(args, comm, nets, series, plots)
    if comm.Get_rank() != 0:
        return
    meta = reporting.run_metadata(argv if argv is None else ["study_multilevel.py", *argv],
                                  comm.Get_size())
    reporting.save_series(out / "results.h5", series, meta)
    curves = {f"seed {s} {k}": (series[f"init/seed{s}/{k}/time"],
                                series[f"init/seed{s}/{k}/test_acc"])
              for s in args.init_seeds for k in ("scratch", "multilevel")}
    reporting.plot_lines(out / "init_accuracy_vs_time.png", curves,
                         f"training time [s, {args.clock}]", "test accuracy",
                         title="MNIST subset: multilevel init vs scratch")
    for fname, (c, xlabel) in plots.items():
        reporting.plot_lines(out / fname, c, xlabel, "training loss", logy=True,
                             title=fname.split("_")[1])
    itab, isum, ihead = init_intervals(series, args) if init_rows else ([], [], [])
    body = ["## (a) Multilevel initialization, MNIST subset (time to accuracy)", "",
            "Target: per seed the scratch run's final test accuracy, a definition fixed in "
            "advance; the schedule and optimizer settings are fixed in the script (issue 18), "
            "not chosen in this run (the job has no validation split to choose them on, and "
            "whether they were first picked after seeing test accuracies is not recorded).", "",
            f"Clock: {args.clock} seconds of training (see the script's docstring); "
            f"schedule: --multilevel-init {args.levels} --init-epochs {args.init_epochs} "
            f"--epochs {args.epochs} --prolong {args.prolong}, --optimizer {args.optimizer} "
            f"--lr {args.lr} --batch-size {args.batch}, width {args.width}.", "",
            reporting.markdown_table(["seed", "N", "depths", "target acc (scratch final)",
                                      "scratch to target [s]", "multilevel to target [s]",
                                      "speedup", "depth when reached",
                                      "total CPU s scratch / multilevel",
                                      "multilevel final acc (N)", "multilevel best acc"],
                                     init_rows), "", *itab,
            "## (b) MG/Opt vs the inner optimizer alone (full-batch loss at the budget)", "",
            f"Budget {args.budget} fine gradient evaluations; work = MGOpt.work (fine-gradient "
            f"equivalents: coarse levels by depth, forward-only line-search values 1/3, a "
            f"model); wall = measured under the machine's load. The inner optimizer alone ran "
            f"to {2 * args.budget} fine gradients; its loss at MG/Opt's fine gradients, work "
            f"and wall time is interpolated from the same seed's curve (beyond its end: its "
            f"last loss, which favours MG/Opt). lr: {args.inner_lr}.",
            "",
            reporting.markdown_table(["data", "inner", "method", "final loss (mean ± std)",
                                      "fine gradients", "work", "wall [s]",
                                      "inner alone at same fine gradients",
                                      "inner alone at same work", "inner alone at same wall",
                                      "pays at equal work / wall (paired 95% interval)",
                                      "MG/Opt - alone at equal work / wall [95% CI]"],
                                     mg_rows)]
    reporting.write_table(out / "table.md", "Multilevel training in depth", meta, "\n".join(body))
    write_summary(out, init_rows, mg_rows, meta, args, isum)
    pays = [f"{r[0]} {r[1]} {r[2].replace('MG/Opt ', '')}: {r[10]}" for r in mg_rows
            if r[2] != "inner alone"]
    ihead += [{"claim": "MG/Opt pays against its inner optimizer alone (lower training loss at "
                        "equal work / equal wall time)",
               "ours": "; ".join(pays) + f" (paired 95% intervals, {len(args.seeds)} seeds, "
                       f"budget {args.budget} fine gradients)", "kind": "measured"}] \
        if pays else []
    write_headline(out, ihead, [meta])


if __name__ == "__main__":
    main()
