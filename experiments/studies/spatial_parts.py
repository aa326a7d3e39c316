"""The measurements of ``experiments/studies/study_spatial.py`` (spatial coarsening in
space-time MGRIT), run under ``mpiexec -n 2`` as its worker: per configuration (a conv ResNet
of the main job on a bundled data set), the convergence factors per cycle of exact forward and
adjoint solves, time-only vs space-time; the gradient error of the inexact training step (the
main job's cycles) against serial autograd, beside the time-only run; and the cost per cycle
and per training step on 1 process and on 2 ranks against the serial step (per-rank CPU time,
``time.process_time``, interleaved repeats). Writes one JSON; the report is the study's.

The networks are :func:`mgrit.models.build_model` ``("resnet", ...)`` of a
:class:`layerpar.jobconfig.JobConfig` -- the main job's network with its initial weights
(seeded) -- and the spatial option the job's ``--spatial-coarsening`` gives
(:func:`mgrit.models.options.spatial_option`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from data import load_dataset  # noqa: E402
from experiments.benchmarks.baselines_common import (interleave, net_grad_error,  # noqa: E402
                                                     try_compile)
from layerpar.jobconfig import JobConfig  # noqa: E402
from mgrit.models import build_model  # noqa: E402

#: name -> (data set, the job's network flags as JobConfig fields): the study's configurations
CONFIGS = {
    "mnist5k-conv": ("mnist5k", dict(step="conv", channels=4, activation="tanh", T=1.0)),
    "voxels-conv": ("voxels", dict(step="conv", channels=4, activation="tanh", T=1.0)),
}


def spatial_text(levels: tuple) -> str:
    """The arm's name: ``time-only`` or ``space-time (levels 1,2)``."""
    return "time-only" if not levels else f"space-time (levels {','.join(map(str, levels))})"


def spatial_arms(L: int) -> list:
    """The spatial options compared at ``L`` levels: none, level 1, and (L = 3) levels 1, 2."""
    return [(), (1,)] + ([tuple(range(1, L))] if L > 2 else [])


def config(name: str, layers: int, m: int, L: int, levels: tuple, tol: float, K_f: int,
           K_b: int, seed: int = 0) -> JobConfig:
    """The main job's settings of one measured network (float64 or not is the caller's
    default dtype): exact with ``tol > 0`` (at most ``K_f``/``K_b`` cycles), else exactly
    ``K_f`` forward and ``K_b`` adjoint cycles; cold starts (no warm start)."""
    dataset, net = CONFIGS[name]
    return JobConfig(dataset=dataset, layers=layers, levels=L, cfactor=m, relax="FCF",
                     tol=tol, fwd_iters=K_f, bwd_iters=K_b, warm_start=False, seed=seed,
                     spatial_coarsening=",".join(map(str, levels)), **net)


def batch(name: str, n: int, dtype) -> tuple:
    """The first ``n`` training samples of the configuration's data set (normalized)."""
    train, _ = load_dataset(CONFIGS[name][0], seed=0, normalize=True)
    return (torch.as_tensor(train.x[:n], dtype=dtype), torch.as_tensor(train.y[:n]))


def build(cfg: JobConfig, x, classes: int, comm):
    """The layer-parallel network of ``cfg`` on ``comm`` in the default dtype."""
    return build_model("resnet", cfg, tuple(x.shape[1:]), classes,
                       comm=comm).to(torch.get_default_dtype())


def factor(res) -> float:
    """Geometric mean of ``r_{k+1} / r_k`` over the cycles before round-off (relative 1e-11
    or absolute 1e-13); NaN without two residuals."""
    r = [float(v) for v in res]
    ratios = []
    for i in range(len(r) - 1):
        if r[i] <= 0 or r[i + 1] <= 1e-11 * r[0] or r[i + 1] < 1e-13:
            break
        ratios.append(r[i + 1] / r[i])
    if not ratios:
        return r[1] / r[0] if len(r) > 1 and r[0] > 0 else float("nan")
    return math.exp(sum(math.log(v) for v in ratios) / len(ratios))


def convergence(name, layers, ms, Ls, x, y, classes, comm, iters) -> list:
    """Rows ``{config, m, L, arm, fwd_factor, adj_factor, fwd_cycles, adj_cycles, fwd_res,
    adj_res}`` of exact solves (tol 1e-10, at most ``iters`` cycles, cold start) on ``comm``
    (the residual histories do not depend on the rank count)."""
    rows = []
    for m in ms:
        for L in Ls:
            for arm in spatial_arms(L):
                net = build(config(name, layers, m, L, arm, 1e-10, iters, iters), x, classes,
                            comm)
                net.loss(net(x), y, F.cross_entropy).backward()
                rn = net.segments[0]
                fr, ar = list(rn.last_forward.residuals), list(rn.last_backward.residuals)
                rows.append({"config": name, "m": m, "L": L, "arm": spatial_text(arm),
                             "levels": list(arm), "fwd_factor": factor(fr),
                             "adj_factor": factor(ar), "fwd_cycles": len(fr) - 1,
                             "adj_cycles": len(ar) - 1, "fwd_res": fr, "adj_res": ar})
    return rows


def gradient_errors(name, layers, m, Ls, x, y, classes, comm, K_f, K_b) -> list:
    """Rows ``{config, m, L, arm, grad_error}``: the relative gradient error of one inexact
    training step (``K_f``/``K_b`` cycles, cold start) against serial autograd on the same
    batch and weights (:func:`~experiments.benchmarks.baselines_common.net_grad_error`)."""
    rows = []
    for L in Ls:
        for arm in spatial_arms(L):
            net = build(config(name, layers, m, L, arm, 0.0, K_f, K_b), x, classes, comm)
            err = net_grad_error(net, x, y, F.cross_entropy, comm)
            rows.append({"config": name, "m": m, "L": L, "arm": spatial_text(arm),
                         "levels": list(arm), "grad_error": err})
    return rows


def _idle_barrier(comm) -> None:
    """A barrier that sleeps while it waits (no busy polling on a shared machine)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def _on_rank0(world, fn):
    """A timer: ``fn`` on world rank 0 alone (the other ranks sleep in a barrier); its CPU
    seconds on every rank."""
    def timer():
        dt = 0.0
        if world.Get_rank() == 0:
            t = time.process_time()
            fn()
            dt = time.process_time() - t
        _idle_barrier(world)
        return world.bcast(dt, root=0)
    return timer


def _on_all(world, fn):
    """A timer: ``fn`` on every rank; the largest per-rank CPU seconds (MPI's waiting included:
    the implementation may poll)."""
    def timer():
        _idle_barrier(world)
        t = time.process_time()
        fn()
        return world.allreduce(time.process_time() - t, op=MPI.MAX)
    return timer


def _train_step(net, x, y):
    def step():
        for p in net.parameters():
            p.grad = None
        net.loss(net(x), y, F.cross_entropy).backward()
    return step


def _cycle(net, x):
    def one():
        with torch.no_grad():
            net(x)
    return one


def timings(name, layers, m, Ls, x, y, classes, world, K_f, K_b, repeats,
            compile_serial: bool = False) -> tuple[dict, str]:
    """``({option: [CPU seconds per repeat]}, note)`` of the serial training step (eager
    autograd of the serial twin of the network; with ``compile_serial`` also its
    ``torch.compile``, or the note why it does not compile), the layer-parallel training
    step (``K_f``/``K_b`` cycles, warm-started as in training) and one forward cycle (``torch.no_grad``, one cycle, solve
    set-up included) of every arm at every ``L``, on 1 process (rank 0) and on the ranks of
    ``world``; interleaved repeats after one warm-up round."""
    timers, note = {}, "torch.compile not measured"
    serial = build(config(name, layers, m, Ls[0], (), 0.0, K_f, K_b), x, classes,
                   MPI.COMM_SELF).to_serial()

    def serial_step(model):
        def step():
            for p in serial.parameters():
                p.grad = None
            F.cross_entropy(model(x), y).backward()
        return step
    timers["serial (eager autograd), P = 1"] = _on_rank0(world, serial_step(serial))
    if compile_serial:  # rank 0 compiles; every rank learns whether it did
        fn = None
        if world.Get_rank() == 0:
            fn, note = try_compile(lambda: torch.compile(serial), lambda f: serial_step(f)())
        ok, note = world.bcast((fn is not None, note), root=0)
        if ok:
            timers["serial (torch.compile), P = 1"] = _on_rank0(
                world, serial_step(fn) if fn is not None else None)
    for L in Ls:
        for arm in spatial_arms(L):
            label = f"m = {m}, L = {L}, {spatial_text(arm)}"
            for P, comm in ((1, MPI.COMM_SELF), (world.Get_size(), world)):
                if P == 1 and world.Get_rank() != 0:
                    fn = cyc = None
                else:
                    cfg = config(name, layers, m, L, arm, 0.0, K_f, K_b)
                    net = build(dataclasses.replace(cfg, warm_start=True), x, classes, comm)
                    one = build(dataclasses.replace(cfg, fwd_iters=1), x, classes, comm)
                    fn, cyc = _train_step(net, x, y), _cycle(one, x)
                wrap = _on_rank0 if P == 1 else _on_all
                timers[f"step: {label}, P = {P}"] = wrap(world, fn)
                timers[f"cycle: {label}, P = {P}"] = wrap(world, cyc)
    interleave(timers, 1)  # warm-up (first calls allocate, warm starts fill)
    return interleave(timers, repeats), note
