"""Study: the gradient-bias monitor (mgrit.training.bias) on a run where fixed-iteration MGRIT
training falls behind serial training.

Launch (2 ranks; 55 s measured at 48a9d82, 2 idle cores (``results/manifest.json``))::

    mpiexec -n 2 python -m mpi4py experiments/studies/study_bias.py
    mpiexec -n 2 python -m mpi4py experiments/studies/study_bias.py --smoke --out /tmp/x   # seconds

Setting (the issue's recipe: few iterations, many layers, a learning-rate schedule toward a
minimum): Peaks (5,000 points, 5 classes, bundled), dense tanh ResNet of ``--layers 64`` steps
of width 8, ``T = 5``; SGD with momentum 0.9, learning rate 0.05 decayed to 0 by a cosine over
all steps, batches of 50, float32, seed 0. Three runs with the same seed, weights and batches:

* ``serial``: the serial network (``P_D = world`` replicas);
* ``fixed``: layer-parallel on ``P_L = world`` ranks: 2 levels, coarsening factor 8,
  F-relaxation, 1 forward / 1 adjoint cycle, warm start. It carries a monitor in ``log`` mode:
  it measures the bias every ``--every`` steps and never acts (training is then unchanged bit
  for bit, see tests/training/test_bias.py), so its log shows the fixed run's bias;
* ``monitor``: the same with the monitor in ``raise`` mode (``--ratio``, ``--window``).

The final weights of every run are also evaluated *exactly* (``to_serial()``, serial forward)
on the whole training and test sets, so the comparison is of the trained weights, not of the
inexact forward solves. Output in ``experiments/results/studies/bias_monitor/``: ``table.md``,
``summary.md`` (with the decision-log excerpt), ``bias_fixed.jsonl``, ``bias_monitor.jsonl``,
``results.json``, ``curves.png`` (training loss per epoch), ``bias.png`` (bias/noise per check).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "experiments", "results", "studies")  # default results base

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from data import load_dataset  # noqa: E402
from mgrit.nn import LayerParallelNet  # noqa: E402
from mgrit.parallel import ProcessGrid  # noqa: E402
from mgrit.training import ConsoleLog, Trainer, fail_fast  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402
from mgrit.training.bias import BiasMonitor  # noqa: E402
from layerpar.jobconfig import JobConfig  # noqa: E402
from mgrit.models import build_model  # noqa: E402

RUNS = ("serial", "fixed", "monitor")


class CosineLR:
    """Callback: the learning rate ``lr0 * (1 + cos(pi * step / total)) / 2`` after each step."""

    def __init__(self, optimizer, total: int):
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    def on_step_end(self, trainer, record) -> None:
        self.sched.step()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    reporting.add_study_flags(p, "(no larger scale: the default is the recorded run)")
    p.add_argument("--dataset", default="peaks")
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--T", type=float, default=5.0)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--cfactor", type=int, default=8)
    p.add_argument("--relax", default="F")
    p.add_argument("--fwd-iters", type=int, default=1)
    p.add_argument("--bwd-iters", type=int, default=1)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=25, help="steps between bias checks")
    p.add_argument("--ratio", type=float, default=0.5, help="bias > ratio x noise dominates")
    p.add_argument("--window", type=int, default=2, help="dominated checks in a row to act")
    p.add_argument("--rewrite", action="store_true", help="only re-write the tables and plots "
                   "from the results folder's results.json (its recorded command, commit, date)")
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.epochs, a.every, a.limit = 16, 1, 5, 500
    else:
        a.limit = 0
    return a


def load(a):
    train, test = load_dataset(a.dataset, seed=a.seed, test_fraction=0.2, normalize=True,
                               flatten=False)
    xs = [torch.as_tensor(np.asarray(s.x), dtype=torch.float32) for s in (train, test)]
    ys = [torch.as_tensor(np.asarray(s.y), dtype=torch.long) for s in (train, test)]
    if a.limit:
        xs[0], ys[0] = xs[0][:a.limit], ys[0][:a.limit]
    return (xs[0], ys[0]), (xs[1], ys[1]), train.num_classes


def exact_metrics(net, data) -> tuple:
    """(loss, accuracy) of ``net``'s weights with a serial forward (every rank)."""
    model = net.to_serial() if isinstance(net, LayerParallelNet) else net
    model.eval()
    with torch.no_grad():
        out = model(data[0])
        acc = (out.argmax(1) == data[1]).float().mean()
        return float(F.cross_entropy(out, data[1])), float(acc)


def run(kind, a, comm, train, test, classes, log_path):
    world = comm.Get_size()
    grid = ProcessGrid(comm, data_parallel=world if kind == "serial" else 1)
    cfg = JobConfig(dataset=a.dataset, layers=a.layers, width=a.width, T=a.T, levels=a.levels,
                    cfactor=a.cfactor, relax=a.relax, fwd_iters=a.fwd_iters,
                    bwd_iters=a.bwd_iters, seed=a.seed, lr=a.lr)
    net = build_model("resnet", cfg, tuple(train[0].shape[1:]), classes,
                      comm=None if kind == "serial" else grid.layer_comm)
    opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=0.9)
    steps = a.epochs * math.ceil(len(train[1]) / a.batch_size)
    callbacks = [CosineLR(opt, steps), ConsoleLog(prefix=f"[{kind}]")]
    monitor = None
    if kind != "serial":
        if comm.Get_rank() == 0 and os.path.exists(log_path):
            os.remove(log_path)
        monitor = BiasMonitor(action="log" if kind == "fixed" else "raise", every=a.every,
                              ratio=a.ratio, window=a.window, log_path=log_path)
        callbacks.insert(0, monitor)
    trainer = Trainer(net, opt, grid, callbacks=callbacks)
    t0 = time.perf_counter()
    res = trainer.fit(train, epochs=a.epochs, batch_size=a.batch_size, seed=a.seed, test=test)
    wall = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    tr_loss, tr_acc = exact_metrics(net, train)
    te_loss, te_acc = exact_metrics(net, test)
    out = {"history": {k: res.history[k] for k in ("epoch", "loss", "train_acc", "test_acc",
                                                    "test_loss")},
           "final": res.final, "exact": {"train_loss": tr_loss, "train_acc": tr_acc,
                                         "test_loss": te_loss, "test_acc": te_acc},
           "wall_s": wall, "steps": res.steps,
           "events": monitor.events if monitor else [],
           "solvers": res.plan.solvers}
    grid.free()
    return out


def write(a, results, meta, out_dir: Path):
    ser = results["serial"]["exact"]["train_loss"]
    rows = []
    for k in RUNS:
        r = results[k]
        acted = [e for e in r["events"] if e["action"] in ("raise", "serial")]
        gap = f"{100 * (r['exact']['train_loss'] / ser - 1):+.1f}%"
        rows.append([k, r["exact"]["train_loss"], gap,
                     r["exact"]["train_acc"], r["exact"]["test_loss"], r["exact"]["test_acc"],
                     r["history"]["loss"][-1], len(r["events"]), len(acted),
                     f"{r['wall_s']:.0f}"])
    table = reporting.markdown_table(
        ["run", "train loss (exact eval)", "vs serial", "train acc", "test loss", "test acc",
         "last-epoch mean loss", "bias checks", "actions", "wall s (load: header)"], rows)
    epochs = reporting.markdown_table(
        ["epoch"] + list(RUNS), [[e] + [results[k]["history"]["loss"][e - 1] for k in RUNS]
                                 for e in results["serial"]["history"]["epoch"]])
    body = (f"{table}\n\nMean training loss per epoch (as seen during training):\n\n{epochs}\n")
    reporting.write_table(out_dir / "table.md", "Gradient-bias monitor: serial vs fixed "
                          "iterations vs monitor", meta, body)
    mon = results["monitor"]["events"]
    fix = results["fixed"]["events"]
    acted = [e for e in mon if e["action"] != "none"]
    fmt = lambda e: (f"| {e['step']} | {e['bias']:.3g} | {e['noise']:.3g} | "  # noqa: E731
                     f"{e['ratio']:.3g} | "
                     f"{e['streak']} | {e['action']} | {e['options'][0]['fwd_iters']}/"
                     f"{e['options'][0]['bwd_iters']} |")
    head = "| step | bias | noise | bias/noise | streak | action | fwd/bwd cycles after |\n" \
           "|---|---|---|---|---|---|---|"
    lead = sorted({e["step"] for t in acted for e in mon
                   if t["step"] - 3 * a.every <= e["step"] <= t["step"]})
    around = [e for e in mon if e["step"] in lead]
    per_epoch = reporting.markdown_table(
        ["epoch", "fixed: median bias/noise", "monitor: median bias/noise",
         "monitor: fwd/bwd cycles at epoch end"],
        [[ep + 1] + [float(np.median([e["ratio"] for e in results[k]["events"]
                                      if e["epoch"] == ep and e["ratio"] is not None] or [np.nan]))
                     for k in ("fixed", "monitor")]
         + [next((f"{e['options'][0]['fwd_iters']}/{e['options'][0]['bwd_iters']}"
                  for e in reversed(mon) if e["epoch"] == ep), "-")]
         for ep in range(a.epochs)])
    ratios_fixed = [e["ratio"] for e in fix if e["ratio"] is not None]
    lines = [
        f"Setting: {a.dataset}, {a.layers} dense tanh layers of width {a.width}, T = {a.T}, "
        f"{a.levels} levels, cfactor {a.cfactor}, relax {a.relax}, {a.fwd_iters} forward / "
        f"{a.bwd_iters} adjoint cycle(s) with warm start; SGD momentum 0.9, lr {a.lr} cosine "
        f"to 0 over {results['serial']['steps']} steps, batch {a.batch_size}, {a.epochs} "
        f"epochs, seed {a.seed}. Monitor: every {a.every} steps, ratio {a.ratio}, window "
        f"{a.window}, serial reference, 4 micro-batches, action raise (+1/+1 cycles, caps 8/8, "
        f"then serial).", "",
        f"Result: the fixed-iteration run ends at training loss "
        f"{results['fixed']['exact']['train_loss']:.4f} vs serial {ser:.4f} "
        f"({100 * (results['fixed']['exact']['train_loss'] / ser - 1):+.1f}%); with the monitor "
        f"{results['monitor']['exact']['train_loss']:.4f} "
        f"({100 * (results['monitor']['exact']['train_loss'] / ser - 1):+.1f}%). The fixed "
        f"run's bias/noise ratio over its {len(fix)} checks (log mode): median "
        f"{np.median(ratios_fixed) if ratios_fixed else float('nan'):.3g}, min "
        f"{min(ratios_fixed, default=float('nan')):.3g}, max "
        f"{max(ratios_fixed, default=float('nan')):.3g}.", "",
        f"The monitor acted {len([e for e in acted if e['action'] in ('raise', 'serial')])} "
        f"time(s), at steps {[e['step'] for e in acted]}; final solver: "
        f"{results['monitor']['events'][-1]['options'] if mon else '-'}.", "",
        "Bias/noise per epoch (median over the epoch's checks; the fixed run's monitor only "
        "logs):", "", per_epoch, "",
        "Decision log excerpt (`bias_monitor.jsonl`, one line per check): each action with the "
        "three checks before it. Why: the bias exceeded the ratio times the noise in "
        f"{a.window} checks in a row (streak). Actions in epoch(s) "
        f"{sorted({e['epoch'] + 1 for e in acted})} of {a.epochs}:", "",
        head, *[fmt(e) for e in around], "",
        "Wall times: a timing result only where the load average in the header stayed below "
        "the core count; a check costs about one serial forward + backward of the batch."]
    reporting.write_table(out_dir / "summary.md", "Gradient-bias monitor: summary", meta,
                          "\n".join(lines))
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "args": vars(a),
                                                      "results": results}, indent=1,
                                                     default=str))
    reporting.plot_lines(out_dir / "curves.png", {k: (results[k]["history"]["epoch"],
                                                      results[k]["history"]["loss"])
                                                  for k in RUNS},
                         "epoch", "mean training loss", "serial vs fixed iterations vs monitor")
    reporting.plot_lines(out_dir / "bias.png", {
        f"{k} (bias/noise)": ([e["step"] for e in results[k]["events"]],
                              [e["ratio"] for e in results[k]["events"]])
        for k in ("fixed", "monitor")},
        "step", "bias / noise", f"ratio threshold {a.ratio}")


def main(argv=None) -> int:
    comm = MPI.COMM_WORLD
    fail_fast(comm)
    a = parse(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    out_dir = reporting.results_dir("bias_monitor", a.out or OUT)
    if a.rewrite:  # no training: the recorded run's numbers, arguments and metadata
        if comm.Get_rank() == 0:
            saved = json.loads((out_dir / "results.json").read_text())
            # a record without the load after its run keeps none (never today's load)
            saved["meta"].setdefault("loadavg_after", "unknown (not recorded)")
            write(argparse.Namespace(**saved["args"]), saved["results"], saved["meta"], out_dir)
        return 0
    meta = reporting.run_metadata(world_size=comm.Get_size())
    train, test, classes = load(a)
    results = {}
    for kind in RUNS:
        results[kind] = run(kind, a, comm, train, test, classes,
                            str(out_dir / f"bias_{kind}.jsonl"))
    if comm.Get_rank() == 0:  # the load after the runs goes into results.json too
        write(a, results, reporting.finish_metadata(meta), out_dir)
        print(f"[study_bias] wrote {out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
