"""Solver checks run on k ranks by tests/solver/test_solver_mpi.py (each rank asserts on its own part)."""
import math
import re

import torch
from mpi4py import MPI

from mgrit.comm import Exchanger
from mgrit.options import MGRITOptions
from mgrit.problems import Dahlquist
from mgrit.solver import MGRIT
from mgrit.stats import SolverStats
from tests.chains import BatchedTanhChain, TanhChain, sequential

COMM = MPI.COMM_WORLD


def _u0(batch=2, width=3, seed=1):
    return torch.randn(batch, width, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _solver(prop, n, opts, shape=(2, 3)):
    return MGRIT(prop, n, shape, options=opts, comm=COMM)


def check_one_level_bitwise(n, batched):
    prop = (BatchedTanhChain if batched else TanhChain)(n, width=3, T=2.0)
    u0 = _u0()
    res = _solver(prop, n, MGRITOptions(max_levels=1)).solve(u0)
    ref = sequential(prop, u0, n)
    assert torch.equal(res.states, ref[res.lo:res.hi]), \
        f"rank {COMM.rank}: one-level states differ from sequential stepping"
    assert res.residuals == [0.0] and res.iterations == 1
    assert res.stats.step_applications == res.hi - res.lo - (1 if res.hi == n + 1 else 0), \
        f"rank {COMM.rank}: {res.stats.step_applications} steps for points [{res.lo},{res.hi})"


def check_fixed_point(n, levels, cfactor, relax, cycle):
    prop = BatchedTanhChain(n, width=3, T=2.0)
    u0 = _u0()
    ref = sequential(prop, u0, n)
    solver = _solver(prop, n, MGRITOptions(max_levels=levels, cfactor=cfactor, relax=relax,
                                           cycle=cycle, tol=0.0, max_iter=2))
    res = solver.solve(u0, initial_guess=ref[solver.hierarchy.levels[0].lo:solver.hierarchy.levels[0].hi].clone())
    assert max(res.residuals) < 1e-14, f"residuals {res.residuals} from the exact solution"
    err = (res.states - ref[res.lo:res.hi]).abs().max().item()
    assert err < 1e-14, f"rank {COMM.rank}: fixed point moved by {err}"


def check_exactness(n, m, relax, iters):
    """Two-level F-relaxation: k cycles make the first k coarse intervals exact; FCF: 2k."""
    prop = BatchedTanhChain(n, width=3, T=4.0)
    u0 = _u0()
    ref = sequential(prop, u0, n)
    res = _solver(prop, n, MGRITOptions(max_levels=2, cfactor=m, relax=relax, tol=0.0,
                                        max_iter=iters)).solve(u0)
    exact_upto = (2 * iters if relax == "FCF" else iters) * m  # last exact C-point (fine index)
    for i in range(res.lo, res.hi):
        e = ((res.states[i - res.lo] - ref[i]).norm() / ref[i].norm()).item()
        if i < exact_upto + m:  # the exact C-point's F-interval is exact too
            assert e < 1e-13, f"point {i} should be exact after {iters} {relax} cycles: rel err {e}"
        elif i == exact_upto + m:
            assert e > 1e-8, f"point {i} is unexpectedly exact (err {e}): the test would not discriminate"


def check_converges_to_sequential(n, levels, cfactor, relax, cycle, nested, skip, c_weight):
    u0 = _u0()
    out = []
    for batched in (True, False):
        prop = BatchedTanhChain(n, width=3, T=2.0)
        opts = MGRITOptions(max_levels=levels, cfactor=cfactor, relax=relax, cycle=cycle,
                            nested_iteration=nested, skip_first_relaxation=skip,
                            c_weight=c_weight, tol=1e-13, max_iter=60, batched=batched)
        res = _solver(prop, n, opts).solve(u0)
        assert res.converged, f"not converged: {res.residuals}"
        ref = sequential(prop, u0, n)[res.lo:res.hi]
        err = ((res.states - ref).norm() / ref.norm()).item()
        assert err < 1e-11, f"rank {COMM.rank}: rel err {err} vs sequential"
        out.append(res)
    a, b = out
    assert len(a.residuals) == len(b.residuals), (a.residuals, b.residuals)
    for x, y in zip(a.residuals, b.residuals):
        assert abs(x - y) <= 1e-9 * abs(y) + 1e-15, f"batched {a.residuals} vs single {b.residuals}"
    assert a.stats.steps_batched_calls > 0 or COMM.size > 1
    assert b.stats.steps_batched_calls == 0
    return len(a.residuals)


def check_exchange_exact(dtype):
    """Round trip of values that float32 cannot represent, between every pair of neighbours."""
    dt = getattr(torch, dtype)
    x = (1.0 + torch.arange(12, dtype=torch.float64).reshape(3, 4) * 2.0 ** -40
         + COMM.rank).to(dt)
    ex = Exchanger(COMM, (3, 4), dt, "cpu", SolverStats())
    right, left = (COMM.rank + 1) % COMM.size, (COMM.rank - 1) % COMM.size
    req = ex.irecv(left, 7)
    ex.isend(x, right, 7)
    got = req.wait()
    ex.waitall()
    want = (1.0 + torch.arange(12, dtype=torch.float64).reshape(3, 4) * 2.0 ** -40 + left).to(dt)
    assert got.dtype == dt and got.shape == (3, 4)
    assert torch.equal(got, want), f"rank {COMM.rank}: received {got} != {want}"
    if dt == torch.float64:
        assert not torch.equal(got.float().double(), got), "test values must not fit in float32"


def check_float64_across_ranks():
    """A converged multi-rank solve of a float64 chain whose states are not float32-exact."""
    n = 4 * COMM.size + 1
    prop = BatchedTanhChain(n, width=3, T=1e-6)  # tiny steps: differences below float32 ulp
    u0 = _u0() + 1.0
    res = _solver(prop, n, MGRITOptions(max_levels=1)).solve(u0)
    ref = sequential(prop, u0, n)
    assert torch.equal(res.states, ref[res.lo:res.hi])
    assert not torch.equal(ref.float().double(), ref)


def check_bad_input(case):
    """Each bad input must raise ValueError on every rank with a message naming the value."""
    n = 8
    prop = BatchedTanhChain(max(n, 1), width=3)
    u0 = _u0()
    cases = {
        "n_lt_p": (lambda: _solver(prop, COMM.size - 1, MGRITOptions()), "N=.* cannot be split"),
        "cfactor_lt_2": (lambda: MGRITOptions(cfactor=1), "cfactor=1"),
        "levels_lt_1": (lambda: MGRITOptions(max_levels=0), "max_levels=0"),
        "negative_tol": (lambda: MGRITOptions(tol=-1e-3), "tol=-0.001"),
        "wrong_shape": (lambda: _solver(prop, n, MGRITOptions()).solve(_u0(batch=5)),
                        r"u0 has shape \(5, 3\)"),
        "wrong_dtype": (lambda: _solver(prop, n, MGRITOptions()).solve(u0.float()),
                        "dtype torch.float32"),
        "nan_u0": (lambda: _solver(prop, n, MGRITOptions()).solve(
            torch.where(torch.arange(3) == 1, torch.nan, u0)), "NaN"),
        "bad_guess": (lambda: _solver(prop, n, MGRITOptions()).solve(u0, torch.zeros(1, 1, dtype=torch.float64)),
                      "initial_guess"),
        "bad_relax": (lambda: MGRITOptions(relax="FC"), "relaxation 'FC'"),
        "bad_cycle": (lambda: MGRITOptions(cycle="W"), "cycle='W'"),
        "propagator_length": (lambda: MGRIT(Dahlquist(n_intervals=100), 50, (), comm=COMM),
                              "defined on 100 intervals but n_intervals=50"),
        "shape_per_rank": (lambda: _solver(prop, n, MGRITOptions()).solve(
            _u0(batch=2 + (COMM.rank == 1)), state_shape=(2 + (COMM.rank == 1), 3)),
            r"ranks disagree on the state shape"),
    }
    make, pattern = cases[case]
    try:
        make()
    except ValueError as exc:
        assert re.search(pattern, str(exc)), f"rank {COMM.rank}: message {exc!s} lacks {pattern!r}"
        return str(exc)
    raise AssertionError(f"rank {COMM.rank}: no ValueError for {case}")


# -- stopping criteria under warm start (issue 13 item 4) -------------------------------------
def _tol_problem(problem):
    """(propagator, N, state shape, u0, sequential reference states (N + 1, *shape))."""
    if problem == "dahlquist":  # u' = -u on [0, 5], backward Euler, u(0) = 1
        n = 64
        prop = Dahlquist(n_intervals=n)
        u0, shape = prop.initial_value(), ()
    else:  # nonlinear, layer-dependent tanh chain
        n = 48
        prop = BatchedTanhChain(n, width=3, T=2.0)
        u0, shape = _u0(), (2, 3)
    return prop, n, shape, u0, sequential(prop, u0, n)


def _own(solver, full):
    lv = solver.hierarchy.levels[0]
    return full[lv.lo:lv.hi].clone()


def check_warm_repeat(problem, norm, rtol, tol):
    """The same problem solved three times, each warm-started from the previous states: the
    first (cold) solve converges in K < max_iter cycles; the second and third need 0 cycles,
    report converged, an empty history and, as initial residual, the cold solve's last one
    (bitwise: the F-relaxed guess is the cold solve's final state). States stay bitwise those
    of the cold solve and match sequential stepping (relative max-norm error <= 1e-4)."""
    prop, n, shape, u0, ref = _tol_problem(problem)
    opts = MGRITOptions(max_levels=2, cfactor=4, rtol=rtol, tol=tol, norm=norm, max_iter=30)
    solver = _solver(prop, n, opts, shape)
    cold = solver.solve(u0)
    assert cold.converged and 2 <= cold.iterations < 30, (cold.iterations, cold.residuals)
    assert cold.initial_residual is None and len(cold.residuals) == cold.iterations
    assert cold.state_norm > 0 and cold.final_residual == cold.residuals[-1]
    r = cold.residuals[-1]
    assert (tol > 0 and r < tol) or (rtol > 0 and r <= rtol * cold.state_norm), (r, cold.state_norm)
    err = float((cold.states - ref[cold.lo:cold.hi]).abs().max() / ref.abs().max())
    assert err <= 1e-4, f"rank {COMM.rank}: converged states off by {err:.2e}"
    guess, counts = cold.states.clone(), [cold.iterations]
    for _ in range(2):
        warm = solver.solve(u0, initial_guess=guess)
        counts.append(warm.iterations)
        assert warm.converged and warm.iterations == 0 and warm.residuals == [], \
            (warm.iterations, warm.residuals, warm.initial_residual)
        assert warm.initial_residual == r and warm.final_residual == r, (warm.initial_residual, r)
        assert torch.equal(warm.states, cold.states), f"rank {COMM.rank}: warm states moved"
        guess = warm.states.clone()
    return counts


def check_warm_continues_cold(problem, norm, rtol, tol, j):
    """A warm start from the states after ``j`` cold cycles continues the cold iteration: its
    initial residual is the cold ``r_j`` and its history the cold ``r_{j+1} .. r_K``, so it
    needs ``K - j`` cycles (never more than the cold solve)."""
    prop, n, shape, u0, _ = _tol_problem(problem)
    kw = dict(max_levels=2, cfactor=4, norm=norm, max_iter=40)
    solver = _solver(prop, n, MGRITOptions(rtol=rtol, tol=tol, **kw), shape)
    cold = solver.solve(u0)
    K = cold.iterations
    assert cold.converged and K > j, (K, cold.residuals)
    part = _solver(prop, n, MGRITOptions(tol=0.0, **dict(kw, max_iter=j)), shape).solve(u0)
    assert part.residuals == cold.residuals[:j] and not part.converged
    warm = solver.solve(u0, initial_guess=part.states.clone())
    assert warm.converged and warm.iterations == K - j, (warm.iterations, K, j)
    assert warm.initial_residual == cold.residuals[j - 1], (warm.initial_residual, cold.residuals)
    for a, b in zip(warm.residuals, cold.residuals[j:]):
        assert abs(a - b) <= 1e-12 * b, (warm.residuals, cold.residuals)
    diff = float((warm.states - cold.states).abs().max())
    assert diff <= 1e-12, f"rank {COMM.rank}: warm-continued states differ by {diff:.2e}"
    return K, warm.iterations


def check_zero_residual_guess(problem, norm):
    """rtol with guesses whose residual is 0 or round-off: (a) the zero solution (u0 = 0, a
    chain with Phi(0) = 0): a cold start (old rule: target rtol * 0, never met) converges
    after one cycle with residual 0, a warm start from zeros needs 0 cycles; (b) the guess =
    sequential stepping: 0 cycles for rtol alone and for tol alone; (c) fixed-iteration
    (tol = rtol = 0): no convergence test, max_iter cycles, converged False."""
    prop, n, shape, u0, ref = _tol_problem(problem)
    opts = MGRITOptions(max_levels=2, cfactor=4, rtol=1e-6, tol=0.0, norm=norm, max_iter=30)
    solver = _solver(prop, n, opts, shape)
    zero = torch.zeros_like(u0)
    if problem == "dahlquist":  # Phi(0) = 0: the solution from u0 = 0 is 0
        res = solver.solve(zero)
        assert res.converged and res.iterations == 1 and res.residuals == [0.0], res.residuals
        res = solver.solve(zero, initial_guess=torch.zeros_like(_own(solver, ref)))
        assert res.converged and res.iterations == 0 and res.initial_residual == 0.0
        assert res.state_norm == 0.0
    for o in (opts, MGRITOptions(max_levels=2, cfactor=4, tol=1e-12, norm=norm, max_iter=30)):
        res = _solver(prop, n, o, shape).solve(u0, initial_guess=_own(solver, ref))
        assert res.converged and res.iterations == 0, (o, res.initial_residual, res.residuals)
        r, s = res.initial_residual, res.state_norm
        assert r <= 1e-14 * s, (r, s)
    fixed = MGRITOptions(max_levels=2, cfactor=4, tol=0.0, rtol=0.0, norm=norm, max_iter=3)
    res = _solver(prop, n, fixed, shape).solve(u0, initial_guess=_own(solver, ref))
    assert not res.converged and res.iterations == 3 and res.initial_residual is None
    return "ok"


def check_unreachable_rtol(problem):
    """rtol below round-off (1e-20) is not met: max_iter cycles, converged False. (5 cycles:
    FCF would make all 16 coarse intervals exact after 8, with a residual of exactly 0, which
    meets any rtol.)"""
    prop, n, shape, u0, _ = _tol_problem(problem)
    res = _solver(prop, n, MGRITOptions(max_levels=2, cfactor=4, rtol=1e-20, tol=0.0,
                                        max_iter=5), shape).solve(u0)
    assert not res.converged and res.iterations == 5 and len(res.residuals) == 5, res.residuals
    assert res.residuals[-1] > 1e-20 * res.state_norm
    return res.residuals[-1]


def check_nan_guess():
    """A NaN in one rank's initial guess: FloatingPointError naming the initial guess on every
    rank (the residual is allreduced), before any cycle."""
    prop, n, shape, u0, ref = _tol_problem("tanh")
    solver = _solver(prop, n, MGRITOptions(max_levels=2, cfactor=4, tol=1e-10), shape)
    guess = _own(solver, ref)
    if COMM.rank == COMM.size - 1:
        guess[-1, 0, 0] = math.nan
    try:
        solver.solve(u0, initial_guess=guess)
    except FloatingPointError as exc:
        assert "initial guess" in str(exc), str(exc)
        return str(exc)
    raise AssertionError(f"rank {COMM.rank}: no FloatingPointError for a NaN guess")
