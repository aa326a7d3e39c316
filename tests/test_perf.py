"""Cost model (mgrit.perf): operation counts of the MGRIT replay equal SolverStats of real solves
(1 rank in process; 3 and 4 oversubscribed ranks via the MPI harness), timing formulae, planner,
input validation. No timing assertions."""
import math

import pytest
import torch

from mgrit import perf
from mgrit.options import MGRITOptions
from tests.mpi_harness import MPIBatch

CASES = [  # (N, levels, cfactor, relax, cycle, iterations, batched, nested, skip)
    (64, 2, 8, "F", "V", 2, True, False, False),
    (64, 2, 16, "FCF", "V", 2, True, False, False),
    (61, 3, 4, "F", "V", 3, False, False, True),
    (100, 3, [4, 2], ["F", "FCF"], "F", 2, True, False, False),
    (37, 4, 2, "FCFCF", "V", 1, True, True, False),
    (50, 1, 2, "F", "V", 1, True, False, False),
]
KEYS = ("steps_single", "steps_batched_calls", "steps_batched_items", "messages", "allreduces")


def _opts(levels, cfactor, relax, cycle, iters, batched, nested, skip):
    return MGRITOptions(max_levels=levels, cfactor=cfactor, relax=relax, cycle=cycle, tol=0,
                        max_iter=iters, batched=batched, nested_iteration=nested,
                        skip_first_relaxation=skip)


def check_counts(cases=None):
    """On every rank of COMM_WORLD: real solve counters == replayed counters of this rank."""
    from mpi4py import MPI

    from mgrit.solver import MGRIT
    from tests.chains import BatchedTanhChain
    comm = MPI.COMM_WORLD
    for case in (cases or CASES):
        N, *rest = case
        opts = _opts(*rest)
        prop = BatchedTanhChain(N, width=3)
        u0 = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        res = MGRIT(prop, N, (2, 3), options=opts, comm=comm).solve(u0)
        sim = perf.simulate(N, comm.Get_size(), opts)
        got = {k: getattr(res.stats, k) for k in KEYS}
        want = sim.rank(comm.Get_rank())
        assert got == want, f"rank {comm.Get_rank()} case {case}: solver {got} != model {want}"
    return "ok"


BATCH = MPIBatch(timeout=120)
BATCH.add(4, "counts", "tests.test_perf:check_counts")  # one job: torch start-up dominates


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_counts_one_rank(case):
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("run without mpiexec")
    check_counts([case])


def test_counts_oversubscribed():
    BATCH.run(4, "counts")


def test_critical_path_formulae():
    tau = perf.StepCost(single=1.0, call=0.0, item=1.0)
    one = MGRITOptions(max_levels=1)
    comm = perf.CommCost(latency=0.5, bandwidth=1e30)
    # one level = sequential sweep pipelined over ranks: N steps plus P - 1 messages
    for P in (1, 2, 4):
        t = perf.simulate(16, P, one, 1, tau=tau, comm=comm).critical_path
        assert t == pytest.approx(16 + (P - 1) * 0.5 + 0.5 * math.ceil(math.log2(P)))  # + agreement allreduce
    # two levels, F relaxation, 1 rank, batched with zero call cost: work = step applications
    o = MGRITOptions(max_levels=2, cfactor=4, relax="F", tol=0, max_iter=2)
    s = perf.simulate(64, 1, o, tau=tau)
    assert s.critical_path == s.steps_single[0] + s.steps_batched_items[0]
    # batching with a per-call cost: fewer calls than items
    assert s.steps_batched_calls[0] < s.steps_batched_items[0]
    assert perf.layerwise_time(100, 4, 1.0, 2.0) == 106.0
    assert perf.pipelined_time(100, 4, 1, 1.0, 0.0) == 4 * 25


def test_fit_and_calibrate():
    c = perf.fit_step_cost(1.0, [2, 4, 8], [3.0, 5.0, 9.0])
    assert c.call == pytest.approx(1.0) and c.item == pytest.approx(1.0)
    c = perf.calibrate_step(lambda: None, lambda B: None, sizes=(2, 4), repeats=2, inner=2)
    assert c.single >= 0 and c.call >= 0 and c.item >= 0


def _costs():
    return perf.TrainCosts(fwd=perf.StepCost(60e-6, 300e-6, 6e-6),
                           adj=perf.StepCost(150e-6, 800e-6, 15e-6),
                           serial_fwd=70e-6, serial_bwd=150e-6, nbytes=2048)


def test_planner_valid():
    p = perf.plan(1024, 16, _costs())
    assert p.cfactor in (4, 8, 16, 32, 64, 128) and 2 <= p.levels <= 4
    assert 1024 // p.cfactor ** (p.levels - 1) >= 2
    assert p.speedup_vs_layerwise > 1
    table = perf.scaling_table(256, _costs(), ranks=(1, 2, 512), cfactors=(8, 16), max_levels=3)
    assert [q.P for q in table] == [1, 2]


@pytest.mark.parametrize("call", [
    lambda: perf.plan(10, 20, _costs()),
    lambda: perf.plan(0, 1, _costs()),
    lambda: perf.plan(64, 2, _costs(), K_f=0),
    lambda: perf.plan(3, 1, _costs(), cfactors=(4,)),
    lambda: perf.simulate(8, 16, MGRITOptions()),
    lambda: perf.simulate(8, 1, MGRITOptions(), iterations=0),
    lambda: perf.simulate(8, 1, "FCF"),
    lambda: perf.StepCost(-1.0, 0.0, 0.0),
    lambda: perf.CommCost(latency=1e-6, bandwidth=0),
    lambda: perf.fit_step_cost(1.0, [2, 2], [1.0, 1.0]),
])
def test_bad_inputs(call):
    with pytest.raises(ValueError):
        call()


def test_layerparallel_calibration_helpers():
    """experiments/layerparallel_calibration.py on a tiny network: every calibrated cost is
    finite and >= 0, the solver-overhead fit uses a free propagator (so it is far below a
    real step), the reductions and the JSON round trip keep the values."""
    import sys
    import time
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
    from mgrit.perf import calibration as cal

    from mgrit.nn import DenseStep, LayerParallelResNet, serial_resnet

    torch.manual_seed(0)
    N, m = 128, 8
    make = lambda k: DenseStep(4, "tanh")  # noqa: E731
    opts = MGRITOptions(max_levels=2, cfactor=m, tol=0, max_iter=2)
    lp = LayerParallelResNet.build(make, N, (4,), forward=opts, backward=opts)
    x = torch.randn(16, 4)
    lp(x).square().mean().backward()
    net = serial_resnet(make, N)
    c = cal.calibrate(net, lp, x, m, 1e-6, 1e-7, lambda y: y.square().mean(),
                      time.perf_counter, repeats=2, inner=2, solver_options=opts)
    vals = [c.fwd.single, c.fwd.call, c.fwd.item, c.adj.single, c.adj.call, c.adj.item,
            c.serial_fwd, c.serial_bwd, c.pgrad_item, c.per_layer, c.refresh]
    assert all(v >= 0 and v < 1.0 for v in vals), vals
    assert c.fwd.single > 0 and c.serial_fwd > 0 and c.nbytes == 16 * 4 * 4
    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    o = cal.solver_overhead(N, (16, 4), opts, timed)
    assert 0 <= o.single < 1e-3 and o.call >= 0 and o.item >= 0
    lo = perf.TrainCosts(fwd=perf.StepCost(1, 2, 3), adj=perf.StepCost(4, 5, 6), serial_fwd=7,
                         serial_bwd=8, pgrad_item=9, per_layer=10, nbytes=11, refresh=12)
    hi = perf.TrainCosts(fwd=perf.StepCost(2, 3, 4), adj=perf.StepCost(5, 6, 7), serial_fwd=8,
                         serial_bwd=9, pgrad_item=10, per_layer=11, nbytes=11, refresh=13)
    assert cal.median_costs([lo, hi], max) == hi
    assert cal.median_costs([lo, hi, hi]) == hi
    assert cal.costs_from_json(cal.costs_to_json(lo)) == lo
