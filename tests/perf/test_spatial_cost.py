"""The cost model under spatial coarsening (issue 35 item 4): a coarsened level's step costs
(coarse points / fine points) of a fine step, in the replay, the step time and the plan."""
import math

import pytest

from mgrit.options import MGRITOptions
from mgrit.perf import CommCost, StepCost, TrainCosts, plan, simulate, spatial_level_cost, \
    training_times


def test_level_cost_of_grids():
    # vertex-centred 15 -> 7 -> 3 per side, cell-centred 28 -> 14 -> 7
    assert spatial_level_cost((15, 15, 15), (1,), 3) == (1.0, 7 ** 3 / 15 ** 3, 7 ** 3 / 15 ** 3)
    assert spatial_level_cost((15, 15, 15), (1, 2), 3) == (1.0, 7 ** 3 / 15 ** 3, 27 / 15 ** 3)
    assert spatial_level_cost((28, 28), (2,), 3) == (1.0, 1.0, 0.25)
    assert spatial_level_cost((28, 28), (1, 2), 3) == (1.0, 0.25, 49 / 784)
    assert spatial_level_cost((1, 3), (1, 2), 3) == (1.0, 1 / 3, 1 / 3)  # sides stop at 1
    for bad in (dict(shape=(), levels=(1,)), dict(shape=(15,), levels=(0,)),
                dict(shape=(15,), levels=(3,)), dict(shape=(15,), levels=(1,), factor=1)):
        with pytest.raises(ValueError, match="spatial_level_cost"):
            spatial_level_cost(n_levels=3, **bad)


def test_replay_scales_the_coarse_steps():
    """N = 4, m = 2, two levels, one F-cycle on one rank, unbatched unit steps, free
    messages: the fine level makes 8 steps (F-relaxation, restriction, correction,
    residual), the coarse level 4 (its residual at the 2 C-points, the 2-interval solve), so
    the critical path is 8 + 4 c with coarse cost c; the step counts do not change."""
    o = MGRITOptions(max_levels=2, cfactor=2, tol=0, max_iter=1, relax=["F"])
    free = CommCost(0.0, 1e30)
    for c in (1.0, 0.5, 0.125):
        s = simulate(4, 1, o, 1, False, StepCost(1.0, 0.0, 1.0), free, 0, level_cost=(1.0, c))
        assert s.critical_path == pytest.approx(8 + 4 * c, abs=1e-12)
        assert s.steps_single == [12]
    base = simulate(64, 4, MGRITOptions(max_levels=3, cfactor=4, tol=0, max_iter=2),
                    tau=StepCost(1e-3, 1e-4, 5e-4), nbytes=4096)
    same = simulate(64, 4, MGRITOptions(max_levels=3, cfactor=4, tol=0, max_iter=2),
                    tau=StepCost(1e-3, 1e-4, 5e-4), nbytes=4096, level_cost=(1.0, 1.0))
    assert same.time == base.time
    with pytest.raises(ValueError, match="level_cost"):
        simulate(8, 1, o, level_cost=(1.0, 0.0))


def test_step_time_and_plan_know_the_coarse_cost():
    costs = TrainCosts(fwd=StepCost(1e-3, 2e-4, 8e-4), adj=StepCost(2e-3, 4e-4, 1.6e-3),
                       serial_fwd=1e-3, serial_bwd=2e-3, nbytes=50 * 4 * 15 ** 3 * 4)
    o = MGRITOptions(max_levels=3, cfactor=4, tol=0, max_iter=2)
    ob = MGRITOptions(max_levels=3, cfactor=4, tol=0, max_iter=1)
    lc = spatial_level_cost((15, 15, 15), (1, 2), 3)
    t0 = training_times(64, 4, costs, o, ob, 2, 1)
    t1 = training_times(64, 4, costs, o, ob, 2, 1, level_cost=lc)
    assert t1["mgrit"]["train"] < t0["mgrit"]["train"]
    assert t1["serial"] == t0["serial"]
    p0 = plan(64, 4, costs, cfactors=(2, 4, 8))
    p1 = plan(64, 4, costs, cfactors=(2, 4, 8), spatial=((15, 15, 15), "all"))
    assert p1.times["mgrit"]["train"] < p0.times["mgrit"]["train"]
    assert math.isfinite(p1.speedup_vs_serial)


def test_level_cost_matches_the_solvers_level_shapes():
    """The cost model's grids are the solver's (mgrit.spatial's grid="auto" level shapes)."""
    sp = pytest.importorskip("mgrit.spatial")
    for shape, levels in (((4, 15, 15, 15), (1,)), ((4, 15, 15, 15), (1, 2)),
                          ((2, 28, 28), (1, 2)), ((2, 28, 28), (2,)), ((3, 31), (1, 2))):
        shapes = sp.SpatialCoarsening(levels=levels).level_shapes(shape, 3)
        want = tuple(math.prod(s[1:]) / math.prod(shape[1:]) for s in shapes)
        assert spatial_level_cost(shape[1:], levels, 3) == pytest.approx(want, rel=1e-15)
