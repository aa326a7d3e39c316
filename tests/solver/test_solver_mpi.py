"""MGRIT solver acceptance on 1-4 ranks against sequential stepping (float64).

Tolerances: bitwise for one level; 1e-14 absolute for the fixed point; 1e-13 relative for
points that two-level exactness says are exact; 1e-11 relative for converged solves
(tolerance 1e-13 on the residual). Stopping criteria under warm start (tol / rtol, both
norms, Dahlquist and a nonlinear chain, 1 and 2 ranks): cycle counts and histories against
the cold solve of the same problem (bitwise where the iteration is the same), states against
sequential stepping. All checks for one rank count run in one MPI job.
"""
import pytest

from tests.mpi_harness import MPIBatch

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

C = "tests.mpi_cases.core.solver_cases"
BATCH = MPIBatch()
for k in (1, 2, 3, 4):
    for batched in (True, False):
        BATCH.add(k, f"one_level_bitwise-batched={batched}", f"{C}:check_one_level_bitwise",
                  n=13, batched=batched)
    for levels, cfactor, relax, cycle in [(2, 4, "FCF", "V"), (3, 2, "F", "V"), (4, [4, 2], "FCF", "F")]:
        BATCH.add(k, f"fixed_point-L{levels}-m{cfactor}-{relax}-{cycle}", f"{C}:check_fixed_point",
                  n=37, levels=levels, cfactor=cfactor, relax=relax, cycle=cycle)
    for relax, iters in [("F", 1), ("F", 3), ("FCF", 1), ("FCF", 2)]:
        BATCH.add(k, f"exactness-{relax}-{iters}", f"{C}:check_exactness", n=50, m=4, relax=relax,
                  iters=iters)
    for i, (levels, cfactor, relax, cycle, nested, skip, w) in enumerate([
            (2, 4, "FCF", "V", False, False, 1.0),
            (3, [4, 2], ["F", "FCF"], "V", False, True, 1.0),
            (4, 2, "FCF", "F", True, False, 1.3),
            (3, 3, "FCFCF", "V", True, False, 1.0)]):
        BATCH.add(k, f"converges-{i}", f"{C}:check_converges_to_sequential", n=61, levels=levels,
                  cfactor=cfactor, relax=relax, cycle=cycle, nested=nested, skip=skip, c_weight=w)
for k in (2, 3):
    for dtype in ("float64", "float32", "bfloat16"):
        BATCH.add(k, f"exchange-{dtype}", f"{C}:check_exchange_exact", dtype=dtype)
for k in (2, 4):
    BATCH.add(k, "float64_chain", f"{C}:check_float64_across_ranks")
# stopping criteria under warm start (issue 13 item 4): Dahlquist and the nonlinear tanh chain
for k in (1, 2):
    for problem in ("dahlquist", "tanh"):
        for norm in ("l2", "inf"):
            BATCH.add(k, f"warm_repeat-{problem}-{norm}-rtol", f"{C}:check_warm_repeat",
                      problem=problem, norm=norm, rtol=1e-6, tol=0.0)
            BATCH.add(k, f"zero_residual_guess-{problem}-{norm}", f"{C}:check_zero_residual_guess",
                      problem=problem, norm=norm)
        BATCH.add(k, f"warm_repeat-{problem}-l2-tol", f"{C}:check_warm_repeat", problem=problem,
                  norm="l2", rtol=0.0, tol=1e-9)
        for norm, rtol, tol, j in [("l2", 1e-10, 0.0, 2), ("inf", 0.0, 1e-11, 1)]:
            BATCH.add(k, f"warm_continues_cold-{problem}-{norm}", f"{C}:check_warm_continues_cold",
                      problem=problem, norm=norm, rtol=rtol, tol=tol, j=j)
        BATCH.add(k, f"unreachable_rtol-{problem}", f"{C}:check_unreachable_rtol", problem=problem)
    BATCH.add(k, "nan_guess", f"{C}:check_nan_guess")
for case in ["n_lt_p", "cfactor_lt_2", "levels_lt_1", "negative_tol", "wrong_shape",
             "wrong_dtype", "nan_u0", "bad_guess", "bad_relax", "bad_cycle", "propagator_length",
             "shape_per_rank"]:
    BATCH.add(3, f"bad_input-{case}", f"{C}:check_bad_input", case=case)


@pytest.mark.parametrize("k,name", BATCH.ids())
def test_solver(k, name):
    results = BATCH.run(k, name)
    if name.startswith(("converges", "bad_input", "warm", "nan_guess")):
        assert len(set(results)) == 1, f"ranks disagree: {results}"

