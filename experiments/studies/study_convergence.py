"""Study 5: MGRIT convergence factor of a dense tanh ResNet vs cfactor, levels, F vs FCF, depth N,
for random and for trained weights, beside the two-level bound of the notes.

Launch (any number of ranks; residual histories do not depend on it)::

    mpiexec -n 2 python -m mpi4py experiments/studies/study_convergence.py            # default, ~1 min
    mpiexec -n 2 python -m mpi4py experiments/studies/study_convergence.py --full     # N up to 4096
    mpiexec -n 2 python -m mpi4py experiments/studies/study_convergence.py --smoke --out /tmp/x

Setting: ``x_{k+1} = x_k + h tanh(W_k x_k + b_k)``, width 8, T = 1, h = T/N, float64, a batch of
inputs. One-factor-at-a-time sweeps around a base configuration (N, m, L, relax) with exact
solves (tol 1e-12, up to ``--iters`` cycles, zero initial guess). The measured convergence
factor is the geometric mean of ``r_{k+1}/r_k`` over the cycles before round-off.

Weights: ``random`` = N(0, (scale^2)/width) per layer, independent across layers (``--scale``);
``trained`` = the same initialization trained serially on Peaks (lift Linear(2, width), closing
Linear(width, 5), Adam lr 1e-2, ``--train-iters`` full-batch iterations on ``--train-points`` points, with Guenther's smoothness penalty
gamma_ddt * sum ||(W_k - W_{k-1})/h||^2 h).

Two-level bound (notes; Dobrev et al. 2017 for linear problems): per mode
``|lambda^m - mu| (1 - |mu|^{N/m}) / (1 - |mu|)`` (F), times ``|lambda|^m`` (FCF), with
``lambda = 1 + h omega``, ``mu = 1 + m h omega`` and ``omega`` the eigenvalues of the step's
Jacobian ``diag(tanh'(W_k x_k + b_k)) W_k`` at the serial states. APPROXIMATION: the formula is for
a linear, layer-independent propagator; we evaluate it per C-point layer k (as if all m layers of
its block equalled layer k, which is what the coarse step assumes) at each sample's state and
report the maximum over C-layers, samples and modes. It ignores the variation of W_k inside a
block (large for random weights), nonlinearity, and is a two-level bound also for L > 2.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "experiments", "results", "studies")  # default results base

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

from data import load_dataset  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402
from experiments.reports.study_parts import write_headline  # noqa: E402
from mgrit.nn import DenseStep, LayerParallelResNet, serial_resnet  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402

STUDY = "convergence"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    reporting.add_study_flags(p, "paper-scale sweeps (N up to 4096)",
                              "tiny sweeps for the test suite (seconds)")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="inputs per solve")
    p.add_argument("--scale", type=float, default=3.0, help="random weight scale (std*sqrt(width))")
    p.add_argument("--iters", type=int, default=12, help="max MGRIT cycles per solve")
    p.add_argument("--train-iters", type=int, default=100)
    p.add_argument("--train-points", type=int, default=200, help="Peaks points used for training")
    p.add_argument("--gamma-ddt", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.smoke:
        a.base = dict(N=32, m=4, L=2, relax="FCF")
        a.Ns, a.ms, a.Ls, a.iters, a.train_iters = [16, 32], [4], [2], 5, 3
    elif a.full:
        a.base = dict(N=256, m=4, L=2, relax="FCF")
        a.Ns, a.ms, a.Ls = [16, 64, 256, 1024, 4096], [2, 4, 8, 16, 32, 64], [2, 3, 4, 5]
        a.train_iters, a.train_points = 300, 1000
    else:
        a.base = dict(N=128, m=4, L=2, relax="FCF")
        a.Ns, a.ms, a.Ls = [16, 32, 64, 128, 256], [2, 4, 8, 16, 32], [2, 3, 4]
    return a


def make_step_fn(width, scale):
    def make(k):
        s = DenseStep(width, "tanh").double()
        with torch.no_grad():
            s.linear.weight.normal_(0.0, scale / math.sqrt(width))
            s.linear.bias.normal_(0.0, 0.1)
        return s
    return make


def train_weights(args, N, x, y):
    """Serial training on Peaks from the random init (identical on every rank)."""
    torch.manual_seed(args.seed + 17)
    lift, close = nn.Linear(2, args.width).double(), nn.Linear(args.width, 5).double()
    res = serial_resnet(make_step_fn(args.width, args.scale), N, seed=args.seed)
    params = list(lift.parameters()) + list(res.parameters()) + list(close.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    h = 1.0 / N
    for _ in range(args.train_iters):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(close(res(lift(x))), y)
        W = torch.stack([l.F.linear.weight for l in res])
        loss = loss + args.gamma_ddt * ((W[1:] - W[:-1]) ** 2).sum() / h
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (close(res(lift(x))).argmax(1) == y).double().mean().item()
    return lift, res, acc


def serial_states(layers, x0):
    xs = [x0]
    with torch.no_grad():
        for l in layers:
            xs.append(l(xs[-1]))
    return xs


def two_level_bound(layers, xs, N, m, relax):
    """Max over C-point layers, samples and modes of the notes' two-level bound."""
    h, worst = 1.0 / N, 0.0
    Nc = N // m
    for k in range(0, N, m):
        lin = layers[k].F.linear
        with torch.no_grad():
            z = xs[k] @ lin.weight.T + lin.bias
            d = 1 - torch.tanh(z) ** 2  # (batch, width)
        W = lin.weight.detach().numpy()
        for s in range(d.shape[0]):
            om = np.linalg.eigvals(d[s].numpy()[:, None] * W)
            lam, mu = 1 + h * om, 1 + m * h * om
            amu = np.abs(mu)
            geo = np.where(np.abs(1 - amu) < 1e-12, Nc, (1 - amu ** Nc) / np.where(
                np.abs(1 - amu) < 1e-12, 1, 1 - amu))
            b = np.abs(lam ** m - mu) * geo
            if relax == "FCF":
                b = b * np.abs(lam) ** m
            worst = max(worst, float(b.max()))
    return worst


def factor(res):
    r = [float(v) for v in res]
    if len(r) < 2 or r[0] == 0:
        return float("nan"), len(r)
    ratios = []
    for i in range(len(r) - 1):
        if r[i + 1] <= 1e-11 * r[0] or r[i + 1] < 1e-13:
            break
        ratios.append(r[i + 1] / r[i])
    if not ratios:  # converged to round-off in one cycle
        return r[1] / r[0] if r[0] else float("nan"), len(r)
    return float(np.exp(np.mean(np.log(ratios)))), len(r)


def measure(comm, layers, x0, N, m, L, relax, iters, width):
    """Exact MGRIT forward solve on ``comm`` with the weights of ``layers``; returns history."""
    opts = MGRITOptions(max_levels=L, cfactor=m, tol=1e-12, max_iter=iters, relax=relax,
                        min_coarse=2)
    rn = LayerParallelResNet.build(lambda k: DenseStep(width, "tanh").double(), N, (width,),
                                   comm=comm, forward=opts, warm_start=False)
    for j, s in enumerate(rn.steps):
        s.load_state_dict(layers[rn.first + j].F.state_dict())
    with torch.no_grad():
        rn(x0 if rn.is_first else None, batch_size=x0.shape[0])
    return list(rn.last_forward.residuals)


def _sweep(rows, kind, sweep, col, exact_ok=False):
    """``(x, factor, bound)`` of one sweep (rows of the table), in table order."""
    return [(r[col], r[6], r[7]) for r in rows if r[0] == kind and r[1] == sweep]


def _fmt(vals, i):
    return " / ".join("exact" if v[i] < 1e-12 else f"{v[i]:.3g}" for v in vals)


def summary(rows, meta, b, args):
    """summary.md: every number below is taken from ``rows`` (the rows of table.md)."""
    L = ["# Study 5: MGRIT convergence vs cfactor, levels, relaxation, depth; random vs trained "
         "weights", "",
         "Generated by `experiments/studies/study_convergence.py` from the rows of `table.md` (command, "
         "commit, machine there). Deterministic (float64, seeded): valid on a loaded machine.", "",
         "**What the literature says (notes digest).** Two-level error reduction per cycle is "
         "bounded by max over modes |lambda^m - mu| (1 - |mu|^(N/m)) / (1 - |mu|) (F-relaxation; "
         "FCF multiplies by |lambda|^m), lambda = 1 + h omega, mu = 1 + m h omega: fast when "
         "m h |omega| is small, slower with m; random (non-smooth in depth) weights converge worse "
         "than trained, smooth ones (Günther et al. 2020); FCF beats F; roughly level-independent.", "",
         f"**Setting.** Dense tanh ResNet x + h tanh(W_k x + b_k), width {args.width}, T = 1, "
         f"h = 1/N, float64, {args.batch} inputs per solve, exact solves (tol 1e-12, <= "
         f"{args.iters} cycles, zero initial guess). Random: W_k ~ N(0, {args.scale}^2 / "
         f"{args.width}) per layer. Trained: the same initialization trained {args.train_iters} "
         f"full-batch Adam iterations on {args.train_points} Peaks points (gamma_ddt "
         f"{args.gamma_ddt}). Base N = {b['N']}, m = {b['m']}, {b['L']} levels, {b['relax']}; one "
         "factor varied at a time. Factor = geometric mean of r_(k+1)/r_k before round-off; "
         "'exact' = the solve terminated exactly (finite termination of two-level FCF after "
         "ceil(N/(2m)) cycles, F after N/m).", "",
         "| sweep | random: factor (bound) | trained: factor (bound) |", "|---|---|---|"]
    for sweep, col, name in (("N", 2, "N"), ("cfactor", 3, "m (FCF)"), ("cfactor/F", 3, "m (F)"),
                             ("levels", 4, "levels")):
        cells = []
        for kind in ("random", "trained"):
            v = _sweep(rows, kind, sweep, col)
            cells.append(f"{_fmt(v, 1)} ({_fmt(v, 2)})" if v else "-")
        xs = [str(r[0]) for r in _sweep(rows, "random", sweep, col)]
        L.append(f"| {name} = {' / '.join(xs)} | {cells[0]} | {cells[1]} |")
    base = {k: [r for r in rows if r[0] == k and r[1] == "relax"] for k in ("random", "trained")}
    L += ["", "**Readings (numbers from the rows above).**", ""]
    for kind in ("random", "trained"):
        rel = {r[5]: r[6] for r in base[kind]}
        if "F" in rel and "FCF" in rel:
            L.append(f"- {kind}: base configuration F {rel['F']:.3g} vs FCF {rel['FCF']:.3g}.")
    fr = {k: {r[5]: r[6] for r in base[k]} for k in base}
    if fr["random"].get("FCF") and fr["trained"].get("FCF"):
        L.append(f"- trained / random factor at the base configuration (FCF): "
                 f"{fr['trained']['FCF'] / fr['random']['FCF']:.2f}.")
    above = sum(1 for r in rows if not (r[6] < 1e-12) and r[7] >= r[6])
    total = sum(1 for r in rows if not (r[6] < 1e-12))
    L += [f"- the two-level bound is above the measured factor in {above} of {total} rows that did "
          "not terminate exactly.", "",
          "**Caveats.** The bound uses the linearization diag(tanh'(z_k)) W_k at each C-layer's "
          "serial state, as if every layer of its block equalled the C-layer (the coarse step's "
          "assumption); it ignores variation of W_k inside a block, non-normality and "
          "nonlinearity, and is the two-level bound also for L > 2: an approximation, not a "
          "theorem for this network. The 'trained' weights are lightly trained."]
    return "\n".join(L) + "\n"


def headline(rows, b):
    base = {(r[0], r[5]): r[6] for r in rows if r[1] == "relax"}
    ms = {k: _sweep(rows, k, "cfactor", 3) for k in ("random", "trained")}
    return [{"claim": "factor grows with m; FCF < F; trained (smooth) < random weights",
             "ours": f"N = {b['N']}, m = {b['m']}: random F {base.get(('random', 'F'), float('nan')):.3g} / "
                     f"FCF {base.get(('random', 'FCF'), float('nan')):.3g}, trained F "
                     f"{base.get(('trained', 'F'), float('nan')):.3g} / FCF "
                     f"{base.get(('trained', 'FCF'), float('nan')):.3g}; FCF vs m (random): "
                     + ", ".join(f"m = {x}: {'exact' if f < 1e-12 else f'{f:.3g}'}"
                                 for x, f, _ in ms["random"]),
             "kind": "measured"}]


def main(argv=None):
    args = parse(argv)
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tr, _ = load_dataset("peaks")
    idx = np.random.default_rng(args.seed).permutation(len(tr))[:args.train_points]
    xp = torch.as_tensor(tr.x[idx], dtype=torch.float64)
    yp = torch.as_tensor(tr.y[idx], dtype=torch.long)
    g = torch.Generator().manual_seed(args.seed)
    x_rand = torch.randn(args.batch, args.width, generator=g, dtype=torch.float64)

    cache = {}

    def weights(kind, N):
        if (kind, N) not in cache:
            if kind == "random":
                layers = serial_resnet(make_step_fn(args.width, args.scale), N, seed=args.seed)
                cache[kind, N] = (layers, x_rand, float("nan"))
            else:  # trained once on rank 0, broadcast
                got = None
                if rank == 0:
                    lift, layers, acc = train_weights(args, N, xp, yp)
                    with torch.no_grad():
                        got = (layers, lift(xp[:args.batch]), acc)
                cache[kind, N] = comm.bcast(got, root=0)
        return cache[kind, N]

    b = args.base
    configs = []
    for N in args.Ns:
        configs.append(("N", dict(b, N=N)))
    for m in args.ms:
        configs.append(("cfactor", dict(b, m=m)))
    for L in args.Ls:
        configs.append(("levels", dict(b, L=L)))
    for relax in ("F", "FCF"):
        configs.append(("relax", dict(b, relax=relax)))
        for m in args.ms:
            configs.append((f"cfactor/{relax}", dict(b, m=m, relax=relax)))
    rows, done = [], {}
    for kind in ("random", "trained"):
        for sweep, c in configs:
            N, m, L, relax = c["N"], c["m"], c["L"], c["relax"]
            if N // m < 2 or N < P:
                continue
            key = (kind, N, m, L, relax)
            if key not in done:  # the sweeps share the base configuration: solve once
                layers, x0, acc = weights(kind, N)
                hist = measure(comm, layers, x0, N, m, L, relax, args.iters, args.width)
                rho, n = factor(hist)
                bound = two_level_bound(layers, serial_states(layers, x0), N, m, relax)
                done[key] = [rho, bound, n, hist[-1] if hist else float("nan"), acc]
            # two-level FAS with F(CF)^k is exact after ceil(N_c / (k + 1)) cycles (N_c = N/m)
            exact_by = -(-(N // m) // (1 + (1 if relax == "FCF" else 0))) if L == 2 else ""
            rows.append([kind, sweep, N, m, L, relax, *done[key][:3], exact_by, *done[key][3:]])
    if rank == 0:
        meta = reporting.run_metadata(world_size=P)
        meta["setting"] = (f"dense tanh ResNet width {args.width}, T=1, float64, batch {args.batch}, "
                           f"random scale {args.scale}, trained {args.train_iters} Adam its on Peaks "
                           f"(gamma_ddt {args.gamma_ddt}); base {b}")
        d = reporting.results_dir(STUDY, args.out or OUT)
        cols = ["weights", "sweep", "N", "cfactor", "levels", "relax", "factor", "bound2",
                "cycles", "exact_by", "final_res", "train_acc"]
        arr = {c: [r[i] for r in rows] for i, c in enumerate(cols)
               if c not in ("weights", "sweep", "relax", "exact_by")}
        arr["weights_trained"] = [int(r[0] == "trained") for r in rows]
        arr["relax_fcf"] = [int(r[5] == "FCF") for r in rows]
        arr["sweep"] = np.array([r[1] for r in rows], dtype="S16")
        reporting.save_series(d / "results.h5", arr, meta)
        body = ("Measured convergence factor (geometric mean of r_{k+1}/r_k before round-off) "
                "beside the two-level bound of the notes (approximation: per C-layer linearization at "
                "the serial states, max over layers/samples/modes; two-level even for L > 2). "
                "`exact_by`: cycle count after which two-level F / FCF is exact (finite termination, "
                "ceil(N/m / 1) for F, ceil(N/m / 2) for FCF); a factor ~1e-16 means the solve "
                "terminated that way. `cycles` counts residual evaluations (max --iters).\n\n")
        body += reporting.markdown_table(cols, rows)
        reporting.write_table(d / "table.md", "MGRIT convergence study", meta, body)
        (d / "summary.md").write_text(summary(rows, meta, b, args))
        write_headline(d, headline(rows, b), [meta])
        def plotted(f):
            return f if f > 1e-12 else float("nan")

        for sweep, key, xl, logx in (("N", 2, "depth N", True), ("cfactor", 3, "cfactor m", True),
                                     ("levels", 4, "levels", False)):
            curves = {}
            for kind in ("random", "trained"):
                sel = [r for r in rows if r[0] == kind and r[1] == sweep]
                if sel:  # finite termination (factor ~ round-off) is not plotted
                    curves[f"{kind} measured"] = ([r[key] for r in sel], [plotted(r[6]) for r in sel])
                    curves[f"{kind} 2-level bound"] = ([r[key] for r in sel], [r[7] for r in sel])
            reporting.plot_lines(d / f"factor_vs_{sweep}.png", curves, xl, "convergence factor",
                                 title=f"vs {sweep}; base N={b['N']} m={b['m']} L={b['L']} {b['relax']}",
                                 logy=True, logx=logx)
        curves = {}
        for kind in ("random", "trained"):
            for relax in ("F", "FCF"):
                sel = [r for r in rows if r[0] == kind and r[1] == f"cfactor/{relax}"]
                if sel:
                    curves[f"{kind} {relax}"] = ([r[3] for r in sel], [plotted(r[6]) for r in sel])
        reporting.plot_lines(d / "factor_F_vs_FCF.png", curves, "cfactor m", "convergence factor",
                             title="F vs FCF relaxation", logy=True, logx=True)
        print(body)
        print(f"wrote {d} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
