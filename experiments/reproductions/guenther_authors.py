"""The authors' own program, reproduced digit for digit: ``reproduce_guenther.py --authors-config DIR``.

Günther, Ruthotto, Schroder, Cyr, Gauger (SIMODS 2020) ship reference outputs of their Peaks
test with their code (github.com/steffi7574/LayerParallelLearning): ``testing/peaks.npt{P}.ml{L}
.optim.dat`` at commit 311bc40 (20 L-BFGS iterations on P = 1, 2, 5 ranks; ``ml1``: one level,
``ml10``: XBraid, cfactor 2, two levels, 2 cycles per solve with warm restarts) and
``testing/peaks.ml{1,10}.optim.ref`` at 4e7af11 (2 iterations; ``ml10`` converged, 15 cycles).
``DIR`` is a clone of their repository at 311bc40 (``data/``, ``testing/``) or a folder laid out
as ``shared/data/lpl_peaks`` (``features_training.dat.gz``..., ``ref_311bc40/``, ``ref_4e7af11/``).
No file of theirs is shipped here.

Pieces: :func:`find_files` / :func:`load_data` / :func:`read_reference` (their files),
:func:`authors_args` (the reproduction's problem options at the reference's values, read from the
printed config of each output file), :func:`lbfgs_authors` (their main loop and L-BFGS,
hessianApprox.cpp / main.cpp: H0 = 1 at iteration 0, ``H0 = s^T y / y^T y`` of the latest pair,
no curvature test, no restart, backtracking from step 1 by halving with the design updated in
place, at most ``ls_maxiter`` trials, the objective of a trial by a forward solve only, each
iteration's row from a fresh forward and adjoint solve), :func:`run_rows` (one run on this
communicator); the comparison and the verdict are in ``guenther_compare``.
"""
from __future__ import annotations

import gzip
import math
import re
from argparse import Namespace
from pathlib import Path

import numpy as np

from experiments.reproductions.guenther_compare import (  # noqa: F401  (re-exported)
    ALLOWANCE, COMPARED, compare, fmt_row, headline_row, rel_diffs, spread, write_results)

COLUMNS = ("iter", "rnorm", "rnorm_adj", "objective", "loss", "gnorm", "stepsize", "ls_iter",
           "acc_train", "acc_val")
RUNS = [("311bc40", P, L) for L in (1, 10) for P in (1, 2, 5)] + [("4e7af11", 1, 1), ("4e7af11", 1, 10)]

_DATA = {"train_x": ("features_training.dat", "data/Ytrain_orig.dat"),
         "train_y": ("labels_training.dat", "data/Ctrain_orig.dat"),
         "val_x": ("features_validation.dat", "data/Yval_orig.dat"),
         "val_y": ("labels_validation.dat", "data/Cval_orig.dat")}


def _first(root: Path, names):
    for n in names:
        for cand in (root / n, root / (n + ".gz")):
            if cand.is_file():
                return cand
    return None


def find_files(root) -> dict:
    """Paths of the data and reference files under ``root`` (a clone at 311bc40 or the
    ``lpl_peaks`` layout). ``FileNotFoundError`` naming what is missing."""
    root = Path(root)
    out = {k: _first(root, names) for k, names in _DATA.items()}
    for commit, P, L in RUNS:
        name = f"peaks.npt{P}.ml{L}.optim.dat" if commit == "311bc40" else f"peaks.ml{L}.optim.ref"
        out[(commit, P, L)] = _first(root, [f"ref_{commit}/{name}"] + (
            [f"testing/{name}"] if commit == "311bc40" else []))
    missing = [str(k) for k, v in out.items() if v is None and not (isinstance(k, tuple) and k[0] != "311bc40")]
    if missing:
        raise FileNotFoundError(f"{root}: not the authors' repository at 311bc40 nor the lpl_peaks "
                                f"folder; missing {', '.join(missing)}")
    return out


def _text(path: Path) -> str:
    return (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)).read()


def load_data(files: dict):
    """``(x_train, y_train, x_val, y_val)``: float64 features ``(n, 2)``, class indices (their
    labels are one-hot rows)."""
    import io
    arr = {k: np.loadtxt(io.StringIO(_text(files[k]))) for k in _DATA}
    return arr["train_x"], arr["train_y"].argmax(1), arr["val_x"], arr["val_y"].argmax(1)


def read_reference(path) -> tuple[dict, list]:
    """``(config, rows)`` of one output file: the config it printed (``{name: text}``) and its
    rows as dicts over :data:`COLUMNS` (accuracies in %)."""
    cfg, rows = {}, []
    for line in _text(Path(path)).splitlines():
        if line.startswith("#"):
            m = re.match(r"#(?:[^:]*:)?\s+(\S(?:.*?\S)?)\s{2,}(\S+)\s*$", line)
            if m:
                cfg[m.group(1)] = m.group(2)
        elif line.strip():
            v = line.split()
            rows.append({c: (int(x) if c in ("iter", "ls_iter") else float(x.rstrip("%")))
                         for c, x in zip(COLUMNS, v)})
    return cfg, rows


def authors_args(cfg: dict, n_train: int) -> Namespace:
    """The reproduction's problem options at the values a reference file printed (the
    reproduction's study defaults differ: see ``guenther_problem``'s module docstring)."""
    f = lambda k: float(cfg[k])  # noqa: E731
    levels = int(cfg["max levels"])
    return Namespace(
        layers=int(cfg["nlayers"]) - 2, width=int(cfg["nchannels"]), T=f("T"), classes=int(cfg["nclasses"]),
        opening="zero" if f("weights_open_init") == 0 else "dense", bias="scalar", init="glibc",
        init_scale=f("weights_init"), ddt_form="plain", ddt_gradient=False,
        gamma_tik=f("gamma_tik"), gamma_ddt=f("gamma_ddt"), gamma_class=f("gamma_class"),
        history=int(cfg["lbfgs_stages"]), step0=f("stepsize"), ls_maxiter=int(cfg["max. ls iter"]),
        ls_factor=f("ls factor"), gtol=f("gtol"), iters=int(cfg["max. optim iter"]),
        max_levels=levels, cfactor=int(cfg["coasening"]), min_coarse=int(cfg["min coarse"]),
        mgrit_iters=int(cfg["max. braid iter"]), warm_adjoint=True, metrics=True, seed=0,
        first_step="gradient", restart=False, xbraid_adjoint=True, partition="xbraid",
        method="serial" if levels == 1 else "simultaneous", train=n_train)


def lbfgs_authors(prob, x, y, a, on_row):
    """The authors' optimization loop (main.cpp at 311bc40) over the distributed design.

    Per iteration: a forward and an adjoint solve at the current design give the row
    (objective, loss, gradient norm, the previous line search's step and trial index, training
    accuracy); then the L-BFGS memory update and two-loop direction ``d = H g``, the wolfe value
    ``g^T d``, ``design -= step0 * d`` and backtracking: a forward solve per trial, accepted when
    ``J_trial <= J - 1e-4 * step * g^T d``, else ``step *= ls_factor`` and
    ``design += step * d`` (at most ``ls_maxiter`` trials; the last is kept)."""
    M = a.history
    S, Y, rho = [None] * M, [None] * M, [0.0] * M
    H0, stepsize, ls_iter, start = 1.0, a.step0, 0, 0
    design = prob.get_flat()
    design0 = grad0 = None
    for it in range(a.iters):
        prob.set_flat(design)
        J, g = prob.evaluate(x, y)
        gnorm = math.sqrt(prob.dot(g, g))
        on_row(it, J, gnorm, stepsize, ls_iter)
        if gnorm < a.gtol or it == a.iters - 1:
            break
        if it == start and a.first_step == "unit":  # the study's choice: a first step of length 1
            H0 = 1.0 / gnorm
        if it > start:
            im = (it - 1) % M
            Y[im], S[im] = g - grad0, design - design0
            yts, yty = prob.dot(Y[im], S[im]), prob.dot(Y[im], Y[im])
            yts, yty = yts if yts != 0.0 else 1.0, yty if yty != 0.0 else 1.0
            rho[im], H0 = 1.0 / yts, yts / yty
        d = g.clone()
        alpha = [0.0] * M
        imin = start if it - start < M else it - M
        for i in range(it - 1, imin - 1, -1):
            im = i % M
            alpha[im] = rho[im] * prob.dot(S[im], d)
            d -= alpha[im] * Y[im]
        d *= H0
        for i in range(imin, it):
            im = i % M
            beta = rho[im] * prob.dot(Y[im], d)
            d += S[im] * (alpha[im] - beta)
        design0, grad0 = design.clone(), g.clone()
        wolfe = prob.dot(g, d)
        if a.restart and not wolfe > 0:  # the study's choice: restart from -g when not descent
            start, d = it, g / gnorm
            wolfe = prob.dot(g, d)
        design = design - a.step0 * d
        stepsize = a.step0
        for ls_iter in range(a.ls_maxiter):
            prob.set_flat(design)
            J_trial, _ = prob.evaluate(x, y, need_grad=False)
            if J_trial <= J - 1e-4 * stepsize * wolfe or ls_iter == a.ls_maxiter - 1:
                break
            stepsize *= a.ls_factor
            design = design + stepsize * d


def _run_rows(cfg: dict, data, comm, iters=None, overrides=None) -> list:
    import torch

    from experiments.reproductions.guenther_problem import Problem
    xtr, ytr, xva, yva = (torch.as_tensor(v) for v in data)
    a = authors_args(cfg, len(xtr))
    vars(a).update(overrides or {})
    if iters is not None:
        a.iters = min(a.iters, iters)
    prob = Problem(a, comm, a.method)
    rows = []

    def on_row(it, J, gnorm, stepsize, ls_iter):
        loss, acc = prob.last_metrics
        (_, _), (_, acc_val) = prob.serial_metrics([(xva[:1], yva[:1]), (xva, yva)])
        # XBraid's printed norm: computed before the last cycle's correction (= our residual
        # after the cycle before), spatial norms divided by the number of samples
        res = lambda r: r.residuals[-2] / len(xtr) if r is not None and len(r.residuals) > 1 else -1.0  # noqa: E731
        lf, lb = prob.resnet.last_forward, prob.resnet.last_backward
        rows.append(dict(iter=it, rnorm=res(lf) if a.max_levels > 1 else -1.0,
                         rnorm_adj=res(lb) if a.max_levels > 1 else -1.0, objective=J, loss=loss,
                         gnorm=gnorm, stepsize=stepsize, ls_iter=ls_iter, acc_train=acc,
                         acc_val=100.0 * acc_val))

    lbfgs_authors(prob, xtr, ytr, a, on_row)
    return rows


def run_rows(cfg: dict, data, comm, iters=None, overrides=None) -> list:
    """One run of the authors' configuration ``cfg`` (a reference file's printed config; the
    problem options in ``overrides`` replaced) on ``comm``, in float64 (the default dtype is
    restored afterwards): its rows (dicts over :data:`COLUMNS`, every rank)."""
    import torch
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _run_rows(cfg, data, comm, iters, overrides)
    finally:
        torch.set_default_dtype(old)


# ---------------------------------------------------------------------------- command line
def parse_args(argv):
    import argparse
    p = argparse.ArgumentParser(
        prog="reproduce_guenther.py",
        description="Run the authors' Peaks configuration (their network, initialization, "
                    "objective and L-BFGS) on 1, 2, 5 ranks, one and two levels, and compare "
                    "every printed row with their reference outputs. Each problem option "
                    "defaults to the reference's value (read from each output file's header).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--authors-config", required=True, metavar="DIR",
                   help="their repository at 311bc40, or a folder laid out as shared/data/lpl_peaks")
    p.add_argument("--ranks", default="1,2,5", help="comma list of rank counts")
    p.add_argument("--levels", default="1,10", help="comma list of braid_maxlevels (1 and/or 10)")
    p.add_argument("--commits", default="311bc40,4e7af11",
                   help="reference outputs: 311bc40 (20 iterations, ml10 inexact), 4e7af11 "
                        "(2 iterations, ml10 converged; its 1-rank file is the reference for every P)")
    p.add_argument("--iters", type=int, default=None, help="compare only the first ITERS rows")
    p.add_argument("--timeout", type=int, default=600, help="seconds per MPI run")
    p.add_argument("--out", default=None, metavar="BASE",
                   help="also write BASE/guenther2020/authors.{json,md} and its Results row "
                        "(headline.json; the record: experiments/results/reproductions)")
    g = p.add_argument_group("problem options (default: the reference's values)")
    for flag, kw in (("--T", dict(type=float)), ("--layers", dict(type=int)),
                     ("--opening", dict(choices=("zero", "dense"))),
                     ("--bias", dict(choices=("scalar", "channel"))),
                     ("--init", dict(choices=("glibc", "torch"))),
                     ("--ddt-form", dict(choices=("plain", "h"))),
                     ("--ddt-gradient", dict(type=lambda v: v == "yes", metavar="{no,yes}")),
                     ("--history", dict(type=int, help="L-BFGS pairs (theirs 20)")),
                     ("--first-step", dict(choices=("gradient", "unit"))),
                     ("--restart", dict(type=lambda v: v == "yes", metavar="{no,yes}")),
                     ("--ls-maxiter", dict(type=int, help="line-search trials (theirs 20)")),
                     ("--partition", dict(choices=("xbraid", "even"))),
                     ("--xbraid-adjoint", dict(type=lambda v: {"yes": True, "no": False}.get(v, v),
                                               metavar="{yes,no,coarse,gradient}",
                                               help="two levels: the adjoint solve as XBraid's "
                                                    "(no: layerpar's own; coarse/gradient: one "
                                                    "of the two differences; guenther_xbraid)"))):
        g.add_argument(flag, default=None, **kw)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # commit,P,L of one MPI run
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


_OPTION_KEYS = ("T", "layers", "opening", "bias", "init", "ddt_form", "ddt_gradient", "history",
                "first_step", "restart", "ls_maxiter", "xbraid_adjoint", "partition")


def main(argv, script) -> int:
    """``--authors-config``: without ``--worker`` launch every run with ``mpiexec`` and print the
    comparison (exit status 1 when a run differs); with it, one run on ``COMM_WORLD``."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    import time
    a = parse_args(argv)
    try:
        files = find_files(a.authors_config)
    except FileNotFoundError as exc:
        raise SystemExit(f"--authors-config: {exc}") from None
    overrides = {k: getattr(a, k) for k in _OPTION_KEYS if getattr(a, k) is not None}
    if a.worker:
        import torch
        from mpi4py import MPI
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1)
        commit, P, L = a.worker.split(",")
        cfg, ref = read_reference(files[(commit, 1 if commit == "4e7af11" else int(P), int(L))])
        iters = min(len(ref), a.iters or len(ref))
        rows = run_rows(cfg, load_data(files), MPI.COMM_WORLD, iters, overrides)
        if MPI.COMM_WORLD.Get_rank() == 0:
            Path(a.json).write_text(json.dumps(rows))
        return 0
    refs = {k: read_reference(v)[1] for k, v in files.items() if isinstance(k, tuple) and v}
    from mgrit.reporting import writers as report
    meta = report.run_metadata()  # provenance, taken when the runs start
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    ours = {}
    with tempfile.TemporaryDirectory() as tmp:
        for commit in a.commits.split(","):
            for L in (int(v) for v in a.levels.split(",")):
                for P in (int(v) for v in a.ranks.split(",")):
                    if (commit, 1 if commit == "4e7af11" else P, L) not in refs:
                        continue
                    out = Path(tmp) / f"{commit}_{P}_{L}.json"
                    cmd = [mpiexec, "-n", str(P), sys.executable, "-m", "mpi4py", str(script)] + \
                        list(argv) + ["--worker", f"{commit},{P},{L}", "--json", str(out)]
                    t0 = time.perf_counter()
                    subprocess.run(cmd, check=True, timeout=a.timeout)
                    print(f"[{commit} P={P} ml{L}: {time.perf_counter() - t0:.1f} s]", flush=True)
                    ours[(commit, P, L)] = json.loads(out.read_text())
    lines, summary = [], {}
    ok = compare(ours, refs, out=lambda t: (print(t), lines.append(t)), summary=summary)
    mode = "" if not overrides else f" with {overrides}"
    verdict = f"verdict{mode}: " + ("every run equals the reference outputs within the tolerance"
                                    if ok else "some runs differ (see DIFFERS above)")
    print("\n" + verdict)
    if a.out:
        d = write_results(a.out, {"meta": report.finish_metadata(meta),
                                  "commit": meta.get("commit", "unknown"), "overrides": overrides,
                                  "runs": summary, "verdict": verdict},
                          "\n".join(lines + ["", verdict]))
        print(f"wrote {d}/authors.json, authors.md, headline.json")
    return 0 if ok else 1
