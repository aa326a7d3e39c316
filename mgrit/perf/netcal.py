"""Calibrated :class:`mgrit.perf.strategies.NetCosts` of a network on the machine at hand.

* :func:`lean_costs` -- the lean serial loop of a dense ResNet (:class:`~mgrit.perf.lean.LeanResNet`):
  per-layer forward and forward-with-storing + closed-form backward at each batch size, and the
  SGD step per layer (the kernels of the lean pipeline and data-parallel baselines).
* :func:`module_costs` -- any ``head -> residual steps -> tail + loss`` network run with autograd,
  timed in context (the network truncated to two depths): per-layer costs as the slope, head +
  tail + loss + the engine's fixed costs as the intercept; the optimizer step split by
  parameter count.
* :func:`mgrit_costs` -- MGRIT's :class:`~mgrit.perf.TrainCosts` of the same steps at one batch
  size (:func:`mgrit.perf.calibration.chain_costs` on a one-rank solve of all layers).

Each cost is the median of ``repeats`` timings with ``clock`` (``time.perf_counter``; or
``time.process_time``, the CPU time of a one-thread process, robust on a shared machine).
A residual layer's cost is never zero or negative: a fit the timings cannot resolve (noise on a
loaded machine) is clamped to the clock's measured resolution and noted in
``NetCosts.unreliable`` (:mod:`mgrit.perf.fits`).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

from ..nn import LayerParallelResNet
from ..nn.steps import ResidualStep
from ..options import MGRITOptions
from . import calibration, fits
from .lean import LeanResNet
from .model import StepCost, calibrate_step
from .steptime import TrainCosts
from .strategies import Curve, NetCosts

__all__ = ["lean_costs", "module_costs", "mgrit_costs", "with_mgrit", "batch_sizes", "kernel_cost"]


def batch_sizes(batch: int, extra: Sequence[int] = ()) -> list:
    """The batch sizes a plan needs: powers of two up to ``batch``, ``batch`` and ``extra``."""
    s = {batch, *[b for b in extra if 1 <= b <= batch]}
    s.update(2 ** k for k in range(batch.bit_length()) if 2 ** k <= batch)
    return sorted(s)


def _med(fn: Callable[[], object], repeats: int, clock, between: Callable | None = None) -> float:
    """Median of ``repeats`` timings of ``fn`` after a warm-up; ``between()`` runs untimed
    after each call (e.g. the optimizer step, so that caches are as cold as in training)."""
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
        if between is not None:
            between()
    return statistics.median(ts)


def lean_costs(lean: LeanResNet, sizes: Sequence[int], repeats: int = 5,
               clock=time.perf_counter) -> NetCosts:
    """NetCosts of the lean loop over ``lean``'s layers (no head/tail; loss ``mean(out^2)``)."""
    N, w = lean.n_layers, lean.width
    fwd, fb, notes = [], [], []
    floor = fits.clock_resolution(clock) / N
    for b in sizes:
        x = torch.randn(b, w, dtype=lean.WT.dtype)
        g = torch.randn(b, w, dtype=lean.WT.dtype)
        step = lambda: lean.sgd_step(0.0)  # noqa: E731 (between timings: caches as in training)
        fwd.append(fits.at_least_floor(_med(lambda: lean.forward(x), repeats, clock, step) / N, floor,
                                       f"per-layer forward cost at batch {b}", notes))
        fb.append(fits.at_least_floor(
            _med(lambda: (lean.forward_store(x), lean.backward(g)), repeats, clock, step) / N, floor,
            f"per-layer forward + backward cost at batch {b}", notes))
    opt = _med(lambda: lean.sgd_step(0.0), repeats, clock) / N
    es = lean.WT.element_size()
    return NetCosts(N, Curve(tuple(sizes), tuple(fwd)), Curve(tuple(sizes), tuple(fb)),
                    opt_layer=opt, layer_bytes=(w * w + w) * es, state_bytes=w * es,
                    unreliable=tuple(notes))


def _rows(t: torch.Tensor, b: int) -> torch.Tensor:
    """``b`` rows of ``t`` (repeated when ``t`` has fewer)."""
    if t.shape[0] >= b:
        return t[:b]
    return t.repeat((-(-b // t.shape[0]),) + (1,) * (t.dim() - 1))[:b]


def module_costs(head: nn.Module | None, steps: Sequence[nn.Module], h: float,
                 tail: nn.Module | None, loss_fn: Callable, x: torch.Tensor, target,
                 sizes: Sequence[int], repeats: int = 5, clock=time.perf_counter,
                 depth: int = 64, optimizer: Callable | None = None) -> NetCosts:
    """NetCosts of ``head -> x + h F_k(x) (k < N) -> tail -> loss_fn(out, target)`` with
    autograd, measured in context: the network truncated to ``d1 = max(1, d2 // 4)`` and
    ``d2 = min(N, depth)`` residual layers (head, tail and loss included; ``d2 = N``: the whole
    network), forward (no grad) and forward + backward at each batch size of ``sizes``. A
    residual layer costs the slope between the two depths; head + tail + loss cost the
    intercept, split between head and tail as their own timings split (so cache effects and the
    autograd engine's fixed costs of a real step are in the costs). ``x``: a sample batch of
    inputs, ``target``: its targets (sliced like ``x``; any indexable, or None when ``loss_fn``
    ignores it). ``optimizer(params)``: the optimizer to time (default SGD with momentum 0.9 and
    lr 0, so that nothing changes)."""
    N = len(steps)
    head = head or nn.Identity()
    tail = tail or nn.Identity()
    d2 = min(N, depth)
    d1 = max(1, d2 // 4) if d2 > 1 else 0
    body = [ResidualStep(F, h) for F in steps[:d2]]
    nets = {d: nn.Sequential(head, *body[:d], tail) for d in {d1, d2}}
    params = [p for m in (head, *steps, tail) for p in m.parameters() if p.requires_grad]
    curves = {k: [] for k in ("lf", "lfb", "hf", "hfb", "tf", "tfb")}
    notes = []  # fits the timings could not resolve (clamped, see mgrit.perf.fits)
    floor = fits.clock_resolution(clock) / max(d2 - d1, 1)  # a slope's resolution
    with torch.no_grad():
        z0 = head(_rows(x, 1))
    shape = tuple(z0.shape[1:])

    def zero():
        for p in params:
            p.grad = None
    opt = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.0, momentum=0.9)))(params)
    for b in sizes:
        xb, tb = _rows(x, b), (None if target is None else _rows(torch.as_tensor(target), b))
        zb = torch.randn(b, *shape, dtype=z0.dtype)
        gz = torch.randn(b, *shape, dtype=z0.dtype)

        def fb(net):
            zero()
            loss_fn(net(xb), tb).backward()
        with torch.no_grad():
            f = {d: _med(lambda: loss_fn(nets[d](xb), tb), repeats, clock, opt.step) for d in nets}
        t = {d: _med(lambda: fb(nets[d]), repeats, clock, opt.step) for d in nets}
        lf = fits.at_least_floor((f[d2] - f[d1]) / (d2 - d1) if d2 > d1 else 0.0, floor,
                                 f"per-layer forward cost at batch {b} (slope over depths {d1}, {d2})",
                                 notes)
        lfb = fits.at_least_floor((t[d2] - t[d1]) / (d2 - d1) if d2 > d1 else 0.0, floor,
                                  f"per-layer forward + backward cost at batch {b} (slope over depths "
                                  f"{d1}, {d2})", notes)
        curves["lf"].append(lf)
        curves["lfb"].append(lfb)
        with torch.no_grad():  # head and tail on their own: how the intercept splits
            hf = _med(lambda: head(xb), repeats, clock)
            tf = _med(lambda: loss_fn(tail(zb), tb), repeats, clock)

        def head_fb():
            zero()
            y = head(xb)
            if y.requires_grad:  # a head without parameters has no backward
                y.backward(gz)

        def tail_fb():
            zero()
            loss_fn(tail(zb.detach().requires_grad_(True)), tb).backward()
        hfb, tfb = _med(head_fb, repeats, clock), _med(tail_fb, repeats, clock)
        for key, inter, hv, tv in (("f", f[d1] - d1 * lf, hf, tf), ("fb", t[d1] - d1 * lfb, hfb, tfb)):
            share = hv / (hv + tv) if hv + tv > 0 else 0.5
            curves["h" + key].append(max(inter, 0.0) * share)
            curves["t" + key].append(max(inter, 0.0) * (1 - share))
        zero()
    c = {k: Curve(tuple(sizes), tuple(max(v, 0.0) for v in vals)) for k, vals in curves.items()}
    for p in params:
        p.grad = torch.zeros_like(p)
    t_opt = _med(opt.step, repeats, clock)
    zero()
    layer_n = sum(p.numel() for F in steps for p in F.parameters() if p.requires_grad)
    total_n = sum(p.numel() for p in params)
    es = z0.element_size()
    other_n = total_n - layer_n
    per_layer = t_opt * (layer_n / max(total_n, 1)) / N
    return NetCosts(N, c["lf"], c["lfb"], c["hf"], c["hfb"], c["tf"], c["tfb"],
                    opt_layer=per_layer, opt_other=t_opt * other_n / max(total_n, 1),
                    layer_bytes=layer_n * es // N, other_bytes=other_n * es,
                    state_bytes=z0[0].numel() * es, unreliable=tuple(notes))


def mgrit_costs(steps: Sequence[nn.Module], state_shape, T: float, z: torch.Tensor,
                options: MGRITOptions, repeats: int = 3, inner: int = 10,
                clock=time.perf_counter, per_layer_opt: float = 0.0) -> TrainCosts:
    """MGRIT's TrainCosts of ``steps`` (all ``N`` layers on one rank) at the batch of ``z``
    (``(b, *state_shape)``, the residual part's input) with ``options`` (its cfactor sets the
    stride of the timed batched calls). Serial fields are left 0."""
    lp = LayerParallelResNet(list(steps), len(steps), state_shape, T=T, forward=options,
                             backward=options, warm_start=False)
    m = options.cfactor if isinstance(options.cfactor, int) else options.cfactor[0]
    zz = z.detach().requires_grad_(False)
    lp(zz).sum().backward()
    c = calibration.chain_costs(lp, zz, m, clock, repeats, inner, options, per_layer_opt)
    for p in lp.parameters():
        p.grad = None
    return c


def with_mgrit(costs: NetCosts, fn: Callable[[int], TrainCosts]) -> NetCosts:
    """``costs`` with MGRIT costs ``fn(batch)`` (cached per batch size)."""
    cache = {}

    def get(b):
        if b not in cache:
            cache[b] = fn(b)
        return cache[b]
    return NetCosts(**{k: getattr(costs, k) for k in costs.__dataclass_fields__ if k != "mgrit"},
                    mgrit=get)



def kernel_cost(width: int, batch: int, sizes: Sequence[int] = (2, 8, 32, 64), repeats: int = 5,
                inner: int = 10, clock=time.perf_counter, dtype=torch.float32) -> StepCost:
    """The cheapest kernels of one dense tanh step, without any solver: ``single`` = the lean
    loop's ``addmm, tanh_, add_`` on ``(batch, width)``; a batched call over ``B`` intervals =
    ``bmm, add_ (bias), tanh_, add_`` on ``(B, batch, width)`` (or ``baddbmm``, whichever is
    faster here). With :func:`mgrit.perf.simulate` it gives the single-process bound of batched
    MGRIT against the lean loop: what a solver with zero bookkeeping could reach."""
    kw = dict(dtype=dtype)
    W, b = torch.randn(width, width, **kw), torch.randn(width, **kw)
    u, z = torch.randn(batch, width, **kw), torch.empty(batch, width, **kw)
    Bm = max(sizes)
    WB, bB = torch.randn(Bm, width, width, **kw), torch.randn(Bm, 1, width, **kw)
    U, Z = torch.randn(Bm, batch, width, **kw), torch.empty(Bm, batch, width, **kw)

    def single():
        torch.addmm(b, u, W, out=z)
        z.tanh_()
        u.add_(z, alpha=1e-3)

    def bmm(B):
        torch.bmm(U[:B], WB[:B], out=Z[:B])
        Z[:B].add_(bB[:B]).tanh_()
        U[:B].add_(Z[:B], alpha=1e-3)

    def baddbmm(B):
        torch.baddbmm(bB[:B], U[:B], WB[:B], out=Z[:B])
        Z[:B].tanh_()
        U[:B].add_(Z[:B], alpha=1e-3)
    a = calibrate_step(single, bmm, sizes, repeats, inner, clock)
    c = calibrate_step(single, baddbmm, sizes, repeats, inner, clock)
    return min((a, c), key=lambda s: s.batched(Bm))
