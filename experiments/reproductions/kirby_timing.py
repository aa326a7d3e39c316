"""The timing part of ``reproduce_kirby.py`` (issue 24, items 3 and 5): forward and training-step
wall times of MGRIT, the blocking chain and the serial baselines (``nn.Sequential`` and
``torch.compile``), interleaved repeats with their spread and raw per-repeat numbers, the
gradient error of the inexact configuration, and repeated calibrations of the CPU cost model.

Baselines at Kirby's batch 1: the strongest serial baseline is the faster of ``nn.Sequential``
and a ``torch.compile``-d stack (one rank; the chain on P ranks does the same work in sequence
plus messages). Data parallelism does not exist at batch 1 (one sample cannot be split), so no
data-parallel row is measured: the setting does not allow one.

Variants (names in ``results.h5`` and the raw JSON ``timing.raw.json``):

* forward (``no_grad``, one sample, the MGRIT variants warm started from the previous sample):
  ``chain`` (1-level MGRIT = sequential stepping across the ranks), ``mgrit`` (2 levels, FCF,
  batched relaxation), ``mgrit_loop`` (looped relaxation; only N <= ``--loop-max``), and at
  P = 1 ``sequential`` (plain ``nn.Sequential``) and ``compiled`` (``torch.compile``, blocks of
  16 layers, one graph reused).
* training step (opening + residual stack + closing + cross-entropy, forward and backward,
  no optimizer step so every repeat sees the same weights): ``chain_train`` (exact),
  ``kirby_train`` (Kirby's variant: MGRIT forward as above + serial adjoint, an INEXACT
  gradient), and at P = 1 ``sequential_train``, ``compiled_train``.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from mgrit import perf
from mgrit.nn import LayerParallelNet, LayerParallelResNet, serial_resnet
from mgrit.perf.lean import COMPILE_ERRORS

FWD = ("chain", "mgrit", "mgrit_loop", "sequential", "compiled")
TRAIN = ("chain_train", "kirby_train", "sequential_train", "compiled_train")
VARIANTS = FWD + TRAIN
BLOCK = 16  # layers per compiled graph


def compiled_stack(net: nn.Sequential, backend: str):
    """``torch.compile`` of the residual stack ``net`` (``ResidualStep(ConvStep)`` layers, ReLU):
    one graph of ``BLOCK`` layers taking the weights as inputs, applied N / BLOCK times. Checked
    against the eager stack on a random input (max abs difference <= 1e-5 relative) before use;
    returns ``(fn, note)``, ``fn`` None when it does not compile or does not match."""
    N = len(net)
    block = BLOCK if N % BLOCK == 0 else N
    Ws = [layer.F.conv.weight for layer in net]
    bs = [layer.F.conv.bias for layer in net]
    h, pad = net[0].h, net[0].F.conv.padding

    def blockfn(x, W, b):
        for w, c in zip(W, b):
            x = x + h * torch.relu(F.conv2d(x, w, c, padding=pad))
        return x

    cf = torch.compile(blockfn, backend=backend, dynamic=False)

    def fn(x):
        for i in range(0, N, block):
            x = cf(x, Ws[i:i + block], bs[i:i + block])
        return x

    t0 = time.perf_counter()
    try:
        x = torch.randn(1, Ws[0].shape[0], 28, 28)
        with torch.no_grad():
            ref, got = net(x), fn(x)
        x.requires_grad_(True)
        fn(x).sum().backward()  # compiles the training graph too
    except COMPILE_ERRORS as e:
        return None, f"does not compile here: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    err = float((got - ref).abs().max() / ref.abs().max())
    if not err <= 1e-5:
        return None, f"compiled stack differs from the eager one (relative {err:.1e}): not used"
    return fn, f"{backend}, blocks of {block} layers, compiled in {time.perf_counter() - t0:.0f} s"


def interleaved(fns: dict, reps: int, comm) -> dict:
    """Wall seconds (max over the ranks of ``comm``) of ``reps`` rounds of every ``fn(i)``,
    interleaved A B C A B C ...; one untimed warm-up round first (no warm start yet)."""
    out = {k: [] for k in fns}
    for i in range(reps + 1):
        for k, fn in fns.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn(i)
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i:
                out[k].append(dt)
    return out


def _rel_grad_error(a: nn.Module, b: nn.Module, comm) -> float:
    """``||g_a - g_b|| / ||g_b||`` over all parameters of two identically built networks (the
    same parameters on the same ranks, in the same order), norms summed over ``comm``."""
    num = den = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        if q.grad is None:
            continue
        ga = p.grad if p.grad is not None else torch.zeros_like(q.grad)
        num += float((ga - q.grad).pow(2).sum())
        den += float(q.grad.pow(2).sum())
    num, den = comm.allreduce(num), comm.allreduce(den)
    return float(np.sqrt(num / den))


def measure(ctx, comm, N: int, xs, ys, train: bool, compile_backend):
    """Every variant at depth ``N`` on the ranks of ``comm`` (serial ones only on 1 rank).
    ``ctx``: ``reproduce_kirby`` (builders and options), ``xs`` lifted forward inputs and
    ``ys``/``raw`` the training samples. Returns ``(samples, grad_error, notes)``."""
    a = ctx.ARGS
    P, notes = comm.Get_size(), {}

    def resnet(levels, batched):
        return LayerParallelResNet.build(ctx.make_step(a), N, (a.channels, 28, 28), comm=comm,
                                         seed=a.seed, T=N * a.h,
                                         forward=ctx.fwd_opts(a.iters, ctx.cf(a, N), levels, batched),
                                         adjoint="serial")

    def no_grad(f):
        def g(i):
            with torch.no_grad():
                f(i)
        return g

    nets = {"chain": resnet(1, True), "mgrit": resnet(2, True)}
    if N <= a.loop_max:
        nets["mgrit_loop"] = resnet(2, False)
    fns = {k: no_grad(lambda i, rn=rn: rn(xs[i % len(xs)] if rn.is_first else None, batch_size=1))
           for k, rn in nets.items()}
    if P == 1:
        seq = serial_resnet(ctx.make_step(a), N, T=N * a.h, seed=a.seed)
        fns["sequential"] = no_grad(lambda i: seq(xs[i % len(xs)]))
        if compile_backend:
            cfn, notes["compiled"] = compiled_stack(seq, compile_backend)
            if cfn is not None:
                fns["compiled"] = no_grad(lambda i: cfn(xs[i % len(xs)]))
    grad_error = float("nan")
    if train:
        raw, lab = ys

        def lpnet(levels):
            rn = resnet(levels, True)
            torch.manual_seed(a.seed + 1)
            return LayerParallelNet(ctx.opening(a), rn, ctx.closing(a))

        tnets = {"chain_train": lpnet(1), "kirby_train": lpnet(2)}

        def lp_step(net, i):
            for p in net.parameters():
                p.grad = None
            net.loss(net(raw[i % len(raw)]), lab[i % len(lab)]).backward()

        for k, net in tnets.items():
            fns[k] = lambda i, net=net: lp_step(net, i)
        if P == 1:
            torch.manual_seed(a.seed + 1)
            op, cl = ctx.opening(a), ctx.closing(a)
            full = nn.Sequential(op, seq, cl)

            def seq_step(fwd, i):
                for p in full.parameters():
                    p.grad = None
                F.cross_entropy(cl(fwd(op(raw[i % len(raw)]))), lab[i % len(lab)]).backward()

            fns["sequential_train"] = lambda i: seq_step(seq, i)
            if "compiled" in fns:
                fns["compiled_train"] = lambda i: seq_step(cfn, i)
    samples = interleaved(fns, a.reps, comm)
    if train:
        # inexact (Kirby: MGRIT forward, 2 iterations, warm started as in training) vs exact
        # backprop (the chain) at the same weights on the same sample
        for net in tnets.values():
            lp_step(net, 0)
        grad_error = _rel_grad_error(tnets["kirby_train"], tnets["chain_train"], comm)
    return samples, grad_error, notes


def calibrations(ctx, x, count: int):
    """``count`` independent calibrations of the step cost (``reproduce_kirby.calibrate``)."""
    return [ctx.calibrate(ctx.ARGS, x) for _ in range(count)]


def modeled(ctx, taus, comm_cost, nbytes):
    """Per calibration and ``(N, P)`` of the model grid: the modeled chain forward time
    (``perf.layerwise_time``) and MGRIT forward time (the cheaper of batched and looped
    relaxation in ``perf.simulate``). Rows ``(cal, N, P, t_chain, t_mgrit)``."""
    a, rows = ctx.ARGS, []
    for c, tau in enumerate(taus):
        for N, P in ctx.model_grid(a):
            o = ctx.fwd_opts(a.iters, ctx.cf(a, N))
            lw = perf.layerwise_time(N, P, tau.single, comm_cost.message(nbytes))
            crit = min(perf.simulate(N, P, o, iterations=a.iters, batched=b, tau=tau,
                                     comm=comm_cost, nbytes=nbytes).critical_path
                       for b in (True, False))
            rows.append((c, N, P, lw, crit))
    return rows
