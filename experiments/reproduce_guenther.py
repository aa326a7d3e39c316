"""Study 2: Günther et al. 2020 (SIMODS, arXiv 1812.04352) -- simultaneous layer-parallel training
on Peaks versus serial training.

Setting (paper; ``--full``): Peaks 5,000 train / 200 validation points, opening
``Linear(2, 8) + SmoothReLU``, 30 residual layers ``x + h SmoothReLU(W_k x + b_k)`` (width 8,
T = 1, h = T/N), closing ``Linear(8, 5)``, cross-entropy, full batch, L-BFGS with 10 pairs and
Armijo backtracking (c = 1e-4, halving, at most 15 tries), 130 iterations, regularization
(implemented here; ``theta_k`` = all parameters of residual layer k, flattened)::

    J = CE + gamma_tik/2 * ||theta_open, theta_res||^2
           + gamma_ddt/2 * sum_{k>=1} h * ||(theta_k - theta_{k-1}) / h||^2
           + gamma_class/2 * ||theta_class||^2

with gamma_tik = 1e-7, gamma_ddt = 1e-5, gamma_class = 1e-7. The depth-smoothness pairs that
cross a rank boundary use the neighbour's boundary layer (exchanged every evaluation), so J and
its gradient equal the serial ones on any number of ranks.

Methods (same code, same initial weights, same optimizer):

* ``serial``: exact forward/backward (one MGRIT level = sequential stepping across the ranks,
  i.e. conventional training, layer-wise model parallel).
* ``simultaneous``: Günther's one-shot training: forward and adjoint MGRIT with cfactor 2, up to
  10 levels, min coarse 10, F-relaxation on the fine level, FCF on coarse levels, only 2
  iterations per evaluation (tol 0), forward warm-started from the previous evaluation's
  states; the optimizer sees the inexact loss and gradient.

Recorded per L-BFGS iteration: the optimizer's objective, the exact (serial-network) training
loss/accuracy and validation accuracy, evaluations, wall time, modeled time (``mgrit.perf``
cost model with a calibrated step cost; see ``modeled_time``) and the MGRIT residuals /
convergence factors of the forward and adjoint solves.

Run (every study is one MPI command)::

    mpiexec -n 2 python -m mpi4py experiments/reproduce_guenther.py            # small default
    mpiexec -n 2 python -m mpi4py experiments/reproduce_guenther.py --full     # 130 its, -> full/
    mpiexec -n 2 python -m mpi4py experiments/reproduce_guenther.py --full --layers 1024
    mpiexec -n 2 python -m mpi4py experiments/reproduce_guenther.py --smoke --out /tmp/x
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path


STUDY = "guenther2020"
PAPER = {"dataset": "Peaks 5,000 train / 200 val", "width": 8, "layers": 30, "T": 1.0,
         "activation": "SmoothReLU (eps 0.1)", "cfactor": 2, "max_levels": 10, "min_coarse": 10,
         "relax": "F fine, FCF coarse", "mgrit_iters": 2, "optimizer": "L-BFGS(10) + Armijo",
         "lbfgs_iters": 130, "gamma_tik": 1e-7, "gamma_ddt": 1e-5, "gamma_class": 1e-7}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Günther et al. 2020 (SIMODS): simultaneous layer-parallel vs serial training "
                    "on Peaks with L-BFGS(10)+Armijo. Defaults are small (2 ranks, minutes); "
                    "--full is the paper's setting; --smoke is tiny (tests).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="residual layers N (default 30)")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--iters", type=int, default=None,
                   help="L-BFGS iterations (default 40; --full 130; --smoke 3)")
    p.add_argument("--train", type=int, default=None, help="training points (default 5000)")
    p.add_argument("--val", type=int, default=200, help="validation points")
    p.add_argument("--mgrit-iters", type=int, default=2, help="MGRIT iterations per evaluation")
    p.add_argument("--cfactor", type=int, default=2)
    p.add_argument("--max-levels", type=int, default=10)
    p.add_argument("--min-coarse", type=int, default=10)
    p.add_argument("--gamma-tik", type=float, default=1e-7)
    p.add_argument("--gamma-ddt", type=float, default=1e-5)
    p.add_argument("--gamma-class", type=float, default=1e-7)
    p.add_argument("--history", type=int, default=10, help="L-BFGS pairs")
    p.add_argument("--methods", default="serial,simultaneous",
                   help="comma list of serial, simultaneous")
    p.add_argument("--model-ranks", default=None,
                   help="comma list of rank counts P for the modeled time "
                        "(default: this run's P and N/4, N/2 where >= P)")
    p.add_argument("--seed", type=int, default=0)
    reporting.add_study_flags(
        p, "paper scale: 130 L-BFGS iterations; outputs go to <study>/full/",
        "tiny: 3 iterations, 500 points")
    a = p.parse_args(argv)
    if a.iters is None:
        a.iters = 3 if a.smoke else (130 if a.full else 40)
    if a.layers is None:
        a.layers = 30
    if a.train is None:
        a.train = 500 if a.smoke else 5000
    if a.smoke:
        a.val = min(a.val, 100)
    return a


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mgrit.training import report as reporting  # noqa: E402  (light: stdlib + numpy)

# --help must not pay for torch/MPI start-up: answer it before the heavy imports
if __name__ == "__main__" and any(a in ("-h", "--help") for a in sys.argv[1:]):
    parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mgrit.training.guenther import Problem, lbfgs_armijo  # noqa: E402
from mgrit.nn import DenseStep  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402


# ---------------------------------------------------------------------------- model / objective
def calibrate(width, batch, reps=5):
    """Step costs (seconds) of one residual layer on the whole batch, measured on the library's
    own propagators (``mgrit.nn.chains.ForwardChain`` / ``AdjointChain`` of 64 DenseSteps):
    single steps and batched calls over B intervals (affine fit, ``mgrit.perf.calibrate_step``)."""
    from mgrit import perf
    from mgrit.nn.chains import AdjointChain, ForwardChain

    torch.manual_seed(0)
    n = 64
    steps = [DenseStep(width, "smoothrelu") for _ in range(n)]
    fwd_chain = ForwardChain(steps, 0, 1.0 / n, batched=True)
    fwd_chain.refresh()
    X = torch.randn(n + 1, batch, width)
    adj_chain = AdjointChain(fwd_chain, n, X)
    V = torch.randn(n, batch, width)
    with torch.no_grad():
        sizes = (2, 8, 32, 64)
        fwd = perf.calibrate_step(lambda: fwd_chain.step(X[0], 0, 1, 0),
                                  lambda B: fwd_chain.step_batch(X[:B], list(range(B)),
                                                                 list(range(1, B + 1)), 0),
                                  sizes=sizes, repeats=reps, inner=3)
        adj = perf.calibrate_step(lambda: adj_chain.step(V[0], 0, 1, 0),
                                  lambda B: adj_chain.step_batch(V[:B], list(range(B)),
                                                                 list(range(1, B + 1)), 0),
                                  sizes=sizes, repeats=reps, inner=3)
    return fwd, adj


def _mgrit_critical_path(N, P, opts, K, tau, nbytes):
    """Critical path of one fixed-iteration MGRIT solve: ``mgrit.perf.simulate`` (replay of the
    solver) when available, else the notes' formula ``K * (sum_l c_r max(N_l/P, m) tau +
    N_coarse tau)`` (c_r = 2 for F, 3 for FCF) plus ``(L + P) beta`` per cycle."""
    from mgrit import perf

    comm = perf.CommCost()
    if hasattr(perf, "simulate"):
        return perf.simulate(N, P, opts, K, None, tau, comm, nbytes).critical_path
    n, levels = N, []
    while len(levels) + 1 < opts.max_levels and n // opts.cfactor >= opts.min_coarse:
        levels.append(n)
        n //= opts.cfactor
    cyc = sum((2 + opts.sweeps(l)) * max(nl / P, opts.cfactor) * tau.single
              for l, nl in enumerate(levels)) + n * tau.single
    return K * (cyc + (len(levels) + 1 + P) * comm.message(nbytes))


def modeled_time(N, P, fw_opts, bw_opts, K, costs, serial):
    """Modeled seconds of one evaluation (forward + backward), critical path.

    serial: ``N (tau_f + tau_b) + 2 (P - 1) beta`` (notes' cost model, blocking chain).
    Simultaneous: MGRIT forward (K cycles) + adjoint (K cycles) critical paths
    (:func:`_mgrit_critical_path`) plus the parameter-gradient sweep ``ceil(N/P) tau_b``;
    default :class:`mgrit.perf.CommCost` (5 us, 5 GB/s), one state per message."""
    from mgrit import perf

    fwd, adj, nbytes = costs
    if serial:
        return N * (fwd.single + adj.single) + 2 * (P - 1) * perf.CommCost().message(nbytes)
    tf = _mgrit_critical_path(N, P, fw_opts, K, fwd, nbytes)
    tb = _mgrit_critical_path(N, P, bw_opts, K, adj, nbytes)
    return tf + tb + math.ceil(N / P) * adj.single


# ---------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    if args.layers < P:
        raise SystemExit(f"--layers {args.layers} < {P} ranks: every rank needs a layer")
    from data.peaks import make_peaks

    xtr, ytr = make_peaks(args.train, args.seed, 0)
    xva, yva = make_peaks(args.val, args.seed, 1)
    xtr, xva = torch.as_tensor(xtr, dtype=torch.float64), torch.as_tensor(xva, dtype=torch.float64)
    ytr, yva = torch.as_tensor(ytr), torch.as_tensor(yva)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in ("serial", "simultaneous"):
            raise SystemExit(f"unknown method {m!r}: use serial, simultaneous")
    meta = reporting.run_metadata(world_size=P)
    meta.update({f"setting_{k}": v for k, v in vars(args).items()})
    costs = None
    if rank == 0:
        fwd, adj = calibrate(args.width, args.train, reps=3 if args.smoke else 5)
        costs = (fwd, adj, args.train * args.width * 8)
    costs = comm.bcast(costs, root=0)
    N = args.layers
    if args.model_ranks:
        model_P = sorted({int(v) for v in args.model_ranks.split(",")})
    else:
        model_P = sorted({P} | {q for q in (N // 4, N // 2) if q >= P})
    model_P = [q for q in model_P if 1 <= q <= N]
    series, rows = {}, []
    summary = {}
    for method in methods:
        prob = Problem(args, comm, method)
        comm.Barrier()
        t0 = time.perf_counter()
        rec = {k: [] for k in ("iter", "objective", "train_loss", "train_acc", "val_acc", "evals",
                               "wall", "tries", "step", "fwd_res", "fwd_factor", "bwd_res",
                               "bwd_factor")}
        eval_time = [0.0]

        def on_iter(it, J, tries, step):
            te = time.perf_counter()
            (trl, tra), (_, vaa) = prob.serial_metrics([(xtr, ytr), (xva, yva)])
            eval_time[0] += time.perf_counter() - te
            rec["iter"].append(it), rec["objective"].append(J), rec["train_loss"].append(trl)
            rec["train_acc"].append(tra), rec["val_acc"].append(vaa)
            rec["evals"].append(prob.n_eval), rec["tries"].append(tries), rec["step"].append(step)
            rec["wall"].append(time.perf_counter() - t0 - eval_time[0])
            lf, lb = prob.resnet.last_forward, prob.resnet.last_backward
            nan = float("nan")
            rf = lf.residuals if (lf is not None and method != "serial") else []
            rb = lb.residuals if (lb is not None and method != "serial") else []
            rec["fwd_res"].append(rf[-1] if rf else nan)
            rec["fwd_factor"].append(lf.convergence_factors[-1] if len(rf) > 1 else nan)
            rec["bwd_res"].append(rb[-1] if rb else nan)
            rec["bwd_factor"].append(lb.convergence_factors[-1] if len(rb) > 1 else nan)
            if rank == 0 and (it % 10 == 0 or it == args.iters):
                print(f"[{method}] it {it:4d} J={J:.5f} train_loss={trl:.5f} train_acc={tra:.3f} "
                      f"val_acc={vaa:.3f} evals={prob.n_eval} fwd_factor={rec['fwd_factor'][-1]:.3g}",
                      flush=True)

        lbfgs_armijo(prob, xtr, ytr, args.iters, args.history, on_iter)
        levels = len(prob.resnet._fsolver.hierarchy.levels) if hasattr(prob.resnet._fsolver, "hierarchy") else None
        per_eval = {q: modeled_time(N, q, prob.fw_opts, prob.bw_opts, args.mgrit_iters, costs,
                                    method == "serial") for q in model_P}
        for q in model_P:
            rec[f"modeled_time_P{q}"] = [e * per_eval[q] for e in rec["evals"]]
        for k, v in rec.items():
            series[f"{method}/{k}"] = v
        summary[method] = dict(rec=rec, per_eval=per_eval, levels=levels)
        prob = None  # free this method's network before the next one

    if rank != 0:
        return
    # --full keeps the default run's outputs: it writes to <study>/full/
    outdir = reporting.results_dir(STUDY + ("/full" if args.full else ""), args.out)
    meta["modeled_ranks"] = model_P
    meta["calibrated_tau"] = {"fwd_single": costs[0].single, "fwd_call": costs[0].call,
                              "fwd_item": costs[0].item, "adj_single": costs[1].single,
                              "adj_call": costs[1].call, "adj_item": costs[1].item}
    reporting.save_series(outdir / "results.h5", series, meta)
    # table 1: final numbers
    header = ["method", "L-BFGS iters", "evaluations", "final objective (optimizer's)",
              "train loss (exact)", "train acc", "val acc", "wall s (measured, P=%d)" % P]
    header += [f"modeled s, P={q}" for q in model_P]
    for method in methods:
        r = summary[method]["rec"]
        row = [method, r["iter"][-1], r["evals"][-1], r["objective"][-1], r["train_loss"][-1],
               r["train_acc"][-1], r["val_acc"][-1], r["wall"][-1]]
        row += [r[f"modeled_time_P{q}"][-1] for q in model_P]
        rows.append(row)
    body = ["## Final numbers (ours)", "", reporting.markdown_table(header, rows), ""]
    # modeled speedup
    if "serial" in summary and "simultaneous" in summary:
        sp = [[q, summary["serial"]["per_eval"][q], summary["simultaneous"]["per_eval"][q],
               summary["serial"]["per_eval"][q] / summary["simultaneous"]["per_eval"][q]]
              for q in model_P]
        body += ["## Modeled time per evaluation (forward + gradient), critical path [modeled]", "",
                 reporting.markdown_table(["P", "serial s", "simultaneous s (2+2 MGRIT iters)",
                                           "modeled speedup"], sp), ""]
    # modeled-only scaling (not run): per-evaluation critical path at the paper's depths
    if "serial" in summary and "simultaneous" in summary:
        sc = []
        for n_model in sorted({N, 1024}):
            for q in (2, 8, 32, 128, 512):
                if q > n_model:
                    continue
                kw = dict(max_levels=args.max_levels, cfactor=args.cfactor,
                          min_coarse=args.min_coarse, relax=["F", "FCF"], tol=0,
                          max_iter=args.mgrit_iters)
                o = MGRITOptions(**kw)
                ts = modeled_time(n_model, q, o, o, args.mgrit_iters, costs, True)
                tm = modeled_time(n_model, q, o, o, args.mgrit_iters, costs, False)
                sc.append([n_model, q, ts, tm, ts / tm])
        body += ["## Modeled scaling (cost model only, not run) [modeled]", "",
                 "Same calibrated step costs; one evaluation = forward + gradient; the run above "
                 f"needed about {summary['simultaneous']['rec']['evals'][-1] / max(1, args.iters):.2f} "
                 "evaluations per L-BFGS iteration for both methods.", "",
                 reporting.markdown_table(["N layers", "P", "serial s / eval", "simultaneous s / eval",
                                           "modeled speedup"], sc), ""]
    if "simultaneous" in summary:
        r = summary["simultaneous"]["rec"]
        ff = np.array(r["fwd_factor"], dtype=float)
        bf = np.array(r["bwd_factor"], dtype=float)
        picks = sorted({0, 1, len(ff) // 4, len(ff) // 2, len(ff) - 1})
        conv = [[r["iter"][i], r["fwd_res"][i], ff[i], r["bwd_res"][i], bf[i]] for i in picks]
        body += ["## MGRIT convergence during simultaneous training (last solve of each iteration)",
                 "", reporting.markdown_table(["L-BFGS iter", "fwd residual", "fwd factor r2/r1",
                                               "adj residual", "adj factor r2/r1"], conv), "",
                 f"Mean convergence factor: forward {np.nanmean(ff):.3g}, adjoint {np.nanmean(bf):.3g}."
                 f" MGRIT levels: {summary['simultaneous']['levels']}.", ""]
    pub = [[k, v] for k, v in PAPER.items()]
    body += ["## Published setting (Günther et al. 2020) next to ours", "",
             reporting.markdown_table(["paper", "value"], pub), "",
             "Published claim: simultaneous (one-shot, 2 MGRIT iterations per optimization step) "
             "training reaches training/validation accuracy comparable to serial training, while "
             "the layer-parallel solves give a runtime speedup on many cores. The notes give no "
             "published accuracy numbers for this run; we compare our two methods with each "
             "other. Modeled columns are the cost model (mgrit.perf), not measurements.", ""]
    reporting.write_table(outdir / "table.md", "Günther et al. 2020 -- Peaks, serial vs "
                          "simultaneous layer-parallel training", meta, "\n".join(body))
    # plots
    for key, ylabel, logy in (("objective", "objective J (optimizer's)", True),
                              ("train_loss", "exact training loss", True),
                              ("train_acc", "training accuracy", False),
                              ("val_acc", "validation accuracy", False)):
        reporting.plot_lines(outdir / f"{key}_vs_iter.png",
                             {m: (summary[m]["rec"]["iter"], summary[m]["rec"][key]) for m in methods},
                             "L-BFGS iteration", ylabel, f"Peaks, N={N}", logy=logy)
    qmax = max(model_P)
    reporting.plot_lines(outdir / "train_loss_vs_modeled_time.png",
                         {f"{m} (P={q})": (summary[m]["rec"][f"modeled_time_P{q}"],
                                           summary[m]["rec"]["train_loss"])
                          for m in methods for q in sorted({P, qmax})},
                         "modeled time [s] (cost model)", "exact training loss",
                         f"Peaks, N={N} [modeled time]", logy=True)
    reporting.plot_lines(outdir / "val_acc_vs_modeled_time.png",
                         {f"{m} (P={q})": (summary[m]["rec"][f"modeled_time_P{q}"],
                                           summary[m]["rec"]["val_acc"])
                          for m in methods for q in sorted({P, qmax})},
                         "modeled time [s] (cost model)", "validation accuracy",
                         f"Peaks, N={N} [modeled time]")
    reporting.plot_lines(outdir / "train_loss_vs_wall.png",
                         {m: (summary[m]["rec"]["wall"], summary[m]["rec"]["train_loss"])
                          for m in methods}, f"measured wall time [s], P={P} (shared CPU)",
                         "exact training loss", f"Peaks, N={N}", logy=True)
    if "simultaneous" in summary:
        r = summary["simultaneous"]["rec"]
        reporting.plot_lines(outdir / "convergence_factors.png",
                             {"forward r2/r1": (r["iter"], r["fwd_factor"]),
                              "adjoint r2/r1": (r["iter"], r["bwd_factor"])},
                             "L-BFGS iteration", "MGRIT convergence factor", f"simultaneous, N={N}")
    print(f"wrote {outdir}", flush=True)


if __name__ == "__main__":
    main()
