"""Study: time to a fixed validation accuracy, in wall-clock seconds, on this machine's 2 ranks --
serial (eager, torch.compile, and the lean loop with the same optimizer, eager and compiled), data
parallelism, pipelining (``torch.distributed.pipelining``) and layer-parallel MGRIT (inexact,
the main job's solver defaults, the gradient-bias monitor on).

Launch (2 ranks)::

    mpiexec -n 2 python -m mpi4py experiments/studies/time_to_accuracy.py --full
    mpiexec -n 2 python -m mpi4py experiments/studies/time_to_accuracy.py --smoke --out /tmp/x

Networks (dense tanh ResNets on mnist5k, ``T = 1``, SGD lr 0.01 momentum 0.9: the main job's
optimizer): ``mainjob`` -- ``experiments/train.py``'s defaults (32 steps of width 32, batch 50);
``deep`` -- ``N = 1024``, width 8, batch 64: declared before any run as the network of issue 34's
step profile (``experiments/benchmarks/profile_step.py``), not picked by an outcome.

Data: mnist5k's 4,000 training images split into the first 3,500 (training) and the last 500
(**validation**: every choice and the stopping rule); the 1,000 test images are only reported
(final test accuracy), never used for a choice.

Rule, fixed before any reported run (per network):

1. **Target.** A pilot serial (eager) run with seed 1000 (not a reported seed) trains
   ``pilot_epochs`` epochs (3; ``--smoke``: 1); the target is ``0.95 x`` its validation accuracy
   at the end (:func:`experiments.reports.time_to_target.target_from_pilot`). Stored in the
   results.
2. **Runs.** Every method trains the same network (same initial weights and batch order per
   seed: seeds 0..4, the methods interleaved per seed; an epoch is a seeded permutation of the
   3,500 images in full batches), evaluating validation loss and accuracy every ``every`` steps
   (10 on ``mainjob``, 9 on ``deep``: about 6-7 evaluations per epoch) on the serial-equivalent
   weights (rank 0, exact serial forward); it stops at the first evaluation at or above the
   target, or at the cap of ``cap_epochs`` epochs (6 on ``mainjob``, 5 on ``deep``: more than
   the pilot's 3 epochs: room for a method that learns slower per step). The training clock is
   the wall time of the steps (max over the ranks, after a barrier), evaluation and weight
   gathering excluded; it includes everything else a user pays: torch.compile's compilation in
   the first steps (each run in a fresh inductor cache, :func:`experiments.measure.
   compile_cache`: no order effects), the bias monitor's checks. Per block of steps also the
   process CPU time (max over the ranks) and the 1-minute load (the load gate,
   :func:`experiments.measure.load_gate`: an unreliable run gets no verdict).
3. **Time to target** = steps to the target x the median time per step after the first block
   (:func:`experiments.measure.time_to_target`), beside the clock at the first evaluation at or
   above the target (:func:`~experiments.reports.time_to_target.first_crossing`); mean and
   Student-t 95% interval over the seeds that reached it, with the count. Final test accuracy:
   the weights at the stop.
4. **Verdict** declared in code before the runs (:data:`DECLARED`): MGRIT against the fastest
   other method, speed-up interval over the seeds (paired log ratios) above 1.

Methods: ``serial`` (rank 0 alone, plain PyTorch loop; the other rank sleeps); ``serial
compiled`` (the same with the residual steps torch.compile'd in blocks of 64, one graph reused);
``lean serial`` / ``lean serial compiled`` (rank 0: the residual body as the lean loop with the
same momentum SGD on its stacked tensors, :class:`~experiments.benchmarks.job_baselines.
LeanJob`; every serial variant is reported, none is picked); ``data parallel`` (both ranks, half
the batch each, :class:`~mgrit.parallel.GradientBuckets`); ``pipeline``
(:class:`~experiments.benchmarks.job_baselines.TorchJobPipeline`: ``torch.distributed.
pipelining`` over gloo, half the layers per rank; schedule (GPipe, 1F1B) and micro-batch count
M (dividing the batch, from {1, 2, 4, 5, 8}) by the fastest median of 3 steps on a throwaway
copy, every candidate reported -- they change no number, only the time); ``MGRIT`` (``build_model(..., comm)``
with :class:`layerpar.jobconfig.JobConfig`'s defaults -- 3 levels, coarsening factor 4, F,FCF-
relaxation, 2 forward / 1 adjoint cycles, warm start -- in :class:`~mgrit.training.Trainer` with
:class:`~mgrit.training.bias.BiasMonitor` ``action="raise"`` and the job's ``--bias-*``
defaults: a check every 50 steps, ratio 0.5, window 2; ``--smoke`` checks every 10 steps so that
its short runs check at all). The job's warn-only convergence guard is left out (it changes
nothing in training).

Output (``experiments/results/studies/time_to_accuracy/``): ``table.md``, ``summary.md``,
``headline.json``, ``results.json`` (every curve of every run, the pilots, the targets, the
settings, the bias monitor's checks), ``<network>_curves.png`` (validation accuracy and loss
against the training clock, every method and seed on the same axes, the target as a line).

Cost: ``--smoke`` (1,000 training images, deep N = 64, 1 seed, no compile): ~1 min on 2 idle
cores. ``--full``: 662 s at 48a9d82 before the lean and pipeline methods and the fresh compile
cache per run; now estimated 20-25 min on 2 idle cores (2 compiled methods x 10 runs each pay
their compilation); ``--no-compile`` leaves the compiled methods out.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "experiments", "results", "studies")  # default results base

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from data import load_dataset  # noqa: E402
from experiments import measure  # noqa: E402
from experiments.benchmarks.job_baselines import LeanJob, TorchJobPipeline, pick_pipeline  # noqa: E402
from experiments.reports.study_parts import idle_barrier  # noqa: E402
from experiments.verdicts import Comparison, Declaration  # noqa: E402
from experiments.reports.time_to_target import target_from_pilot, write  # noqa: E402
from layerpar.jobconfig import JobConfig  # noqa: E402
from mgrit.models import build_model  # noqa: E402
from mgrit.parallel import GradientBuckets, ProcessGrid  # noqa: E402
from mgrit.training import Trainer, fail_fast  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402
from mgrit.training.bias import BiasMonitor  # noqa: E402

STUDY = "time_to_accuracy"
METHODS = ("serial", "serial compiled", "lean serial", "lean serial compiled", "data parallel",
           "pipeline", "MGRIT")
MICRO = (1, 2, 4, 5, 8)  # pipeline micro-batch candidates (those dividing the batch)
DECLARED = Declaration(
    "experiments/studies/time_to_accuracy.py",
    Comparison("time to target", "MGRIT", "the fastest other method",
               "steps to target x median time per step", "faster", 1.0))
PILOT_SEED, FRACTION, N_VAL, COMPILE_BLOCK = 1000, 0.95, 500, 64
#: name -> layers, width, batch, seeds, pilot epochs, cap epochs, evaluation every k steps
FULL = {"mainjob": dict(layers=32, width=32, batch=50, seeds=5, pilot_epochs=3, cap_epochs=6,
                        every=10),
        "deep": dict(layers=1024, width=8, batch=64, seeds=5, pilot_epochs=3, cap_epochs=5,
                     every=9)}
SMOKE = {"mainjob": dict(FULL["mainjob"], seeds=1, pilot_epochs=1, cap_epochs=2, every=5,
                         bias_every=10),
         "deep": dict(FULL["deep"], layers=64, seeds=1, pilot_epochs=1, cap_epochs=2, every=5,
                      bias_every=10)}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    reporting.add_study_flags(p, "the record (both networks, all seeds); the default")
    p.add_argument("--only", nargs="+", choices=tuple(FULL), default=list(FULL),
                   help="networks to run")
    p.add_argument("--no-compile", action="store_true",
                   help="leave out serial compiled (always in --smoke)")
    a = p.parse_args(argv)
    a.nets = {k: (SMOKE if a.smoke else FULL)[k] for k in a.only}
    a.limit = 1000 if a.smoke else 0
    a.compile = not (a.no_compile or a.smoke)
    return a


def load(limit: int):
    """``(train, val, test)`` as float32 ``(n, 784)`` / int64 tensors: mnist5k's first 3,500
    training images (``limit``: only the first ``limit`` of them), its last 500, its test set."""
    tr, te = load_dataset("mnist5k", flatten=True)
    x, y = (torch.as_tensor(np.asarray(v)) for v in (tr.x, tr.y))
    n = len(y) - N_VAL
    ntr = min(limit, n) if limit else n
    xt, yt = (torch.as_tensor(np.asarray(v)) for v in (te.x, te.y))
    return (x[:ntr].float(), y[:ntr].long()), (x[n:].float(), y[n:].long()), (xt.float(), yt.long())


def config(s, seed: int) -> JobConfig:
    """The main job's settings with this network's sizes (``--smoke``: bias checks every 10
    steps so that its short runs check at all; else the job's default, 50)."""
    c = JobConfig(layers=s["layers"], width=s["width"], batch_size=s["batch"], seed=seed)
    if "bias_every" in s:
        c.bias_every = s["bias_every"]
    return c


def sgd(params, c: JobConfig):
    return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum)


# -- the methods: step(x, y) on the global batch (every rank), model() -> rank 0's serial copy --
class Serial:
    """Plain PyTorch on rank 0; ``compiled``: the residual steps compiled in blocks."""

    def __init__(self, c, world, compiled=False):
        self.rank = world.Get_rank()
        if self.rank:
            return
        self.net = build_model("resnet", c, (784,), 10)
        self.opt = sgd(self.net.parameters(), c)
        self.fwd = self.net
        if compiled:
            mods = list(self.net)
            body = mods[1:1 + c.layers]  # [opening, N residual steps, closing]
            blocks = [torch.compile(nn.Sequential(*body[i:i + COMPILE_BLOCK]))
                      for i in range(0, c.layers, COMPILE_BLOCK)]
            self.fwd = nn.Sequential(mods[0], *blocks, mods[-1])  # same parameters

    def step(self, x, y):
        if self.rank == 0:
            self.opt.zero_grad()
            F.cross_entropy(self.fwd(x), y).backward()
            self.opt.step()

    def model(self):
        return self.net if self.rank == 0 else None


class DataParallel:
    """A replica per rank, half the batch each (equal halves: the mean of the replicas'
    mean losses is the batch's mean loss)."""

    def __init__(self, c, world):
        self.net = build_model("resnet", c, (784,), 10)
        self.opt = sgd(self.net.parameters(), c)
        self.buckets = GradientBuckets(self.net, world)
        rows = torch.tensor_split(torch.arange(c.batch_size), world.Get_size())
        self.rows = rows[world.Get_rank()]

    def step(self, x, y):
        self.buckets.zero_grad()
        F.cross_entropy(self.net(x[self.rows]), y[self.rows]).backward()
        self.buckets.average()
        self.opt.step()

    def model(self):
        return self.net


class LeanSerial:
    """Rank 0: the lean body with the job's optimizer (:class:`LeanJob`); rank 1 sleeps."""

    def __init__(self, c, world, compiled=False):
        self.rank = world.Get_rank()
        if self.rank == 0:
            self.job = LeanJob(build_model("resnet", c, (784,), 10), c.lr, c.momentum,
                               compiled=compiled, block=COMPILE_BLOCK)

    def step(self, x, y):
        if self.rank == 0:
            self.job.step(x, y)

    def model(self):
        return self.job.model() if self.rank == 0 else None


class LayerParallel:
    """MGRIT with the job's solver defaults and the bias monitor (``--bias-monitor raise``)."""

    def __init__(self, c, world):
        self.grid = ProcessGrid(world, data_parallel=1)
        self.net = build_model("resnet", c, (784,), 10, comm=self.grid.layer_comm)
        self.monitor = BiasMonitor(action="raise", every=c.bias_every, ratio=c.bias_ratio,
                                   window=c.bias_window, print_fn=lambda s: None)
        self.trainer = Trainer(self.net, sgd(self.net.parameters(), c), self.grid,
                               callbacks=[self.monitor])
        self.rank = world.Get_rank()

    def step(self, x, y):
        self.trainer.step(x, y)

    def model(self):
        m = self.net.to_serial()  # collective
        return m if self.rank == 0 else None


def make(method, c, world, M=("GPipe", 1)):
    """A fresh run of ``method`` (dynamo reset; the caller gives each run a fresh cache)."""
    torch._dynamo.reset()
    if method in ("serial", "serial compiled"):
        return Serial(c, world, compiled=method == "serial compiled")
    if method in ("lean serial", "lean serial compiled", "data parallel"):
        return DataParallel(c, world) if method == "data parallel" else \
            LeanSerial(c, world, compiled=method.endswith("compiled"))
    if method == "pipeline":
        return TorchJobPipeline(build_model("resnet", c, (784,), 10), c.layers, world, M[0],
                                M[1], c.batch_size, c.lr, c.momentum)
    return LayerParallel(c, world)


# -- the loop ------------------------------------------------------------------------------------
def evaluate(model, data, world):
    """``(loss, accuracy)`` of rank 0's ``model`` on ``data`` (exact serial forward), on every
    rank."""
    out = None
    if world.Get_rank() == 0:
        was = model.training
        model.eval()
        with torch.no_grad():
            o = model(data[0])
            acc = (o.argmax(1) == data[1]).float().mean()
            out = (float(F.cross_entropy(o, data[1])), float(acc))
        model.train(was)
    return world.bcast(out, root=0)


def batches(n, B, seed):
    """Batch index tensors: an epoch is a permutation of the ``n`` samples (``seed``), cut into
    ``n // B`` batches (the remainder dropped); endless."""
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(n)
        for s in range(n // B):
            yield torch.as_tensor(perm[s * B:(s + 1) * B])


def train(m, train_data, val, test, B, seed, every, cap, world, target=None):
    """Train ``m`` until the validation accuracy reaches ``target`` (None: never) or ``cap``
    steps; returns the curve and the final test metrics (every rank)."""
    it = batches(len(train_data[1]), B, seed)
    loss, acc = evaluate(m.model(), val, world)
    curve = {"steps": [0], "clock": [0.0], "val_loss": [loss], "val_acc": [acc],
             "block_wall": [], "block_cpu": [], "load1": [measure.load1()]}
    clock, step, first = 0.0, 0, None
    while step < cap:
        world.Barrier()
        t0, c0, n = time.perf_counter(), time.process_time(), min(every, cap - step)
        for _ in range(n):
            i = next(it)
            m.step(train_data[0][i], train_data[1][i])
            step += 1
            if first is None:
                first = time.perf_counter() - t0
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        idle_barrier(world)  # a rank without work sleeps (serial: rank 1)
        dt, dc = world.allreduce(dt, op=MPI.MAX), world.allreduce(dc, op=MPI.MAX)
        clock += dt
        curve["block_wall"].append(dt / n)  # per step, this block
        curve["block_cpu"].append(dc / n)
        curve["load1"].append(measure.load1())
        loss, acc = evaluate(m.model(), val, world)
        for k, v in zip(("steps", "clock", "val_loss", "val_acc"), (step, clock, loss, acc)):
            curve[k].append(v)
        if target is not None and acc >= target:
            break
    curve["first_step_s"] = world.allreduce(first, op=MPI.MAX)
    curve["gate"] = measure.load_gate(world.bcast(curve["load1"], root=0), world.Get_size())
    curve["test_loss"], curve["test_acc"] = evaluate(m.model(), test, world)
    if isinstance(m, LayerParallel):
        curve["warm_start"] = bool(m.net.segments[0].warm_start)
        curve["bias_checks"] = [{k: e[k] for k in ("step", "bias", "noise", "action", "options")}
                                for e in m.monitor.events]
        m.grid.free()  # the run's sub-communicators
    return curve


def run_network(name, s, a, data, world, log):
    train_data, val, test = data
    per_epoch = len(train_data[1]) // s["batch"]
    cap = s["cap_epochs"] * per_epoch
    pc = config(s, PILOT_SEED)
    pilot = train(Serial(pc, world), train_data, val, test, s["batch"], PILOT_SEED, s["every"],
                  s["pilot_epochs"] * per_epoch, world)
    target = target_from_pilot(pilot["val_acc"], FRACTION)
    log(f"[{name}] pilot (seed {PILOT_SEED}, {s['pilot_epochs']} epochs): val acc "
        f"{pilot['val_acc'][-1]:.4f} -> target {target:.4f}")
    M, m_times = pick_pipeline(lambda cand: make("pipeline", pc, world, cand), MICRO,
                               pc.batch_size, train_data, world)
    methods = [k for k in METHODS if a.compile or not k.endswith("compiled")]
    runs = {k: [] for k in methods}
    for seed in range(s["seeds"]):
        for k in methods:  # interleaved: A B C D E, A B C D E, ...
            c = config(s, seed)
            with measure.compile_cache("fresh"):  # every run pays its own compilation
                curve = train(make(k, c, world, M), train_data, val, test, s["batch"], seed,
                              s["every"], cap, world, target)
            runs[k].append(curve)
            log(f"[{name}] seed {seed} {k}: {curve['steps'][-1]} steps, "
                f"{curve['clock'][-1]:.2f} s, "
                f"val acc {curve['val_acc'][-1]:.4f}, test acc {curve['test_acc']:.4f}")
    return {"settings": dict(s, per_epoch=per_epoch, cap_steps=cap, n_train=len(train_data[1]),
                             n_val=len(val[1]), n_test=len(test[1])),
            "pilot": pilot, "target": target, "pipeline": f"{M[0]} M={M[1]}",
            "pipeline_candidates": {f"{k[0]} M={k[1]}": v for k, v in m_times.items()},
            "runs": runs}


def main(argv=None) -> int:
    world = MPI.COMM_WORLD
    fail_fast(world)
    a = parse(argv)
    if world.Get_size() != 2:
        if world.Get_rank() == 0:
            print(f"time_to_accuracy.py needs 2 ranks (mpiexec -n 2), got {world.Get_size()}",
                  file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(1)
    out_dir = reporting.results_dir(STUDY, a.out or OUT)
    meta = reporting.run_metadata(world_size=world.Get_size())
    DECLARED.freeze(out_dir if world.Get_rank() == 0 else None)  # before any run
    data = load(a.limit)
    t0 = time.perf_counter()
    log = (lambda msg: print(msg, flush=True)) if world.Get_rank() == 0 else (lambda msg: None)
    results = {name: run_network(name, s, a, data, world, log) for name, s in a.nets.items()}
    if world.Get_rank() == 0:
        args = {k: v for k, v in vars(a).items() if k != "nets"}
        rule = {"fraction": FRACTION, "pilot_seed": PILOT_SEED, "n_val": N_VAL,
                "compile_block": COMPILE_BLOCK}
        write(results, reporting.finish_metadata(meta), out_dir, args, rule, DECLARED)
        print(f"[{STUDY}] wrote {out_dir} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
