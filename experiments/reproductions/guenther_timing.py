"""The timing part of ``reproduce_guenther.py`` (issue 24, items 3 and 5): measured wall time per
objective evaluation (forward + gradient, full batch) of serial and simultaneous training at
P = 1 and the world size, at the study's depth and a deeper one, interleaved repeats with their
spread and raw per-repeat numbers (``timing.raw.json``), the gradient error of the inexact
(simultaneous) evaluation, and ``--calibrations`` repeated calibrations of the cost model
(``reproduce_guenther.modeled_time``): its error at every measured point and the spread of every
extrapolated number over the calibrations (``model_check``).

Serial here is the library's exact path (1-level MGRIT = sequential stepping across the ranks);
the objective's full batch of 5,000 points is what data parallelism would split, which Günther's
method does not do: no data-parallel row (the paper compares with serial training only)."""
from __future__ import annotations

import copy
import time

import numpy as np
from mpi4py import MPI

from experiments.reproductions import model_check as mc
from experiments.reproductions.guenther_problem import Problem
from mgrit.training import report as reporting

METHODS = ("serial", "simultaneous")


def measure(args, world, data, depths, reps):
    """Per ``(P, N)``: wall seconds (max over ranks) of ``reps`` evaluations per method,
    interleaved (one untimed warm-up each), and the relative gradient error of the first
    (cold-start) simultaneous evaluation against the serial one at the same weights. Returns
    ``(samples {"P=../N=../method": [s]}, gerr [(P, N, error)])``; all ranks in ``world``."""
    xtr, ytr = data[0], data[1]
    rank, W = world.Get_rank(), world.Get_size()
    samples, gerr = {}, []
    for P in sorted({1, W}):
        sub = world.Split(0 if rank < P else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            for N in depths:
                if N < P:
                    continue
                a = copy.copy(args)
                a.layers, a.seed = N, 0
                probs = {m: Problem(a, sub, m) for m in METHODS}
                g = {m: p.evaluate(xtr, ytr)[1] for m, p in probs.items()}  # also the warm-up
                d = g["simultaneous"] - g["serial"]
                ps = probs["serial"]
                gerr.append((P, N, float(np.sqrt(ps.dot(d, d) / ps.dot(g["serial"], g["serial"])))))
                t = {m: [] for m in METHODS}
                for _ in range(reps):
                    for m, p in probs.items():
                        sub.Barrier()
                        t0 = time.perf_counter()
                        p.evaluate(xtr, ytr)
                        t[m].append(sub.allreduce(time.perf_counter() - t0, op=MPI.MAX))
                samples.update({f"P={P}/N={N}/{m}": v for m, v in t.items()})
            sub.Free()
        world.Barrier()
    return samples, gerr


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
        med, q1, q3, lo, hi = (1e3 * x for x in self.rows[(P, N, m)])
        return f"{med:.1f} [{q1:.1f}-{q3:.1f}]"

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
    rows = [[P, N, T.spread(P, N, "serial"), T.spread(P, N, "simultaneous"),
             f"{T.gerr.get((P, N), float('nan')):.2e}",
             f"{T.t(P, N, 'serial') / T.t(P, N, 'simultaneous'):.2f}x"]
            for P in T.P for N in T.N if (P, N, "serial") in T.rows]
    L = ["## Time per evaluation (MEASURED; timing part)", "",
         f"One objective evaluation (forward + gradient, full batch of {meta['train_points']} "
         f"points), ms: median [IQR] of {meta['reps']} interleaved repeats, wall clock, max over "
         "ranks (raw per-repeat numbers in `timing.raw.json`; load average "
         f"{meta['loadavg']}). serial = exact sequential stepping; simultaneous = "
         f"{meta['mgrit_iters']} MGRIT iterations forward and adjoint, an INEXACT gradient: "
         "gradient error = ||g - g_exact|| / ||g_exact|| of the first (cold-start) evaluation at "
         "the initial weights (seed 0); in training the warm start makes it smaller.", "",
         reporting.markdown_table(["P", "N", "serial", "simultaneous", "simultaneous gradient error",
                                   "speedup (serial / simultaneous)"], rows), "",
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
    N, P, e = _extrapolation(T)
    ok = all(mc.validated(T.errors(n, "speedup")) for n in T.N)
    return ["", f"**Speed, measured (P = {Pw}, load average {meta['loadavg']}).** Serial / "
            f"simultaneous time per evaluation: {meas}."
            + (" **Simultaneous training is slower than serial at every measured point.**"
               if lose else ""), "",
            f"**Speed, MODELED at P = {P}, N = {N}.** "
            + mc.modeled_text(T.speedup(N, P), e) + ". "
            + ("The cost model is within the tolerance at the measured points."
               if ok else "**The cost model misses the measured points by more than "
               f"{mc.VALID_FACTOR}x, so its extrapolations are not presented as results**; the "
               "modeled table in `table.md` shows what it says, with its error.")]


def headline_row(s, meta):
    T = Timing(s, meta)
    N, P, e = _extrapolation(T)
    return {"claim": "speedup with many cores for deep networks",
            "ours": f"N = {N}, P = {P}: " + mc.modeled_text(T.speedup(N, P), e)
                    + " per evaluation (CPU-calibrated cost model)", "kind": "modeled"}
