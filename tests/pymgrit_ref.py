"""Reference residual histories from PyMGRIT 1.0.6 (serial run in this process) and golden copies.

PyMGRIT's histories do not depend on the number of time ranks (notes: identical across 1..7
ranks), so a serial run is the reference for every rank count. PyMGRIT 1.0.6 (the ``dev``
extra) calls ``np.in1d``, which NumPy 2.4 removed; :func:`_pymgrit` aliases it to ``np.isin``
(same result for these 1-D inputs) before importing PyMGRIT, so the check runs on any NumPy
the install picks. Users run it as ``python -m pytest -q tests/solver/test_pymgrit_crosscheck.py``
(README, "Using the solver").

PyMGRIT returns ``conv[conv != 0]``: exact zeros are dropped from its history. Use
:func:`drop_exact_zeros` on our history before comparing with :func:`compare_histories`.

Cases (all match ``tests/solver/test_pymgrit_crosscheck.py`` and ``experiments/benchmarks/bench_pymgrit.py``):

* ``"dahlquist"``: u' = -u, u(0) = 1, t in [0, 5], nt = 101, backward Euler; 2 levels, m = 2,
  FCF, V-cycle, nested iteration, tol 1e-10.
* ``"heat"``: PyMGRIT's Heat1D, nx = 1001, a = 1, f = -sin(pi x)(sin t - pi^2 cos t),
  u(x, 0) = sin(pi x); t in [0, 2], nt = 65; 5 levels, m = 2, F-cycle, FCF, no nested
  iteration, tol 1e-7.
* ``"dahlquist_nocoarse"``: Dahlquist nt = 129 on [0, 5], levels t[::16], then [::2] three
  times (129/9/5/3/2 points); FCF, V-cycle, nested iteration, tol 1e-10.
"""
from __future__ import annotations

import importlib.metadata
import logging
import math
import time
from typing import Sequence

import numpy as np

__all__ = ["GOLDEN", "CASES", "PYMGRIT_VERSION", "pymgrit_history", "run_pymgrit", "drop_exact_zeros",
           "compare_histories"]

#: Residual histories measured with PyMGRIT 1.0.6 (/work/shared/notes/mgrit.md).
GOLDEN = {
    "dahlquist": [7.186185937025429e-05, 1.246106707585954e-06, 2.1015566149418615e-08,
                  3.1441273895579124e-10, 3.975216519949153e-12],
    "heat": [1.674374580351949, 0.08233110058226714, 0.004141227358231137,
             2.0796732945572877e-04, 1.0239713477386e-05, 4.84125106626e-07, 2.1337164720e-08],
    "dahlquist_nocoarse": [7.693147105384459e-03, 5.069883607615411e-04, 1.2469121704416458e-05,
                           1.7860071305544555e-17],
}

#: Settings of each case: problem, grid and PyMGRIT solver options (our MGRITOptions equivalent
#: is built by the tests from the same fields).
CASES = {
    "dahlquist": dict(problem="dahlquist", t_start=0.0, t_stop=5.0, nt=101, cfactors=[2],
                      cycle="V", nested=True, tol=1e-10),
    "heat": dict(problem="heat", t_start=0.0, t_stop=2.0, nt=65, nx=1001, cfactors=[2, 2, 2, 2],
                 cycle="F", nested=False, tol=1e-7),
    "dahlquist_nocoarse": dict(problem="dahlquist", t_start=0.0, t_stop=5.0, nt=129,
                               cfactors=[16, 2, 2, 2], cycle="V", nested=True, tol=1e-10),
}


PYMGRIT_VERSION = "1.0.6"


def _pymgrit():
    """Import PyMGRIT 1.0.6 after restoring ``np.in1d`` (removed in NumPy 2.4; PyMGRIT 1.0.6
    calls it on 1-D arrays of time points, where ``np.isin`` gives the same result).

    Raises:
        ImportError: PyMGRIT is not installed, or not version 1.0.6 (the golden histories and
            the cycle structure we reproduce are those of 1.0.6), naming the install command.
    """
    try:
        installed = importlib.metadata.version("pymgrit")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"the PyMGRIT cross-check needs PyMGRIT {PYMGRIT_VERSION}, which is "
                          f"not installed: pip install -e '.[dev]' (or pip install "
                          f"pymgrit=={PYMGRIT_VERSION})") from None
    if installed != PYMGRIT_VERSION:
        raise ImportError(f"PyMGRIT {installed} is installed; the cross-check needs "
                          f"{PYMGRIT_VERSION}: pip install pymgrit=={PYMGRIT_VERSION}")
    if not hasattr(np, "in1d"):
        np.in1d = np.isin
    import pymgrit  # noqa: F401  (optional heavy dependency of the tests only)
    from pymgrit.core.mgrit import Mgrit
    from pymgrit.dahlquist.dahlquist import Dahlquist
    from pymgrit.heat.heat_1d import Heat1D
    return Mgrit, Dahlquist, Heat1D


def heat_rhs(x, t):
    """Right-hand side of the heat case, f(x, t) = -sin(pi x)(sin t - pi^2 cos t)."""
    return -np.sin(np.pi * x) * (np.sin(t) - np.pi ** 2 * np.cos(t))


def heat_init(x):
    """Initial value of the heat case, u(x, 0) = sin(pi x)."""
    return np.sin(np.pi * x)


def build_pymgrit_levels(problem: str, t_start: float, t_stop: float, nt: int,
                         cfactors: Sequence[int], nx: int = 1001, lam: float = -1.0,
                         method: str = "BE"):
    """PyMGRIT application objects, one per level: level l+1 uses ``t_l[::cfactors[l]]``."""
    _, Dahlquist, Heat1D = _pymgrit()
    t = np.linspace(t_start, t_stop, nt)
    levels = []
    for l in range(len(cfactors) + 1):
        if problem == "dahlquist":
            app = Dahlquist(constant_lambda=lam, method=method, t_interval=t)
        elif problem == "heat":
            app = Heat1D(x_start=0.0, x_end=1.0, nx=nx, a=1.0, init_cond=heat_init, rhs=heat_rhs,
                         t_interval=t)
        else:
            raise ValueError(f"unknown problem {problem!r}: use 'dahlquist' or 'heat'")
        levels.append(app)
        if l < len(cfactors):
            t = t[::cfactors[l]]
    return levels


def run_pymgrit(problem: str, t_start: float, t_stop: float, nt: int, cfactors: Sequence[int],
                cycle: str = "V", nested: bool = True, tol: float = 1e-10, max_iter: int = 50,
                nx: int = 1001, lam: float = -1.0, method: str = "BE", comm=None) -> dict:
    """Run PyMGRIT 1.0.6 (FCF relaxation, weight 1, zero initial guess) and return its result.

    Returns:
        ``{"conv": list[float] (exact zeros dropped, as PyMGRIT does), "iterations": int,
        "time_setup": float, "time_solve": float, "time_total": float, "solver": Mgrit}``
        (times in seconds; ``time_total`` includes setup = nested iteration).
    """
    Mgrit, _, _ = _pymgrit()
    from mpi4py import MPI
    levels = build_pymgrit_levels(problem, t_start, t_stop, nt, cfactors, nx=nx, lam=lam,
                                  method=method)
    t0 = time.perf_counter()
    solver = Mgrit(problem=levels, cf_iter=1, cycle_type=cycle, nested_iteration=nested, tol=tol,
                   max_iter=max_iter, logging_lvl=logging.WARNING,
                   comm_time=MPI.COMM_WORLD if comm is None else comm)
    info = solver.solve()
    total = time.perf_counter() - t0
    conv = [float(c) for c in info["conv"]]
    return {"conv": conv, "iterations": solver.solve_iter, "time_setup": info["time_setup"],
            "time_solve": info["time_solve"], "time_total": total, "solver": solver}


def pymgrit_history(case: str) -> list[float]:
    """Residual history of PyMGRIT 1.0.6 for one of :data:`CASES` (serial run)."""
    c = dict(CASES[case])
    return run_pymgrit(**c)["conv"]


def drop_exact_zeros(history: Sequence[float]) -> list[float]:
    """The history without entries that are exactly 0.0 (PyMGRIT's ``conv[conv != 0]``)."""
    return [float(r) for r in history if r != 0.0]


def compare_histories(got: Sequence[float], ref: Sequence[float], rtol: float = 1e-8,
                      floor: float = 0.0) -> list[str]:
    """Elementwise relative comparison ``|a - b| <= rtol * |b|`` and equal lengths.

    Entries where both values are below ``floor`` (round-off level, e.g. an exact coarse solve
    whose residual is pure rounding noise) are compared only for being below ``floor``.

    Returns:
        A list of human-readable mismatches (empty when the histories agree).
    """
    errs = []
    if len(got) != len(ref):
        errs.append(f"length {len(got)} != reference length {len(ref)}")
    for i, (a, b) in enumerate(zip(got, ref)):
        if not (math.isfinite(a) and math.isfinite(b)):
            errs.append(f"cycle {i + 1}: non-finite {a} vs {b}")
        elif abs(a) < floor and abs(b) < floor:
            continue
        elif abs(a - b) > rtol * abs(b):
            errs.append(f"cycle {i + 1}: {a!r} vs reference {b!r} (rel {abs(a - b) / abs(b):.2e} "
                        f"> {rtol:.0e})")
    return errs
