"""What every timing table of ``experiments/benchmarks/`` shares (issue 24, item 3): the
compiled baselines, interleaved repeats, the gradient error of inexact configurations, the
"vs strongest baseline" column and its verdict sentence, the raw per-repeat JSON.

* :func:`interleave` -- ``repeats`` rounds over the options in a fixed order (A B C A B C ...);
  each option's timer returns the seconds of one run (the scripts' own steady-state timers).
* :func:`try_compile` -- ``torch.compile`` of a baseline, or the first line of the error where
  it does not compile (only :data:`mgrit.perf.lean.COMPILE_ERRORS`, torch.compile's own errors,
  are caught: any other error is a bug and propagates).
* :func:`grad_error` -- ``||g - g_exact|| / ||g_exact||`` over lists of tensors (float64
  accumulation; over the ranks of ``comm`` when the parameters are distributed).
* :func:`net_grad_error` -- the same for a layer-parallel ``mgrit.nn`` network against its
  ``to_serial()`` twin on the same batch.
* :func:`speedups` / :func:`verdict` -- each option's speed-up over the fastest of the strong
  baselines (medians), and the sentence that says where layer-parallel wins and where it loses;
  behind the load gate (issue 34 item 3, :func:`experiments.measure.load_gate`): the gate starts
  when this module is imported (the job's own processes: 2, or :func:`start_gate`) and a
  verdict whose run saw the 1-minute load above them + 0.5 is "no verdict".
* :func:`timing_table` -- one row per option: median [IQR], min-max, speed-up vs the strongest
  baseline, the gradient (or forward) error.
* :func:`cell` -- ``median [q1-q3]`` of :func:`mgrit.reporting.writers.spread`.
* :func:`compile_lean_dp` -- the compiled data-parallel baseline of the lean loop: each rank
  the compiled lean step on its shard, one ``Allreduce`` of the flat gradient (agreed over the
  ranks whether it compiles, before any other communication).
* :func:`raw_path` -- ``<table>.raw.json`` beside ``<table>.md`` (written by ``report.write_raw``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from experiments.measure import UNRELIABLE, LoadGate
from mgrit.perf.lean import COMPILE_ERRORS
from mgrit.reporting.writers import spread

__all__ = ["interleave", "try_compile", "grad_error", "speedups", "verdict", "cell", "raw_path",
           "compile_lean_dp", "timing_table", "net_grad_error",
           "COMPILE_ERRORS", "start_gate", "gate"]

#: the load gate of this run (started at import; :func:`start_gate` restarts it)
_GATE = LoadGate(2)


def start_gate(own: int) -> None:
    """Restart the run's load gate for a job of ``own`` processes (call before timing)."""
    global _GATE
    _GATE = LoadGate(own)


def gate() -> dict:
    """The run's load gate now (:func:`experiments.measure.load_gate`, one more sample)."""
    _GATE.sample()
    return _GATE.result()


def interleave(timers: Mapping[str, Callable[[], float]], repeats: int) -> dict:
    """``{name: [seconds of repeat 0, 1, ...]}``: repeat ``r`` calls every timer once, in the
    mapping's order, before repeat ``r + 1`` starts (A B C A B C ...), so that a slow drift of
    the machine's speed hits every option alike. ValueError for ``repeats < 1``."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is not allowed: use an int >= 1")
    out = {k: [] for k in timers}
    for _ in range(repeats):
        for k, fn in timers.items():
            out[k].append(float(fn()))
    return out


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:200]}"


def try_compile(build: Callable[[], Callable], warm: Callable[[Callable], object] | None = None):
    """``(fn, note)``: ``fn = build()`` (which calls ``torch.compile``) and ``warm(fn)`` (the
    first call, where compilation happens); or ``(None, "does not compile here: <first line>")``
    when either raises one of :data:`COMPILE_ERRORS`."""
    import time
    t0 = time.perf_counter()
    try:
        fn = build()
        if warm is not None:
            warm(fn)
    except COMPILE_ERRORS as e:
        return None, f"does not compile here: {first_line(e)}"
    return fn, f"compiled in {time.perf_counter() - t0:.0f} s"


def grad_error(g: Sequence[torch.Tensor], g_exact: Sequence[torch.Tensor], comm=None) -> float:
    """Relative error ``||g - g_exact|| / ||g_exact||`` of a gradient given as matching lists of
    tensors (each pair the same shape; accumulated in float64). With ``comm`` (mpi4py) the sums
    of squares are added over its ranks (each rank passes its own parameters' parts); every
    rank gets the same value. ValueError for lists of different lengths or shapes; ``inf`` when
    ``g_exact`` is zero and ``g`` is not (0.0 when both are)."""
    g, g_exact = list(g), list(g_exact)
    if len(g) != len(g_exact) or any(a.shape != b.shape for a, b in zip(g, g_exact)):
        raise ValueError(f"grad_error: {len(g)} tensors against {len(g_exact)}, shapes "
                         f"{[tuple(a.shape) for a in g]} vs {[tuple(b.shape) for b in g_exact]}: "
                         "pass the same parameters' gradients in the same order")
    d = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(g, g_exact))
    r = sum(float(b.double().pow(2).sum()) for b in g_exact)
    if comm is not None:
        pairs = comm.allgather((d, r))
        d, r = sum(x for x, _ in pairs), sum(y for _, y in pairs)
    if r == 0.0:
        return 0.0 if d == 0.0 else math.inf
    return math.sqrt(d / r)


def speedups(series: Mapping[str, Sequence[float]], baselines: Sequence[str]) -> tuple[str, dict]:
    """``(strongest, {name: speed-up})``: the baseline of ``baselines`` (those present in
    ``series``) with the lowest median time, and for every option of ``series`` its median time
    relative to it, written as a speed-up ``median(strongest) / median(option)`` (> 1: faster
    than the strongest baseline). ValueError when no baseline is present."""
    present = [b for b in baselines if b in series and len(series[b])]
    if not present:
        raise ValueError(f"none of the baselines {list(baselines)} was measured "
                         f"(options: {list(series)})")
    med = {k: spread(v)["median"] for k, v in series.items() if len(v)}
    best = min(present, key=med.get)
    return best, {k: med[best] / m for k, m in med.items()}


def verdict(what: str, rows: Sequence[tuple[str, float]], strongest: str = "the strongest baseline",
            reliable: bool | None = None) -> str:
    """One sentence from ``rows`` = ``(where, speed-up of layer-parallel vs the strongest
    baseline)``: where layer-parallel wins (speed-up > 1) and where it loses, with the numbers.
    ``reliable``: the load gate's answer (default: :func:`gate` of this run); False: no
    verdict, the numbers are not a result."""
    if reliable is None:
        g = gate()
        reliable, note = g["reliable"], g["note"]
    else:
        note = UNRELIABLE
    if not reliable:
        return f"{what} against {strongest}: no verdict ({note})."
    win = [f"{w} ({s:.2f}x)" for w, s in rows if s > 1.0]
    lose = [f"{w} ({s:.2f}x)" for w, s in rows if s <= 1.0]
    parts = [f"{what} against {strongest}: "]
    parts.append(f"wins at {', '.join(win)}" if win else "wins nowhere")
    parts.append(f"; loses at {', '.join(lose)}." if lose else "; loses nowhere.")
    return "".join(parts)


def cell(values: Sequence[float], scale: float = 1.0, digits: int = 4) -> str:
    """``median [q1-q3]`` of ``values`` times ``scale`` (``digits`` significant digits)."""
    s = spread(values)
    f = lambda v: f"{v * scale:.{digits}g}"  # noqa: E731
    return f"{f(s['median'])} [{f(s['q1'])}-{f(s['q3'])}]"


def raw_path(table: str | Path) -> Path:
    """``<table>.raw.json`` for ``<table>.md`` (the raw per-repeat numbers beside the table)."""
    p = Path(table)
    return p.with_name(p.stem + ".raw.json")


def compile_lean_dp(lean, comm, x_shard, block: int = 16, backend: str = "inductor"):
    """``(fn, note)`` of :func:`compiled_lean_dp`, compiled and warmed on every rank with the
    Allreduce off (lr 0), then agreed over ``comm`` (one ``allgather`` of the notes, no other
    communication before it): ``fn`` on every rank, or ``None`` on every rank with the first
    failing rank's note when any rank's compile failed."""
    state = {"on": False}

    def build():
        from mpi4py import MPI

        from mgrit.perf.lean import compiled_train_step
        P = comm.Get_size()

        def allreduce(net):
            if state["on"]:
                comm.Allreduce(MPI.IN_PLACE, net.grad_flat.numpy(), op=MPI.SUM)
                net.grad_flat.mul_(1.0 / P)
        return compiled_train_step(lean, block, backend, grad_hook=allreduce)
    fn, note = try_compile(build, lambda f: f(x_shard, 0.0))
    notes = comm.allgather((fn is not None, note))
    bad = [n for ok, n in notes if not ok]
    if bad:
        return None, bad[0]
    state["on"] = True
    return fn, max(notes, key=lambda t: t[1])[1]


def timing_table(series: Mapping[str, Sequence[float]], baselines: Sequence[str],
                 labels: Mapping[str, str] | None = None, errors: Mapping[str, str] | None = None,
                 scale: float = 1e3, unit: str = "ms", err_head: str = "gradient error",
                 default_err: str = "exact") -> tuple[list, str, dict]:
    """A timing table, one row per option of ``series`` (per-repeat seconds): median [IQR] and
    min-max (times ``scale``, in ``unit``), the speed-up over the strongest of ``baselines``
    (:func:`speedups`; > 1: faster) and the error column (``errors[name]``, else
    ``default_err``). Returns ``(markdown lines, strongest baseline's name, speed-ups)``."""
    labels, errors = dict(labels or {}), dict(errors or {})
    best, sp = speedups(series, baselines)
    L = [f"| option | time [{unit}]: median [IQR] | min-max | vs strongest baseline "
         f"({labels.get(best, best)}) | {err_head} |", "|---|---|---|---|---|"]
    for k, v in series.items():
        if not len(v):
            continue
        s = spread(v)
        mark = " (baseline)" if k in baselines else ""
        L.append(f"| {labels.get(k, k)}{mark} | {cell(v, scale)} | {s['min'] * scale:.4g}-"
                 f"{s['max'] * scale:.4g} | {sp[k]:.2f}x | {errors.get(k, default_err)} |")
    return L, best, sp


def net_grad_error(net, x, target, loss_fn, comm=None) -> float:
    """:func:`grad_error` of every parameter of a layer-parallel network ``net`` (an
    :class:`mgrit.nn.net` model with ``to_serial``, ``named_global_parameters`` and ``loss``)
    after one ``net.loss(net(x), target, loss_fn).backward()`` against serial autograd of
    ``loss_fn(net.to_serial()(x), target)`` (the same weights and batch). Uses ``net``'s current
    warm state (the first call on a fresh network: a cold start); no optimizer step; gradients
    cleared afterwards. Collective over ``net``'s communicator (``comm`` for the sums)."""
    serial = net.to_serial()
    loss_fn(serial(x), target).backward()
    exact = dict(serial.named_parameters())
    for p in net.parameters():
        p.grad = None
    net.loss(net(x), target, loss_fn).backward()
    mine = list(net.named_global_parameters())
    zero = lambda p: torch.zeros_like(p) if p.grad is None else p.grad  # noqa: E731
    err = grad_error([zero(p) for _, p in mine], [zero(exact[k]) for k, _ in mine], comm)
    for p in net.parameters():
        p.grad = None
    return err
