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

Seeds: ``--seeds S`` runs both methods from S initializations (weight seeds 0..S-1, the same
Peaks data, ``--data-seed``); the tables give mean +- std over the seeds, and the accuracy
comparison (``guenther_report.accuracy_over_seeds``) each method's mean with its Student-t 95%
interval and the paired difference's interval iteration by iteration, with a verdict computed
from it (margin +-1 point; issue 24 item 2; the settings are the paper's, fixed in advance,
nothing is chosen on the validation data; 5 seeds: a run takes well under a minute; the run
time of ``--full`` is unchanged by this bookkeeping, 153 s in the record). The paper publishes no
accuracy table for this run that we could compare with: the comparison is serial vs simultaneous
under the same code.

Accuracy, objective, evaluations and convergence factors are valid on a loaded machine; the wall
seconds and the CPU-calibrated modeled times (step costs measured here) need a quiet one.

Run (every study is one MPI command; ``table.md``/``summary.md`` are rebuilt from ``results.h5``)::

    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_guenther.py            # 40 its, 5 seeds
    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_guenther.py --full     # 130 its (the record)
    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_guenther.py --full --layers 1024
    mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_guenther.py --smoke --out /tmp/x
"""
from __future__ import annotations

import argparse
import copy
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
    p.add_argument("--report-only", action="store_true",
                   help="rebuild table.md, summary.md, plots from results.h5 without running")
    p.add_argument("--seeds", type=int, default=None,
                   help="weight initializations 0..S-1 (default 5; --smoke 2)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the Peaks data")
    reporting.add_study_flags(
        p, "paper scale: 130 L-BFGS iterations (the record)", "tiny: 3 iterations, 500 points, 2 seeds")
    a = p.parse_args(argv)
    if a.iters is None:
        a.iters = 3 if a.smoke else (130 if a.full else 40)
    if a.layers is None:
        a.layers = 30
    if a.train is None:
        a.train = 500 if a.smoke else 5000
    if a.smoke:
        a.val = min(a.val, 100)
    a.seeds = a.seeds or (2 if a.smoke else 5)
    return a


ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "reproductions"  # default results base folder
from mgrit.training import report as reporting  # noqa: E402  (light: stdlib + numpy)

# --help must not pay for torch/MPI start-up: answer it before the heavy imports
if __name__ == "__main__" and any(a in ("-h", "--help") for a in sys.argv[1:]):
    parse_args()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from data.peaks import make_peaks  # noqa: E402
from mgrit import perf  # noqa: E402
from mgrit.nn.chains import AdjointChain, ForwardChain  # noqa: E402
from experiments.reports.study_parts import write_part  # noqa: E402
from experiments.reproductions import guenther_report  # noqa: E402
from experiments.reproductions.guenther_problem import Problem, lbfgs_armijo  # noqa: E402
from mgrit.nn import DenseStep  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402


# ---------------------------------------------------------------------------- model / objective
def calibrate(width, batch, reps=5):
    """Step costs (seconds) of one residual layer on the whole batch, measured on the library's
    own propagators (``mgrit.nn.chains.ForwardChain`` / ``AdjointChain`` of 64 DenseSteps):
    single steps and batched calls over B intervals (affine fit, ``mgrit.perf.calibrate_step``)."""
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
    """Critical path of one fixed-iteration MGRIT solve: ``mgrit.perf.simulate`` (a replay of
    the solver's control flow) with the default :class:`mgrit.perf.CommCost`."""
    return perf.simulate(N, P, opts, K, None, tau, perf.CommCost(), nbytes).critical_path


def modeled_time(N, P, fw_opts, bw_opts, K, costs, serial):
    """Modeled seconds of one evaluation (forward + backward), critical path.

    serial: ``N (tau_f + tau_b) + 2 (P - 1) beta`` (notes' cost model, blocking chain).
    Simultaneous: MGRIT forward (K cycles) + adjoint (K cycles) critical paths
    (:func:`_mgrit_critical_path`) plus the parameter-gradient sweep ``ceil(N/P) tau_b``;
    default :class:`mgrit.perf.CommCost` (5 us, 5 GB/s), one state per message."""
    fwd, adj, nbytes = costs
    if serial:
        return N * (fwd.single + adj.single) + 2 * (P - 1) * perf.CommCost().message(nbytes)
    tf = _mgrit_critical_path(N, P, fw_opts, K, fwd, nbytes)
    tb = _mgrit_critical_path(N, P, bw_opts, K, adj, nbytes)
    return tf + tb + math.ceil(N / P) * adj.single


# ---------------------------------------------------------------------------- main
REC_KEYS = ("iter", "objective", "train_loss", "train_acc", "val_acc", "evals", "wall", "tries",
            "step", "fwd_res", "fwd_factor", "bwd_res", "bwd_factor")


def run_method(args, comm, method, seed, data):
    """One L-BFGS run of ``method`` from weight seed ``seed``; the per-iteration record."""
    xtr, ytr, xva, yva = data
    a = copy.copy(args)
    a.seed = seed
    prob = Problem(a, comm, method)
    comm.Barrier()
    t0 = time.perf_counter()
    rec = {k: [] for k in REC_KEYS}
    eval_time = [0.0]

    def on_iter(it, J, tries, step):
        te = time.perf_counter()
        (trl, tra), (_, vaa) = prob.serial_metrics([(xtr, ytr), (xva, yva)])
        eval_time[0] += time.perf_counter() - te
        lf, lb = prob.resnet.last_forward, prob.resnet.last_backward
        rf = lf.residuals if (lf is not None and method != "serial") else []
        rb = lb.residuals if (lb is not None and method != "serial") else []
        nan = float("nan")
        for k, v in (("iter", it), ("objective", J), ("train_loss", trl), ("train_acc", tra),
                     ("val_acc", vaa), ("evals", prob.n_eval), ("tries", tries), ("step", step),
                     ("wall", time.perf_counter() - t0 - eval_time[0]),
                     ("fwd_res", rf[-1] if rf else nan),
                     ("fwd_factor", lf.convergence_factors[-1] if len(rf) > 1 else nan),
                     ("bwd_res", rb[-1] if rb else nan),
                     ("bwd_factor", lb.convergence_factors[-1] if len(rb) > 1 else nan)):
            rec[k].append(v)
        if comm.Get_rank() == 0 and (it % 10 == 0 or it == args.iters):
            print(f"[{method} seed {seed}] it {it:4d} J={J:.5f} train_acc={tra:.3f} "
                  f"val_acc={vaa:.3f} evals={prob.n_eval}", flush=True)

    lbfgs_armijo(prob, xtr, ytr, args.iters, args.history, on_iter)
    solver = prob.resnet.forward_solver
    levels = len(solver.hierarchy.levels) if hasattr(solver, "hierarchy") else 0
    return rec, levels, (prob.fw_opts, prob.bw_opts)


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    if args.report_only:
        if rank == 0:
            guenther_report.write(reporting.results_dir(STUDY, args.out or OUT))
        return
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    if args.layers < P:
        raise SystemExit(f"--layers {args.layers} < {P} ranks: every rank needs a layer")
    xtr, ytr = make_peaks(args.train, args.data_seed, 0)
    xva, yva = make_peaks(args.val, args.data_seed, 1)
    data = (torch.as_tensor(xtr, dtype=torch.float64), torch.as_tensor(ytr),
            torch.as_tensor(xva, dtype=torch.float64), torch.as_tensor(yva))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in ("serial", "simultaneous"):
            raise SystemExit(f"unknown method {m!r}: use serial, simultaneous")
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
    series, levels, opts = {}, 0, {}
    for seed in range(args.seeds):
        for method in methods:
            rec, lv, opts[method] = run_method(args, comm, method, seed, data)
            levels = max(levels, lv)
            for k, v in rec.items():
                series[f"seed{seed}/{method}/{k}"] = v
    if rank != 0:
        return
    per_eval = {m: [modeled_time(N, q, *opts[m], args.mgrit_iters, costs, m == "serial")
                    for q in model_P] for m in methods}
    series.update({f"model/{m}/per_eval": v for m, v in per_eval.items()})
    series["model/P"] = model_P
    sc = []
    if "serial" in methods and "simultaneous" in methods:
        o = MGRITOptions(max_levels=args.max_levels, cfactor=args.cfactor,
                         min_coarse=args.min_coarse, relax=["F", "FCF"], tol=0,
                         max_iter=args.mgrit_iters)
        for n_model in sorted({N, 1024}):
            for q in (2, 8, 32, 128, 512):
                if q <= n_model:
                    sc.append([n_model, q, modeled_time(n_model, q, o, o, args.mgrit_iters, costs, True),
                               modeled_time(n_model, q, o, o, args.mgrit_iters, costs, False)])
    series["model/scaling"] = np.array(sc, dtype=float).reshape(-1, 4)
    meta = reporting.run_metadata(world_size=P)
    meta.update({f"setting_{k}": v for k, v in vars(args).items()})
    meta.update(methods=methods, levels=levels, paper=PAPER,
                calibrated_tau={"fwd_single": costs[0].single, "fwd_call": costs[0].call,
                                "fwd_item": costs[0].item, "adj_single": costs[1].single,
                                "adj_call": costs[1].call, "adj_item": costs[1].item})
    outdir = reporting.results_dir(STUDY, args.out or OUT)
    write_part(outdir / "results.h5", "run", series, meta)
    guenther_report.write(outdir)
    print(f"wrote {outdir}", flush=True)


if __name__ == "__main__":
    main()
