"""The timing part of ``reproduce_guenther.py`` (issue 24, items 3 and 5): measured wall time per
objective evaluation (forward + gradient, full batch) of serial and simultaneous training at
P = 1 and the world size, at the study's depth and a deeper one, interleaved repeats with their
spread and raw per-repeat numbers (``timing.raw.json``), the gradient error of the inexact
(simultaneous) evaluation, and ``--calibrations`` repeated calibrations of the cost model
(``reproduce_guenther.modeled_time``): its error at every measured point and the spread of every
extrapolated number over the calibrations (``model_check``).

Methods: ``serial`` (the library's exact path: 1-level MGRIT = sequential stepping across the
ranks), ``simultaneous`` (Günther's inexact evaluation), and the exact baselines a user has:
``compiled`` (the same objective with the residual stack under ``torch.compile``, blocks of
layers with the weights as inputs; one graph for every depth) on one rank, and at P > 1
``data_parallel`` / ``compiled_dp`` (each rank evaluates the serial / compiled objective on its
share of the full batch, then one allreduce of the gradient). The compiled objective is checked
against the serial one (relative gradient difference <= 1e-8, float64) before it is timed."""
from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from experiments.reproductions import model_check as mc
from experiments.reproductions.guenther_problem import Problem
from mgrit.nn import SmoothReLU
from mgrit.reporting import writers as reporting

METHODS = ("serial", "simultaneous", "compiled", "data_parallel", "compiled_dp")
LAYER_METHODS = METHODS[:2]  # layer-parallel over the ranks; the others: 1 rank or data parallel


def block_size(depths) -> int:
    """Layers per compiled graph: the largest divisor <= 16 of every depth (one graph for all)."""
    return max(d for d in range(1, 17) if all(n % d == 0 for n in depths))


def _block(u, W, b, h, eps):
    """Residual layers ``u + h SmoothReLU(W u + b)`` (:class:`mgrit.nn.SmoothReLU`'s formula)."""
    for w, c in zip(W, b):
        z = F.linear(u, w, c)
        act = torch.where(z >= eps, z, torch.where(z <= -eps, torch.zeros_like(z),
                                                   (z + eps) ** 2 / (4 * eps)))
        u = u + h * act
    return u


def compiled_objective(prob, block: int, backend: str = "inductor"):
    """``fn(x, y) -> (J, local flat gradient)``: ``prob``'s objective (a 1-rank ``Problem``)
    with its residual stack compiled in graphs of ``block`` layers (weights as inputs); the
    opening, closing, loss and regularization as in ``Problem.evaluate`` (``_checked_compile``
    compares the two before use)."""
    a, steps = prob.args, prob.resnet.steps
    if not all(isinstance(st.act, SmoothReLU) for st in steps):
        raise ValueError("compiled_objective: the study's steps use SmoothReLU")
    W = [st.linear.weight for st in steps]
    b = [st.linear.bias for st in steps]
    # h and eps as tensors: one graph for every depth (a float closure would be a guard)
    h = torch.tensor(prob.h)
    eps = torch.tensor(steps[0].act.eps)
    cf = torch.compile(_block, backend=backend, dynamic=False)

    def fn(x, y):
        for p in prob.params:
            p.grad = None
        u = prob.net.opening(x)
        for i in range(0, len(W), block):
            u = cf(u, W[i:i + block], b[i:i + block], h, eps)
        ce = F.cross_entropy(prob.net.closing(u), y)
        reg = 0.5 * a.gamma_tik * sum(p.pow(2).sum() for p in prob.open_params)
        reg = reg + 0.5 * a.gamma_tik * sum(p.pow(2).sum() for ps in prob.step_params for p in ps)
        reg = reg + 0.5 * a.gamma_class * sum(p.pow(2).sum() for p in prob.close_params)
        ddt, _ = prob._ddt()
        total = ce + reg + ddt
        total.backward()
        return float(total.detach()), prob.grad_flat()
    return fn


def _checked_compile(prob, block, x, y, backend):
    from mgrit.perf.lean import COMPILE_ERRORS
    t0 = time.perf_counter()
    try:
        fn = compiled_objective(prob, block, backend)
        _, g = fn(x, y)
    except COMPILE_ERRORS as e:
        return None, f"does not compile here: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    _, ref = prob.evaluate(x, y)
    err = float((g - ref).norm() / ref.norm())
    if not err <= 1e-8:
        return None, f"compiled objective differs from the serial one (relative {err:.1e}): not used"
    return fn, f"{backend}, blocks of {block} layers, compiled in {time.perf_counter() - t0:.0f} s"


def measure(args, world, data, depths, reps, backend="inductor"):
    """Per ``(P, N)``: wall seconds (max over ranks) of ``reps`` evaluations per method,
    interleaved (one untimed warm-up each), and the relative gradient error of the first
    (cold-start) simultaneous evaluation against the serial one at the same weights. Returns
    ``(samples {"P=../N=../method": [s]}, gerr [(P, N, error)], notes)``; all ranks in
    ``world`` call it. ``backend`` '' skips the compiled baselines."""
    xtr, ytr = data[0], data[1]
    rank, W = world.Get_rank(), world.Get_size()
    samples, gerr, notes = {}, [], {}
    block = block_size(depths)
    for P in sorted({1, W}):
        sub = world.Split(0 if rank < P else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            for N in depths:
                if N < P:
                    continue
                a = copy.copy(args)
                a.layers, a.seed = N, 0
                probs = {m: Problem(a, sub, m) for m in LAYER_METHODS}
                g = {m: p.evaluate(xtr, ytr)[1] for m, p in probs.items()}  # also the warm-up
                d = g["simultaneous"] - g["serial"]
                ps = probs["serial"]
                gerr.append((P, N, float(math.sqrt(ps.dot(d, d) / ps.dot(g["serial"], g["serial"])))))
                fns = {m: (lambda p=p: p.evaluate(xtr, ytr)) for m, p in probs.items()}
                # exact baselines on one rank each: the whole batch (P = 1) or its share (P > 1)
                own = Problem(a, MPI.COMM_SELF, "serial")
                xs, ys = (xtr, ytr) if P == 1 else (xtr[rank::P], ytr[rank::P])
                base = {"serial" if P == 1 else "data_parallel": own.evaluate}
                if backend:
                    cfn, notes[f"P={P} N={N}"] = _checked_compile(own, block, xs, ys, backend)
                    if cfn is not None:
                        base["compiled" if P == 1 else "compiled_dp"] = cfn
                for m, f in base.items():
                    if P == 1 and m == "serial":
                        continue  # the library's serial path on 1 rank is already timed

                    def step(f=f):
                        _, gl = f(xs, ys)
                        if P > 1:
                            sub.Allreduce(MPI.IN_PLACE, gl.numpy(), op=MPI.SUM)
                    fns[m] = step
                t = {m: [] for m in fns}
                for i in range(reps + 1):
                    for m, f in fns.items():
                        sub.Barrier()
                        t0 = time.perf_counter()
                        f()
                        dt = sub.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                        if i:  # round 0: warm-up
                            t[m].append(dt)
                samples.update({f"P={P}/N={N}/{m}": v for m, v in t.items()})
            sub.Free()
        world.Barrier()
    return samples, gerr, notes


def model_rows(args, costs_list, points, fw_bw, modeled_time):
    """``(cal, N, P, serial s, simultaneous s, serial s by the kernel costs)`` per calibration
    and ``(N, P)`` in ``points`` (``modeled_time`` of ``reproduce_guenther``; ``fw_bw`` the
    simultaneous MGRIT options; the last column is the model before issue 24, kept to show
    its error beside the serial path's own calibration)."""
    rows = []
    for c, costs in enumerate(costs_list):
        for N, P in points:
            rows.append((c, N, P,
                         modeled_time(N, P, *fw_bw, args.mgrit_iters, costs, True),
                         modeled_time(N, P, *fw_bw, args.mgrit_iters, costs, False),
                         modeled_time(N, P, *fw_bw, args.mgrit_iters, costs, True, kernels=True)))
    return rows


# ---------------------------------------------------------------------------- report
class Timing:
    """Lookup of the stored ``timing`` part: ``t(P, N, method)`` median seconds,
    ``spread(P, N, method)`` text, ``gerr[(P, N)]``, ``model[(N, P)]`` = (serial s,
    simultaneous s) per calibration."""

    def __init__(self, s, meta):
        self.meta = meta
        names = meta["methods"]
        self.rows = {(int(P), int(N), names[int(m)]): (med, q1, q3, lo, hi)
                     for P, N, m, med, q1, q3, lo, hi in zip(*(s[f"meas_{k}"] for k in (
                         "P", "N", "method", "median", "q1", "q3", "min", "max")))}
        self.P = sorted({k[0] for k in self.rows})
        self.N = sorted({k[1] for k in self.rows})
        self.gerr = {(int(P), int(N)): float(v) for P, N, v in zip(s["gerr_P"], s["gerr_N"], s["gerr_value"])}
        self.model = {}
        for _, N, P, se, si, sk in zip(*(s[f"model_{k}"] for k in (
                "cal", "N", "P", "serial", "simultaneous", "serial_kernels"))):
            a, b, c = self.model.setdefault((int(N), int(P)), ([], [], []))
            a.append(float(se))
            b.append(float(si))
            c.append(float(sk))

    def t(self, P, N, m):
        return float(self.rows[(P, N, m)][0]) if (P, N, m) in self.rows else float("nan")

    def spread(self, P, N, m):
        if (P, N, m) not in self.rows:
            return "-"
        med, q1, q3, lo, hi = (1e3 * x for x in self.rows[(P, N, m)])
        return f"{med:.1f} [{q1:.1f}-{q3:.1f}]"

    def strongest(self, P, N):
        """Fastest exact way to evaluate at depth N with P ranks (the 1-rank ones included)."""
        c = [(self.t(q, N, m), m + ("" if q == P else " (1 rank)"))
             for q, m in ((P, "serial"), (1, "serial"), (1, "compiled"), (P, "data_parallel"),
                          (P, "compiled_dp")) if np.isfinite(self.t(q, N, m))]
        return min(c) if c else (float("nan"), "-")

    def speedup(self, N, P):
        """Modeled serial / simultaneous per calibration."""
        se, si, _ = (np.asarray(x) for x in self.model[N, P])
        return se / si

    def errors(self, N, what):
        """Model error rows at the measured P of depth N: ``what`` = ``"serial"``,
        ``"simultaneous"`` (seconds per evaluation), ``"speedup"``, or ``"serial_kernels"``,
        ``"speedup_kernels"`` (the model before issue 24: serial from the kernel costs)."""
        meas, pred = {}, {}
        for P in self.P:
            if (N, P) not in self.model or (P, N, "serial") not in self.rows:
                continue
            se, si, sk = (float(np.median(x)) for x in self.model[N, P])
            ms, mi = self.t(P, N, "serial"), self.t(P, N, "simultaneous")
            meas[f"P={P}"], pred[f"P={P}"] = {
                "serial": (ms, se), "simultaneous": (mi, si), "speedup": (ms / mi, se / si),
                "serial_kernels": (ms, sk), "speedup_kernels": (ms / mi, sk / si)}[what]
        return mc.model_errors(meas, pred)


def report_body(s, meta):
    T = Timing(s, meta)
    rows = [[P, N] + [T.spread(P, N, m) for m in METHODS]
            + [f"{T.gerr.get((P, N), float('nan')):.2e}",
               f"{T.t(P, N, 'serial') / T.t(P, N, 'simultaneous'):.2f}x",
               "{:.2f}x ({})".format(T.strongest(P, N)[0] / T.t(P, N, "simultaneous"),
                                     T.strongest(P, N)[1])]
            for P in T.P for N in T.N if (P, N, "serial") in T.rows]
    L = ["## Time per evaluation (MEASURED; timing part)", "",
         f"One objective evaluation (forward + gradient, full batch of {meta['train_points']} "
         f"points), ms: median [IQR] of {meta['reps']} interleaved repeats, wall clock, max over "
         "ranks (raw per-repeat numbers in `timing.raw.json`; load average "
         f"{meta['loadavg']}). serial = exact sequential stepping; simultaneous = "
         f"{meta['mgrit_iters']} MGRIT iterations forward and adjoint, an INEXACT gradient: "
         "gradient error = ||g - g_exact|| / ||g_exact|| of the first (cold-start) evaluation at "
         "the initial weights (seed 0); in training the warm start makes it smaller. Exact "
         "baselines: compiled = the objective with the residual stack under torch.compile "
         "(1 rank); data parallel / compiled DP = each rank evaluates its share of the batch, "
         "then one allreduce of the gradient. Compile: "
         + "; ".join(f"{k}: {v}" for k, v in meta.get("compile", {}).items()) + ".", "",
         reporting.markdown_table(["P", "N", "serial", "simultaneous", "compiled (1 rank)",
                                   "data parallel", "compiled DP", "simultaneous gradient error",
                                   "simultaneous vs serial", "simultaneous vs strongest (which)"],
                                  rows), "",
         "## Cost model at the measured points", "",
         f"{len(meta['calibrated_tau'])} independent calibrations of the step costs; "
         "predicted/measured (median prediction over the calibrations); validated = within "
         f"{mc.VALID_FACTOR}x at every measured P. serial s = the serial path's own forward + "
         "backward per layer (`calibrate_serial`, a separate 64-layer chain); 'before' = the "
         "model used until issue 24, serial from the propagator kernels' costs, which the "
         "serial path does not run.", ""]
    rows = [[N] + [mc.error_text(e) + ("" if mc.validated(e) else " NOT validated")
                   for e in (T.errors(N, w) for w in ("serial", "simultaneous", "speedup",
                                                      "serial_kernels", "speedup_kernels"))]
            for N in T.N]
    L += [reporting.markdown_table(["N", "serial s", "simultaneous s", "speedup",
                                    "serial s (before)", "speedup (before)"], rows), "",
          "## MODELED speedup per evaluation (cost model; not run beyond the measured P)", ""]
    rows = []
    for (N, P) in sorted(T.model):
        sp = mc.calibration_spread(T.speedup(N, P))
        rows.append([N, P, f"{sp['median']:.2f}x", f"{sp['min']:.2f}-{sp['max']:.2f}x",
                     "measured" if (P, N, "serial") in T.rows else "extrapolated"])
    L += [reporting.markdown_table(["N", "P", "modeled speedup (median)",
                                    "min-max over calibrations", "point"], rows)]
    return L


def _extrapolation(T):
    N = max(T.N)
    P = max(p for n, p in T.model if n == N)
    return N, P, T.errors(N, "speedup")


def summary_lines(s, meta):
    """The summary's speed paragraph; verdicts computed from the stored numbers."""
    T = Timing(s, meta)
    Pw = max(T.P)
    meas = "; ".join(f"N = {N}: {T.t(Pw, N, 'serial') / T.t(Pw, N, 'simultaneous'):.2f}x "
                     f"(gradient error {T.gerr.get((Pw, N), float('nan')):.1e})" for N in T.N
                     if (Pw, N, "serial") in T.rows)
    lose = all(T.t(Pw, N, "serial") < T.t(Pw, N, "simultaneous") for N in T.N
               if (Pw, N, "serial") in T.rows)
    strong = "; ".join("N = {}: {:.2f}x ({})".format(
        N, T.strongest(Pw, N)[0] / T.t(Pw, N, "simultaneous"), T.strongest(Pw, N)[1])
        for N in T.N if (Pw, N, "serial") in T.rows)
    lose_all = all(T.strongest(Pw, N)[0] < T.t(Pw, N, "simultaneous") for N in T.N
                   if (Pw, N, "serial") in T.rows)
    N, P, e = _extrapolation(T)
    ok = all(mc.validated(T.errors(n, "speedup")) for n in T.N)
    return ["", f"**Speed, measured (P = {Pw}, load average {meta['loadavg']}).** Serial / "
            f"simultaneous time per evaluation: {meas}."
            + (" **Simultaneous training is slower than serial at every measured point.**"
               if lose else "") + f" Against the strongest exact baseline: {strong}."
            + (" **We lose against it at every measured depth.**" if lose_all else ""), "",
            f"**Speed, MODELED at P = {P}, N = {N}** (simultaneous vs the serial path; data "
            "parallelism and compile are not in the model). "
            + mc.modeled_text(T.speedup(N, P), e) + ". "
            + ("The cost model is within the tolerance at the measured points."
               if ok else "**The cost model misses the measured points by more than "
               f"{mc.VALID_FACTOR}x, so its extrapolations are not presented as results**; the "
               "modeled table in `table.md` shows what it says, with its error.")]


def headline_rows(s, meta):
    """The measured speed at the world size and the modeled extrapolation, with its error."""
    T = Timing(s, meta)
    Pw, Nm = max(T.P), max(T.N)
    ts, which = T.strongest(Pw, Nm)
    ti = T.t(Pw, Nm, "simultaneous")
    N, P, e = _extrapolation(T)
    return [{"claim": "simultaneous training is faster per evaluation (measured here)",
             "ours": f"N = {Nm}, P = {Pw}: {T.t(Pw, Nm, 'serial') / ti:.2f}x vs serial, "
                     f"{ts / ti:.2f}x vs the strongest exact baseline ({which}); gradient error "
                     f"{T.gerr.get((Pw, Nm), float('nan')):.1e} (load {meta['loadavg']})",
             "kind": "timing"},
            {"claim": "speedup with many cores for deep networks (per evaluation, CPU-calibrated "
                      "cost model, vs the serial path)",
             "ours": f"N = {N}, P = {P}: " + mc.modeled_text(T.speedup(N, P), e),
             "kind": "modeled"}]
