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
loss/accuracy and validation accuracy, evaluations, wall time and the MGRIT residuals /
convergence factors of the forward and adjoint solves.

Timing part (``guenther_timing``; results group ``timing``, raw per-repeat seconds in
``timing.raw.json``): wall time per objective evaluation of both methods at P = 1 and the world
size, at ``--timing-depths`` (default N and 256), ``--timing-reps`` (10) interleaved repeats
with the IQR beside each median; the gradient error of the simultaneous (inexact) evaluation
against the serial one; ``--calibrations`` (3) independent calibrations of the cost model
(``modeled_time``), its prediction/measurement ratio at every measured point and the min-max of
every extrapolated number (P up to ``--model-ranks``) over the calibrations. A model off by more
than 25% at a measured point is NOT validated and its extrapolations are not reported as
results (``model_check``). The serial evaluation's cost is calibrated on its own code path
(``calibrate_serial``, a separate 64-layer chain, not a timed network); the kernel-cost model
used before (6-8x off at the measured points in smoke runs) is kept beside it with its error.

Run time of ``--full`` (both parts): 422 s (7 min) measured at 48a9d82, 2 idle cores
(``results/manifest.json``). ``--smoke`` (eager backend): ~35 s of CPU per rank.

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

The authors' own program (``guenther_authors``; their network, glibc initialization, objective
and L-BFGS; every row compared with their reference outputs on 1, 2 and 5 ranks; no MPI launch
needed, it starts its runs itself)::

    python experiments/reproductions/reproduce_guenther.py --authors-config ../shared/data/lpl_peaks
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
    p.add_argument("--model-ranks", default="2,8,32,128,256",
                   help="comma list of rank counts P of the modeled extrapolation")
    p.add_argument("--timing-depths", type=int, nargs="+", default=None,
                   help="depths whose evaluation is timed at P = 1 and the world size (default: "
                        "--layers and 256; --smoke: --layers); the model is extrapolated in P "
                        "at these depths only (1024 would cost ~3 minutes more on 2 cores)")
    p.add_argument("--timing-reps", type=int, default=None,
                   help="interleaved timed evaluations per method (default 10; --smoke 3)")
    p.add_argument("--calibrations", type=int, default=3,
                   help="repeated calibrations of the cost model (the extrapolations' spread)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend of the compiled baselines ('' = none; default "
                        "inductor, --smoke eager: dynamo without a compiler)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild table.md, summary.md, plots from results.h5 without running")
    p.add_argument("--seeds", type=int, default=None,
                   help="weight initializations 0..S-1 (default 5; --smoke 2)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the Peaks data")
    p.add_argument("--authors-config", metavar="DIR", default=None,
                   help="run the authors' configuration against their reference outputs in DIR "
                        "instead (see --authors-config DIR --help)")
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
    a.timing_depths = sorted(set(a.timing_depths or ([a.layers] if a.smoke else [a.layers, 256])))
    a.timing_reps = a.timing_reps or (3 if a.smoke else 10)
    if a.compile_backend is None:
        a.compile_backend = "eager" if a.smoke else "inductor"
    return a


ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "reproductions"  # default results base folder
from mgrit.reporting import writers as reporting  # noqa: E402  (light: stdlib + numpy)

# the authors' own configuration against their reference outputs (guenther_authors): the
# launcher starts every run with mpiexec, so it must not initialize MPI itself
if __name__ == "__main__" and any(a.startswith("--authors-config") for a in sys.argv[1:]):
    from experiments.reproductions import guenther_authors
    sys.exit(guenther_authors.main(sys.argv[1:], Path(__file__).resolve()))
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
from experiments.reproductions import guenther_report, guenther_timing  # noqa: E402
from experiments.reproductions.guenther_problem import Problem, lbfgs_armijo  # noqa: E402
from mgrit.nn import DenseStep, ResidualStep  # noqa: E402
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


def calibrate_serial(width, batch, reps=5):
    """Seconds per residual layer of the SERIAL evaluation's own code path: forward + autograd
    backward through ``ResidualStep(DenseStep)`` modules (what 1-level training runs; the
    propagator kernels of :func:`calibrate` are not on that path), median over ``reps`` runs of
    a separate 64-layer chain (not a network that is timed in the study)."""
    torch.manual_seed(1)
    n = 64
    net = torch.nn.Sequential(*[ResidualStep(DenseStep(width, "smoothrelu"), 1.0 / n)
                                for _ in range(n)])
    x = torch.randn(batch, width)

    def run():
        net.zero_grad(set_to_none=True)
        net(x).sum().backward()

    run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / n


def _mgrit_critical_path(N, P, opts, K, tau, nbytes):
    """Critical path of one fixed-iteration MGRIT solve: ``mgrit.perf.simulate`` (a replay of
    the solver's control flow) with the default :class:`mgrit.perf.CommCost`."""
    return perf.simulate(N, P, opts, K, None, tau, perf.CommCost(), nbytes).critical_path


def modeled_time(N, P, fw_opts, bw_opts, K, costs, serial, kernels=False):
    """Modeled seconds of one evaluation (forward + backward), critical path.

    serial: ``N tau_serial + 2 (P - 1) beta`` (blocking chain) with ``tau_serial`` the
    serial path's own forward + backward per layer (:func:`calibrate_serial`, the 4th entry of
    ``costs``); with 3 entries (or ``kernels=True``) the notes' ``tau_f + tau_b`` of the
    propagator kernels, which the serial path does not run (the model before issue 24).
    Simultaneous: MGRIT forward (K cycles) + adjoint (K cycles) critical paths
    (:func:`_mgrit_critical_path`) plus the parameter-gradient sweep ``ceil(N/P) tau_b``;
    default :class:`mgrit.perf.CommCost` (5 us, 5 GB/s), one state per message."""
    fwd, adj, nbytes = costs[:3]
    if serial:
        tau = fwd.single + adj.single if kernels or len(costs) < 4 else costs[3]
        return N * tau + 2 * (P - 1) * perf.CommCost().message(nbytes)
    tf = _mgrit_critical_path(N, P, fw_opts, K, fwd, nbytes)
    tb = _mgrit_critical_path(N, P, bw_opts, K, adj, nbytes)
    return tf + tb + math.ceil(N / P) * adj.single


def timing_part(args, comm, data, costs_list):
    """The ``timing`` part of ``results.h5`` (``guenther_timing``): measured seconds per
    evaluation (median, IQR, min-max) per ``(P, N, method)``, the simultaneous evaluation's
    gradient error, and the cost model per calibration at the measured points and the
    extrapolation's ``(N, P)``; raw per-repeat times in ``timing.raw.json``."""
    samples, gerr, notes = guenther_timing.measure(args, comm, data, args.timing_depths,
                                                   args.timing_reps, args.compile_backend)
    if comm.Get_rank() != 0:
        return
    o = MGRITOptions(max_levels=args.max_levels, cfactor=args.cfactor, min_coarse=args.min_coarse,
                     relax=["F", "FCF"], tol=0, max_iter=args.mgrit_iters)
    qs = sorted({int(v) for v in args.model_ranks.split(",")} | {1, comm.Get_size()})
    points = [(n, q) for n in args.timing_depths for q in qs if q <= n]
    model = guenther_timing.model_rows(args, costs_list, points, (o, o), modeled_time)
    rows = []
    for key, v in samples.items():
        P, N, m = key.split("/")
        sp = reporting.spread(v)
        rows.append((int(P[2:]), int(N[2:]), guenther_timing.METHODS.index(m), sp["median"],
                     sp["q1"], sp["q3"], sp["min"], sp["max"]))
    series = {f"meas_{k}": [r[i] for r in rows] for i, k in enumerate(
        ("P", "N", "method", "median", "q1", "q3", "min", "max"))}
    series.update({f"gerr_{k}": [g[i] for g in gerr] for i, k in enumerate(("P", "N", "value"))})
    series.update({f"model_{k}": [r[i] for r in model] for i, k in enumerate(
        ("cal", "N", "P", "serial", "simultaneous", "serial_kernels"))})
    meta = reporting.run_metadata(world_size=comm.Get_size())
    meta.update(methods=list(guenther_timing.METHODS), reps=args.timing_reps,
                mgrit_iters=args.mgrit_iters, train_points=args.train, compile=notes,
                calibrated_tau=[{"fwd": [c[0].single, c[0].call, c[0].item],
                                 "adj": [c[1].single, c[1].call, c[1].item],
                                 "serial_layer": c[3]} for c in costs_list])
    outdir = reporting.results_dir(STUDY, args.out or OUT)
    reporting.write_raw(outdir / "timing.raw.json", samples, meta)
    write_part(outdir / "results.h5", "timing", series, meta)


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
    costs_list = None
    if rank == 0:
        reps = 3 if args.smoke else 5
        costs_list = [(*calibrate(args.width, args.train, reps=reps), args.train * args.width * 8,
                       calibrate_serial(args.width, args.train, reps=reps))
                      for _ in range(args.calibrations)]
    costs_list = comm.bcast(costs_list, root=0)
    costs = costs_list[0]
    series, levels, opts = {}, 0, {}
    for seed in range(args.seeds):
        for method in methods:
            rec, lv, opts[method] = run_method(args, comm, method, seed, data)
            levels = max(levels, lv)
            for k, v in rec.items():
                series[f"seed{seed}/{method}/{k}"] = v
    if "serial" in methods and "simultaneous" in methods:
        timing_part(args, comm, data, costs_list)
    if rank != 0:
        return
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
