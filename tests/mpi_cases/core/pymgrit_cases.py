"""Rank-side checks against PyMGRIT 1.0.6 (run by tests/solver/test_pymgrit_crosscheck.py via
tests/mpi_harness.run_mpi on 1..4 ranks).

Each check runs our solver on ``MPI.COMM_WORLD`` and compares, on every rank, with references
computed in the pytest process (serial PyMGRIT, passed in as JSON lists) and with sequential
stepping of the same propagator (computed on every rank).
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from mgrit.grid import Hierarchy, Partition
from mgrit.options import MGRITOptions
from mgrit.problems import Dahlquist, Heat1D
from mgrit.solver import MGRIT
from tests.pymgrit_ref import CASES, compare_histories, drop_exact_zeros


def make_problem(case: str):
    """Our propagator, ``N`` and the options equivalent to PyMGRIT's settings of ``case``."""
    c = CASES[case]
    n = c["nt"] - 1
    if c["problem"] == "dahlquist":
        prop = Dahlquist(lam=-1.0, t_start=c["t_start"], t_stop=c["t_stop"], n_intervals=n,
                         method="BE")
    else:
        prop = Heat1D(nx=c["nx"], t_start=c["t_start"], t_stop=c["t_stop"], n_intervals=n)
    opts = MGRITOptions(max_levels=len(c["cfactors"]) + 1, cfactor=list(c["cfactors"]),
                        min_coarse=1, relax="FCF", cycle=c["cycle"],
                        nested_iteration=c["nested"], tol=c["tol"], max_iter=50)
    return prop, n, opts


def sequential(prop, n: int) -> torch.Tensor:
    """States ``0..N`` by stepping one interval after the other, shape ``(N+1, *state)``."""
    u = [prop.initial_value()]
    for i in range(n):
        u.append(prop.step(u[-1], i, i + 1, 0))
    return torch.stack(u)


def check_history(case: str, reference: list, golden: list, rtol: float = 1e-8,
                  state_rtol: float | None = None):
    """Residual history equals PyMGRIT's (``reference`` from this run of PyMGRIT, ``golden``
    from the notes) to ``rtol`` elementwise; the converged states equal sequential stepping
    to ``state_rtol`` relative in the max-norm (default ``10 * tol`` of the case; states are
    O(1))."""
    comm = MPI.COMM_WORLD
    prop, n, opts = make_problem(case)
    state_rtol = 10 * CASES[case]["tol"] if state_rtol is None else state_rtol
    solver = MGRIT(prop, n_intervals=n, state_shape=prop.state_shape, dtype=torch.float64,
                   options=opts, comm=comm)
    res = solver.solve(prop.initial_value() if comm.Get_rank() == 0 else None)
    hist = drop_exact_zeros(res.residuals)
    errs = [f"vs PyMGRIT run: {e}" for e in compare_histories(hist, reference, rtol)]
    errs += [f"vs golden: {e}" for e in compare_histories(hist, golden, max(rtol, 1e-10))]
    if not res.converged:
        errs.append(f"not converged after {res.iterations} cycles")
    if len(res.residuals) != res.iterations:
        errs.append(f"{len(res.residuals)} residuals for {res.iterations} iterations")
    seq = sequential(prop, n)[res.lo:res.hi]
    scale = seq.abs().max()
    err = float((res.states - seq).abs().max() / scale)
    if not err <= state_rtol:
        errs.append(f"states differ from sequential stepping by {err:.3e} rel > {state_rtol}")
    full = solver.gather(res, root=0)
    if comm.Get_rank() == 0:
        if full is None or full.shape != (n + 1, *prop.state_shape):
            errs.append(f"gather returned {None if full is None else tuple(full.shape)}")
        elif not torch.equal(full[res.lo:res.hi], res.states):
            errs.append("gathered rank-0 rows differ from res.states")
    elif full is not None:
        errs.append("gather returned a tensor on a non-root rank")
    assert not errs, f"rank {comm.Get_rank()}/{comm.Get_size()} {case}: " + "; ".join(errs) \
        + f"\n ours: {[float(r) for r in res.residuals]}\n ref:  {reference}"
    return [float(r) for r in res.residuals]


def check_no_coarse_points(cfactors: list, max_levels: int):
    """With the nocoarse case's hierarchy on >= 3 ranks some rank owns no point of some coarse
    level (the property case (c) exercises; with N = 128 each rank still owns a point of level
    1, stride 16, but not of levels 3/4); returns this rank's point count per level."""
    comm = MPI.COMM_WORLD
    c = CASES["dahlquist_nocoarse"]
    part = Partition.even(c["nt"] - 1, comm.Get_size())
    h = Hierarchy(part, comm.Get_rank(), cfactors, max_levels, min_coarse=1)
    assert [lv.n_intervals for lv in h.levels] == [128, 8, 4, 2, 1], h
    counts = comm.allgather([lv.n_local for lv in h.levels])
    if comm.Get_size() >= 3:
        assert any(0 in cnt[1:] for cnt in counts), f"every rank owns coarse points: {counts}"
    return counts[comm.Get_rank()]


def check_one_level(case: str):
    """One level: a single sweep equals sequential stepping bitwise on every rank."""
    comm = MPI.COMM_WORLD
    prop, n, _ = make_problem(case)
    opts = MGRITOptions(max_levels=1, tol=0.0, max_iter=1)
    solver = MGRIT(prop, n_intervals=n, state_shape=prop.state_shape, options=opts, comm=comm)
    res = solver.solve(prop.initial_value() if comm.Get_rank() == 0 else None)
    seq = sequential(prop, n)[res.lo:res.hi]
    assert res.states.dtype == torch.float64
    diff = float((res.states - seq).abs().max())
    assert torch.equal(res.states, seq), \
        f"rank {comm.Get_rank()}: one-level solve differs from sequential stepping by {diff:.3e}"
    return diff


def check_all(references: dict, golden: dict):
    """Every check above on this communicator; failures of all sub-checks are collected (one
    MPI job per rank count keeps the test suite fast)."""
    failures, out = [], {}
    subchecks = [(f"history[{c}]", check_history, (c, references[c], golden[c])) for c in CASES]
    subchecks += [(f"one_level[{c}]", check_one_level, (c,)) for c in CASES]
    subchecks += [("no_coarse_points", check_no_coarse_points, ([16, 2, 2, 2], 5))]
    for name, fn, args in subchecks:
        try:
            out[name] = fn(*args)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)
    return out
