"""Concurrency on one GPU, one process: batched MGRIT against serial propagation of the dense
ResNet ``x_{k+1} = x_k + h tanh(x_k W_k^T + b_k)`` (float32), and the cost of staging MPI
messages and gradient buckets through host memory. Called by ``gpu_session.py``
(:func:`run_concurrency`, :func:`run_staging`); every time is a CUDA-event time (host clock
on the CPU) after warm-up: median, quartiles, min, max and the repeat count.

Variants per configuration (``N`` layers, width ``w``, batch ``B``, coarsening ``m``):

* ``serial_eager``: the ``nn.Sequential`` (``LayerParallelResNet.to_serial``): forward under
  ``no_grad``; training step = forward, ``mean(out^2)``, autograd backward, ``SGD(foreach)``;
* ``lean_eager``: :class:`mgrit.perf.LeanResNet` (stacked weights, fused ops with ``out=``,
  closed-form backward, SGD on the stacked tensors);
* ``lean_graph``: the lean loop captured once in a CUDA graph and replayed (no launch gaps:
  the strongest serial we have); output checked against eager before timing;
* ``lean_compiled`` / ``lean_compiled_graph``: ``torch.compile`` (inductor) of the lean loop in
  blocks of 16 layers, and that captured in a CUDA graph (= ``mode="reduce-overhead"``), only
  where ``compile_widths`` allows (compilation costs device time);
* ``mgrit``: :class:`mgrit.nn.LayerParallelResNet`, 2 levels, cfactor ``m``, relax F, 2 forward
  / 1 adjoint cycles (inexact, fixed cycles; no warm start); its forward's relative error
  against the serial output is reported beside its time;
* ``mgrit_graph``: an attempt to capture the MGRIT forward in a CUDA graph (the error is
  reported where the solver synchronizes with the host).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from mgrit.comm import _as_bytes
from mgrit.nn import LayerParallelResNet, make_step
from mgrit.options import MGRITOptions
from mgrit.perf.lean import LeanResNet, compiled_forward, compiled_train_step

__all__ = ["run_concurrency", "run_staging", "timeit"]

LR = 1e-3


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timeit(fn, dev, min_reps=5, max_reps=40, min_time=0.4, warmup=2):
    """Median and spread of ``fn()``'s time in seconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    ts, t_start = [], time.perf_counter()
    while len(ts) < max_reps and (len(ts) < min_reps or time.perf_counter() - t_start < min_time):
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        if len(ts) == 1 and ts[0] > 1.0:
            min_reps = 3
    q = np.percentile(ts, [0, 25, 50, 75, 100])
    return {"median_s": float(q[2]), "q1_s": float(q[1]), "q3_s": float(q[3]),
            "min_s": float(q[0]), "max_s": float(q[4]), "reps": len(ts)}


def _graph(fn, dev):
    """``fn`` captured in a CUDA graph (after two warm-up calls on a side stream)."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _models(n, width, m, dev, seed=0, levels=2):
    torch.manual_seed(seed)
    fwd = MGRITOptions(max_levels=levels, cfactor=m, relax="F", tol=0, max_iter=2)
    bwd = MGRITOptions(max_levels=levels, cfactor=m, relax="F", tol=0, max_iter=1)
    lp = LayerParallelResNet.build(lambda k: make_step("dense", width, "tanh"), n, (width,),
                                   forward=fwd, backward=bwd, warm_start=False, seed=seed)
    ser = lp.to_serial()
    lean = LeanResNet.from_sequential(ser)
    lean = LeanResNet(*(t.to(dev) for t in lean.weights()), lean.h, lean.act)
    return lp.to(dev), ser.to(dev), lean


def _train(net, opt, x):
    def step():
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        opt.step()
    return step


def bench_config(n, width, batch, m, dev, log):
    """All variants of one configuration; returns ``{variant: {"fwd": stats, "train": stats}}``
    plus checks (graph outputs against eager, MGRIT's forward error)."""
    lp, ser, lean = _models(n, width, m, dev)
    x = torch.randn(batch, width, device=dev)
    row = {"N": n, "width": width, "batch": batch, "m": m, "variants": {}, "checks": {}}
    V = row["variants"]
    with torch.no_grad():
        ref = ser(x)
        row["checks"]["mgrit_fwd_rel_err"] = _rel(lp(x), ref)
        row["checks"]["lean_fwd_rel_err"] = _rel(lean.forward(x).clone(), ref)
    nograd = torch.no_grad()

    def fwd_of(net):
        def f():
            with nograd:
                return net(x)
        return f
    V["serial_eager"] = {"fwd": timeit(fwd_of(ser), dev),
                         "train": timeit(_train(ser, torch.optim.SGD(ser.parameters(), lr=LR, foreach=True), x), dev)}
    log(f"  serial_eager fwd {V['serial_eager']['fwd']['median_s']*1e3:.2f} ms")
    V["mgrit"] = {"fwd": timeit(fwd_of(lp), dev),
                  "train": timeit(_train(lp, torch.optim.SGD(lp.parameters(), lr=LR, foreach=True), x), dev)}
    log(f"  mgrit fwd {V['mgrit']['fwd']['median_s']*1e3:.2f} ms")
    V["lean_eager"] = {"fwd": timeit(lambda: lean.forward(x), dev),
                       "train": timeit(lambda: lean.train_step(x, LR), dev)}
    if dev.type == "cuda":
        V["lean_graph"] = _graph_variant(lean, x, dev, row["checks"], "lean_graph",
                                         lambda: lean.forward(x), lambda: lean.train_step(x, LR))
    V["lean_eager_again"] = {"fwd": timeit(lambda: lean.forward(x), dev)}  # run-to-run spread
    return row


def bench_compiled(row, dev, log):
    """Add ``lean_compiled`` and ``lean_compiled_graph`` to ``row`` (a :func:`bench_config`
    result; the models are rebuilt from the same seed)."""
    n, width, batch, m = row["N"], row["width"], row["batch"], row["m"]
    _, _, lean = _models(n, width, m, dev)
    x = torch.randn(batch, width, device=dev)
    V, checks = row["variants"], row["checks"]
    try:
        t0 = time.perf_counter()
        cf, ct = compiled_forward(lean), compiled_train_step(lean)
        with torch.no_grad():
            checks["lean_compiled_fwd_rel_err"] = _rel(cf(x), lean.forward(x).clone())
        ct(x, LR)
        _sync(dev)
        checks["compile_s"] = time.perf_counter() - t0
        log(f"  compiled in {checks['compile_s']:.1f} s")
        V["lean_compiled"] = {"fwd": timeit(lambda: cf(x), dev), "train": timeit(lambda: ct(x, LR), dev)}
        if dev.type == "cuda":
            V["lean_compiled_graph"] = _graph_variant(lean, x, dev, checks, "lean_compiled_graph",
                                                      lambda: cf(x), lambda: ct(x, LR))
    except Exception as e:  # noqa: BLE001 -- reported, not hidden
        checks["lean_compiled_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"  compile failed: {checks['lean_compiled_error']}")


def _graph_variant(lean, x, dev, checks, name, fwd, train):
    """Capture ``fwd`` and ``train`` in CUDA graphs; check the replays against eager first."""
    out = {}
    try:
        g, o = _graph(fwd, dev)
        want = fwd().clone()
        o.fill_(float("nan"))
        g.replay()
        checks[f"{name}_fwd_vs_eager"] = _rel(o, want)
        out["fwd"] = timeit(g.replay, dev)
        saved = [t.clone() for t in (lean.WT, lean.b)]
        gt, _ = _graph(train, dev)  # captured after 2 warm-up steps: restore, then compare
        lean.WT.copy_(saved[0]), lean.b.copy_(saved[1])
        train()
        want = lean.WT.clone()
        lean.WT.copy_(saved[0]), lean.b.copy_(saved[1])
        gt.replay()
        checks[f"{name}_train_vs_eager"] = _rel(lean.WT - saved[0], want - saved[0])
        out["train"] = timeit(gt.replay, dev)
    except Exception as e:  # noqa: BLE001 -- reported, not hidden
        checks[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def try_mgrit_graph(n, width, batch, m, dev):
    """Try to capture the MGRIT forward (no_grad) in a CUDA graph; its time and error against
    eager MGRIT, or the reason it cannot be captured."""
    lp, _, _ = _models(n, width, m, dev)
    x = torch.randn(batch, width, device=dev)
    try:
        with torch.no_grad():
            want = lp(x).clone()
            g, o = _graph(lambda: lp(x), dev)
            g.replay()
            return {"fwd": timeit(g.replay, dev), "rel_err_vs_eager": _rel(o, want)}
    except Exception as e:  # noqa: BLE001 -- reported, not hidden
        torch.cuda.synchronize(dev)
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}


def run_concurrency(dev, configs, batch, compile_widths, deadline, log, compile_margin=45):
    """Every configuration ``(N, width, m)`` in order until ``deadline`` (time.time()), then
    the compiled variants of the widths in ``compile_widths`` while ``compile_margin`` seconds
    are left; returns the rows and what was skipped for time."""
    rows, skipped = [], []
    for n, width, m in configs:
        if time.time() > deadline:
            skipped.append(f"N={n} w={width}")
            continue
        log(f"[bench] N={n} width={width} batch={batch} m={m}")
        rows.append(bench_config(n, width, batch, m, dev, log))
    for row in sorted(rows, key=lambda r: -r["N"]):  # the deepest first (the target)
        if row["width"] in compile_widths:
            if time.time() + compile_margin > deadline:
                skipped.append(f"compiled N={row['N']} w={row['width']}")
                continue
            log(f"[bench] compiled lean N={row['N']} width={row['width']}")
            bench_compiled(row, dev, log)
    return rows, skipped


def run_staging(dev, sizes, pinned=True):
    """Time of staging ``nbytes`` through host memory as the library does (``mgrit.comm``:
    ``.cpu()`` into pageable memory before a send, ``.to(device)`` after a receive), and with a
    pinned buffer for comparison. ``sizes``: ``{name: number of float32 values}``."""
    out = {}
    for name, count in sizes.items():
        t = torch.randn(int(count), device=dev)
        host = _as_bytes(t)
        r = {"bytes": int(count) * 4,
             "d2h_pageable": timeit(lambda: _as_bytes(t), dev, min_reps=10, min_time=0.2),
             "h2d_pageable": timeit(lambda: torch.from_numpy(host).view(torch.float32).to(dev), dev,
                                    min_reps=10, min_time=0.2)}
        if pinned and dev.type == "cuda":
            pin = torch.empty(int(count), pin_memory=True)
            r["d2h_pinned"] = timeit(lambda: pin.copy_(t), dev, min_reps=10, min_time=0.2)
            r["h2d_pinned"] = timeit(lambda: t.copy_(pin, non_blocking=True), dev, min_reps=10,
                                     min_time=0.2)
        out[name] = r
    return out
