"""Cost model (mgrit.perf): operation counts of the MGRIT replay equal SolverStats of real solves
(1 rank in process; 3 and 4 oversubscribed ranks via the MPI harness), timing formulae, planner,
input validation, and the calibration logic (mgrit.perf.calibrate_step, mgrit.perf.calibration)
on injected clocks: synthetic timings with known costs, or a clock that counts torch calls.
Nothing here measures time, so no result depends on how busy the machine is."""
import math

import pytest
import torch
from mpi4py import MPI
from torch.overrides import TorchFunctionMode

from mgrit import perf
from mgrit.nn import DenseStep, LayerParallelResNet, serial_resnet
from mgrit.options import MGRITOptions
from mgrit.perf import calibration as cal
from mgrit.solver import MGRIT
from tests.chains import BatchedTanhChain
from tests.mpi_harness import MPIBatch

CASES = [  # (N, levels, cfactor, relax, cycle, iterations, batched, nested, skip)
    (64, 2, 8, "F", "V", 2, True, False, False),
    (64, 2, 16, "FCF", "V", 2, True, False, False),
    (61, 3, 4, "F", "V", 3, False, False, True),
    (100, 3, [4, 2], ["F", "FCF"], "F", 2, True, False, False),
    (37, 4, 2, "FCFCF", "V", 1, True, True, False),
    (50, 1, 2, "F", "V", 1, True, False, False),
]
KEYS = ("steps_single", "steps_batched_calls", "steps_batched_items", "messages", "bytes_sent",
        "allreduces")


def _opts(levels, cfactor, relax, cycle, iters, batched, nested, skip):
    return MGRITOptions(max_levels=levels, cfactor=cfactor, relax=relax, cycle=cycle, tol=0,
                        max_iter=iters, batched=batched, nested_iteration=nested,
                        skip_first_relaxation=skip)


def check_counts(cases=None):
    """On every rank of COMM_WORLD: real solve counters == replayed counters of this rank."""
    comm = MPI.COMM_WORLD
    for case in (cases or CASES):
        N, *rest = case
        opts = _opts(*rest)
        prop = BatchedTanhChain(N, width=3)
        u0 = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        res = MGRIT(prop, N, (2, 3), options=opts, comm=comm).solve(u0)
        sim = perf.simulate(N, comm.Get_size(), opts, nbytes=2 * 3 * 8)  # a (2, 3) float64 state
        got = {k: getattr(res.stats, k) for k in KEYS}
        want = sim.rank(comm.Get_rank())
        assert got == want, f"rank {comm.Get_rank()} case {case}: solver {got} != model {want}"
    return "ok"


BATCH = MPIBatch(timeout=120)
BATCH.add(4, "counts", "tests.perf.test_perf:check_counts")  # one job: torch start-up dominates


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_counts_one_rank(case):
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("run without mpiexec")
    check_counts([case])


@pytest.mark.slow
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


class TickClock:
    """A clock that moves only when the code under test says so: synthetic timings."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class OpClock(TorchFunctionMode):
    """A deterministic clock: the number of torch calls (functions, methods, attributes going
    through ``__torch_function__``) made while the mode is active. A stand-in for time that
    counts work, so calibrated costs are exact counts, the same on a busy and an idle CPU."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))

    def __call__(self) -> float:
        return float(self.n)

    def count(self, fn) -> float:
        with self:
            t0 = self()
            fn()
            return self() - t0


def test_fit_step_cost():
    c = perf.fit_step_cost(1.0, [2, 4, 8], [3.0, 5.0, 9.0])
    assert c.single == 1.0 and c.call == pytest.approx(1.0) and c.item == pytest.approx(1.0)
    c = perf.fit_step_cost(0.5, [2, 4], [1.0, 0.5])  # decreasing: item clipped at 0
    assert c.item == 0.0 and c.call == pytest.approx(0.75)


def test_calibrate_step_recovers_affine_cost_despite_stalls():
    """Synthetic timings single = 3, batched call = 40 + 2.5 B ticks; one repeat out of three
    of each measurement stalls by 1e6 ticks (a busy CPU): the medians ignore it and the fit
    recovers the costs (1e-12 relative)."""
    clk = TickClock()
    calls = {}

    def work(key, dt):
        calls[key] = calls.get(key, 0) + 1
        clk.advance(dt + (1e6 if calls[key] == 6 else 0.0))  # call 6: in the 2nd repeat

    c = perf.calibrate_step(lambda: work("single", 3.0), lambda B: work(B, 40.0 + 2.5 * B),
                            sizes=(2, 8, 32, 64), repeats=3, inner=4, clock=clk)
    assert (c.single, c.call, c.item) == pytest.approx((3.0, 40.0, 2.5), rel=1e-12)
    assert all(n == 1 + 3 * 4 for n in calls.values()), calls  # warm-up + repeats * inner
    frozen = perf.calibrate_step(lambda: None, lambda B: None, sizes=(2, 4), repeats=2, inner=2,
                                 clock=lambda: 1.0)  # a clock that never moves: zeros, no error
    assert frozen == perf.StepCost(0.0, 0.0, 0.0)


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


def test_solver_overhead_recovers_bookkeeping_cost():
    """solver_overhead on timings synthesized from each solve's own counters (2 per single
    step, 7 per batched call, 0.5 per batched interval) recovers exactly those costs."""
    def timed(fn):
        st = fn().stats
        return 2.0 * st.steps_single + 7.0 * st.steps_batched_calls + 0.5 * st.steps_batched_items
    opts = MGRITOptions(max_levels=2, cfactor=8, tol=0, max_iter=2)
    o = cal.solver_overhead(128, (16, 4), opts, timed, repeats=3)
    assert (o.single, o.call, o.item) == pytest.approx((2.0, 7.0, 0.5), rel=1e-12)
    # the fit with a per-solve term: 40 more per solve is recovered as such
    o, fixed = cal.solver_overhead_fit(128, (16, 4), opts, lambda fn: 40.0 + timed(fn), repeats=3)
    assert (o.single, o.call, o.item, fixed) == pytest.approx((2.0, 7.0, 0.5, 40.0), rel=1e-9)


def test_layerparallel_calibration_helpers():
    """calibrate() on a tiny network with a clock that counts torch calls: each calibrated
    cost equals the count of the call it stands for, measured directly (one forward /
    adjoint step, one serial layer); the solver's bookkeeping (``solver_options``) is added
    field-wise as solver_overhead_fit() gives it, with its per-solve term; the reductions and the JSON round trip keep the
    values."""
    torch.manual_seed(0)
    N, m = 128, 8
    make = lambda k: DenseStep(4, "tanh")  # noqa: E731
    opts = MGRITOptions(max_levels=2, cfactor=m, tol=0, max_iter=2)
    lp = LayerParallelResNet.build(make, N, (4,), forward=opts, backward=opts)
    x = torch.randn(16, 4)
    lp(x).square().mean().backward()
    net = serial_resnet(make, N)
    clk = OpClock()

    def calibrate(**kw):
        with clk:
            return cal.calibrate(net, lp, x, m, 1e-6, lambda y: y.square().mean(), clk,
                                 repeats=2, inner=2, **kw)
    c = calibrate()
    u = torch.randn(16, 4)
    with torch.no_grad():
        step = clk.count(lambda: lp._chain.step(u, 5, 6, 0))
        layer = (clk.count(lambda: net[:6](x)) - clk.count(lambda: net[:2](x))) / 4
    assert step > 0 and layer > 0
    assert c.fwd.single == step and c.serial_fwd == layer, (c, step, layer)
    vals = [c.fwd.single, c.fwd.call, c.fwd.item, c.adj.single, c.adj.call, c.adj.item,
            c.serial_fwd, c.serial_bwd, c.pgrad_item, c.per_layer, c.refresh]
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in vals), vals
    assert c.adj.single > 0 and c.pgrad_item > 0 and c.fwd.call > 0
    assert (c.per_layer, c.nbytes) == (1e-6, 16 * 4 * 4)
    # per layer, what a forward adds: the version snapshot of the layers' tensors and the
    # stacked-parameter snapshot (recorded by autograd)
    checked = [*lp.steps.parameters(), *lp.steps.buffers()]
    snap = clk.count(lambda: ([t._version for t in checked], lp.chain.refresh(grad=True)))
    assert c.refresh == pytest.approx(snap / N)

    with_overhead = calibrate(solver_options=opts)
    o, fixed = cal.solver_overhead_fit(N, (16, 4), opts, clk.count, 2, x.dtype)
    assert o.single > 0 and with_overhead.solve_fixed == pytest.approx(fixed, rel=1e-12)
    for name in ("fwd", "adj"):
        got, base = getattr(with_overhead, name), getattr(c, name)
        assert (got.single, got.call, got.item) == pytest.approx(
            (base.single + o.single, base.call + o.call, base.item + o.item), rel=1e-12), name

    lo = perf.TrainCosts(fwd=perf.StepCost(1, 2, 3), adj=perf.StepCost(4, 5, 6), serial_fwd=7,
                         serial_bwd=8, pgrad_item=9, per_layer=10, nbytes=11, refresh=12)
    hi = perf.TrainCosts(fwd=perf.StepCost(2, 3, 4), adj=perf.StepCost(5, 6, 7), serial_fwd=8,
                         serial_bwd=9, pgrad_item=10, per_layer=11, nbytes=11, refresh=13)
    assert cal.median_costs([lo, hi], max) == hi
    assert cal.median_costs([lo, hi, hi]) == hi
    assert cal.costs_from_json(cal.costs_to_json(lo)) == lo


def test_path_residual_reproduces_the_real_path_at_its_depths():
    """path_residual() with a clock that counts torch calls: the residual of the real path
    (its forward and backward counted here independently at the calibration depths n/4 and n/2
    of the rank's layers, minus the pieces' model) gives the documented slope and intercept;
    where neither was clamped the model with the residual reproduces the counts exactly. The
    depth n itself is never run by the calibration."""
    torch.manual_seed(0)
    N, m = 64, 4
    fo = MGRITOptions(max_levels=2, cfactor=m, tol=0, max_iter=2)
    bo = MGRITOptions(max_levels=2, cfactor=m, tol=0, max_iter=1)
    lp = LayerParallelResNet.build(lambda k: DenseStep(4, "tanh"), N, (4,), forward=fo,
                                   backward=bo)
    x = torch.randn(16, 4)
    lp(x).square().mean().backward()
    clk = OpClock()
    with clk:
        base = cal.chain_costs(lp, x, m, clk, repeats=2, inner=2)  # without the residual
        c = cal.path_residual(lp, x, base, bo, clk, repeats=2)
    assert (base.path_fwd, base.fixed_fwd, base.path_bwd, base.fixed_bwd) == (0, 0, 0, 0)
    free, g = perf.CommCost(0.0, 1e30), torch.randn(16, 4)
    count, pieces, full = {}, {}, {}
    for d in (N // 4, N // 2):
        net = LayerParallelResNet(list(lp.steps)[:d], d, (4,), T=d * lp.h, forward=fo,
                                  backward=bo, warm_start=False)
        net(x).backward(g)
        box = []
        count[d] = (clk.count(lambda: box.append(net(x))), clk.count(lambda: box[0].backward(g)))
        pieces[d] = perf.resnet_times(d, 1, base, fo, bo, 2, 1, free)
        full[d] = perf.resnet_times(d, 1, c, fo, bo, 2, 1, free)
    a, b = N // 4, N // 2
    for i, (path, fixed, per_layer) in enumerate((("path_fwd", "fixed_fwd", base.refresh),
                                                  ("path_bwd", "fixed_bwd", base.pgrad_item))):
        r = {d: count[d][i] - pieces[d][i] for d in (a, b)}
        raw = (r[b] - r[a]) / (b - a)
        slope = max(raw, -per_layer)
        icpt = r[b] - slope * b
        assert getattr(c, path) == pytest.approx(slope) and \
            getattr(c, fixed) == pytest.approx(max(icpt, 0.0)), (path, r, getattr(c, path))
        if slope == raw and icpt >= 0:
            assert [full[d][i] for d in (a, b)] == pytest.approx([count[d][i] for d in (a, b)])
    # the residual adds to the pieces' prediction; at depth N it extrapolates
    f0, b0 = perf.resnet_times(N, 1, base, fo, bo, 2, 1, free)
    f1, b1 = perf.resnet_times(N, 1, c, fo, bo, 2, 1, free)
    assert f1 == pytest.approx(max(f0 + N * c.path_fwd + c.fixed_fwd, 0.0))
    assert b1 == pytest.approx(max(b0 + N * c.path_bwd + c.fixed_bwd, 0.0))
    assert cal.costs_from_json(cal.costs_to_json(c)) == c
