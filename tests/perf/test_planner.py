"""The cost model's strategies and the planner (mgrit.perf.strategies, mgrit.perf.planner) with
synthetic costs, and the model fixes of issue 14 checked without timing: the replay's counts of
warm-started tolerance solves equal SolverStats; the GPipe formula equals a brute-force
schedule; the planner picks what the synthetic costs make fastest; the convergence probe is
exact where FCF theory says so. Nothing here measures time."""
import math
import random
from dataclasses import replace

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mgrit import perf
from mgrit.nn import DenseStep, serial_resnet
from mgrit.nn.steps import ResidualStep
from mgrit.options import MGRITOptions
from mgrit.perf import netcal, planner, strategies as st
from mgrit.perf.lean import LeanResNet
from mgrit.solver import MGRIT
from tests.chains import BatchedTanhChain
from tests.perf.test_perf import OpClock

KEYS = ("steps_single", "steps_batched_calls", "steps_batched_items", "messages", "allreduces")


@pytest.mark.parametrize("tol,rtol", [(1e-12, 0.0), (0.0, 1e-13), (0.0, 0.0)])
@pytest.mark.parametrize("case", [(64, 2, 8, "F", "V", False), (64, 3, 4, "FCF", "V", False),
                                  (61, 3, 4, "F", "F", True), (100, 3, [4, 2], ["F", "FCF"], "V", False)])
@pytest.mark.parametrize("warm", [True, False])
def test_replay_counts_of_tolerance_and_warm_solves(case, tol, rtol, warm):
    """The replay (initial_guess=True: F-relaxed guess + its residual, first cycle without its
    leading F-relaxation, only when a tolerance is set) counts what the solver does."""
    N, L, m, relax, cycle, skip = case
    o = MGRITOptions(max_levels=L, cfactor=m, relax=relax, cycle=cycle, tol=tol, rtol=rtol,
                     max_iter=3, skip_first_relaxation=skip)
    g = torch.Generator().manual_seed(0)
    u0 = torch.randn(2, 3, dtype=torch.float64, generator=g)
    guess = 0.1 * torch.randn(N + 1, 2, 3, dtype=torch.float64, generator=g) if warm else None
    res = MGRIT(BatchedTanhChain(N, width=3), N, (2, 3), options=o, comm=MPI.COMM_SELF).solve(
        u0, initial_guess=guess)
    assert res.iterations >= 1
    sim = perf.simulate(N, 1, o, res.iterations, initial_guess=warm)
    assert {k: getattr(res.stats, k) for k in KEYS} == {k: sim.rank(0)[k] for k in KEYS}


def test_curve():
    c = st.Curve((1, 4, 8), (1.0, 2.5, 2.5))
    assert c(1) == 1.0 and c(2) == pytest.approx(1.5) and c(6) == pytest.approx(2.5)
    assert c(16) == pytest.approx(2.5) and c(0.5) == pytest.approx(0.75)
    assert st.Curve.const(3.0)(100) == 3.0
    assert st.Curve((1, 2), (1.0, 0.0))(10) == 0.0  # clipped at 0
    for bad in [((2, 1), (1.0, 1.0)), ((1,), (-1.0,)), ((), ()), ((1, 2), (1.0,))]:
        with pytest.raises(ValueError, match="Curve"):
            st.Curve(*bad)


def _brute_pipeline(stage_times, M, beta):
    """Start times by the recurrence end(r, j) = max(end(r, j-1), end(r-1, j) + beta) + t_r."""
    P, end = len(stage_times), {}
    for j in range(M):
        for r in range(P):
            ready = max(end.get((r, j - 1), 0.0), end[(r - 1, j)] + beta if r else 0.0)
            end[(r, j)] = ready + stage_times[r]
    return end[(P - 1, M - 1)]


def test_flow_shop_equals_brute_force_schedule():
    rnd = random.Random(0)
    for _ in range(200):
        P, M = rnd.randint(1, 6), rnd.randint(1, 9)
        t = [rnd.uniform(0.1, 3.0) for _ in range(P)]
        beta = rnd.uniform(0.0, 1.0)
        assert st.flow_shop(t, M, beta) == pytest.approx(_brute_pipeline(t, M, beta))
    # equal stages: the model's pipelined_time
    assert perf.pipelined_time(100, 4, 6, 0.5, 2.0) == pytest.approx(st.flow_shop([12.5] * 4, 6, 2.0))


def _costs(layer, N=64, comm_bytes=0, mgrit=None, **kw):
    return st.NetCosts(N, layer_fwd=st.Curve((1, 64), (layer(1) / 3, layer(64) / 3)),
                       layer_fb=st.Curve((1, 64), (layer(1), layer(64))), layer_bytes=comm_bytes,
                       state_bytes=32, mgrit=mgrit, **kw)


FREE = perf.CommCost(0.0, 1e30)


def test_strategies_formulae():
    lin = _costs(lambda b: 1e-6 * b)  # cost proportional to the batch
    assert st.serial_step(lin, 64) == pytest.approx(64 * 64e-6)
    assert st.data_parallel_step(lin, 64, 2, FREE) == pytest.approx(64 * 32e-6)
    # GPipe M = 1 over P stages is the chain: serial + (P - 1) messages per direction
    comm = perf.CommCost(1e-3, 1e30)
    assert st.gpipe_step(lin, 64, 4, 1, comm) == pytest.approx(64 * 64e-6 + 2 * 3 * 1e-3)
    t, M = st.best_gpipe(lin, 64, 4, FREE)
    assert M == 64 and t == pytest.approx((64 + 3) * 16 * 1e-6)  # (M + P - 1) stage-times of 1 sample
    flat = _costs(lambda b: 1e-6)  # call-bound: micro-batches only add bubbles
    assert st.best_gpipe(flat, 64, 4, FREE)[1] == 1
    assert st.allreduce_time(8e6, 4, perf.CommCost(1e-6, 1e9)) == pytest.approx(4e-6 + 1.5 * 8e-3)
    with pytest.raises(ValueError, match="GPipe"):
        st.gpipe_step(lin, 4, 2, 8, FREE)
    assert st.grids(8, 4, 64) == [(1, 8), (2, 4), (4, 2)]


def _probe(cfg, fe, be):
    return planner.Probe(cfg, 0.1, list(fe), list(be))


def _mgrit_costs(item, per_sample=False):
    """MGRIT step costs: a batched interval costs ``item``, a call and a single step 1e-6 s
    (``per_sample``: all of them per sample of the batch, as the linear layers)."""
    def fn(b):
        k = b if per_sample else 1
        s = perf.StepCost(1e-6 * k, 1e-6 * k, item * k)
        return perf.TrainCosts(fwd=s, adj=s, serial_fwd=0.0, serial_bwd=0.0)
    return fn


def test_choose_picks_the_fastest_kind():
    cfg = planner.MGRITConfig(16, 2, "F")
    ok = _probe(cfg, [0.5, 0.01, 0.001], [0.5, 0.02, 0.001])
    # call-bound layers, cheap batched intervals: MGRIT wins at P = 8, K_f = K_b = 2 suffice
    c = _costs(lambda b: 1e-6, N=1024, mgrit=_mgrit_costs(1e-9))
    opts, probes = planner.choose(c, 64, 8, FREE, [ok], grad_tol=0.05)
    assert opts[0].kind == "MGRIT" and (probes[0].K_f, probes[0].K_b) == (2, 2)
    assert opts == sorted(opts, key=lambda o: o.time)
    kinds = {o.kind for o in opts}
    assert kinds == {"serial", "data parallel", "GPipe", "MGRIT"}
    # layers proportional to the batch, free messages: data parallelism is perfect -> it wins
    c = _costs(lambda b: 1e-6 * b, N=1024, mgrit=_mgrit_costs(1e-6 / 3, per_sample=True))
    opts, _ = planner.choose(c, 64, 8, FREE, [_probe(cfg, [0.5, 0.01], [0.5, 0.02])])
    assert opts[0].kind == "data parallel" and opts[0].P_D == 8
    # no configuration reaches the error target: no MGRIT option
    opts, probes = planner.choose(c, 64, 8, FREE, [_probe(cfg, [0.5, 0.4], [0.5, 0.4])])
    assert "MGRIT" not in {o.kind for o in opts} and probes[0].K_f is None
    # a tighter target needs more cycles
    p = _probe(cfg, [0.5, 0.01, 0.001], [0.5, 0.02, 0.001])
    planner.choose(c, 64, 8, FREE, [p], grad_tol=0.005)
    assert (p.K_f, p.K_b) == (3, 3)


def test_choose_offers_the_lean_loop():
    """Issue 34 item 6: with lean costs the options hold serial and data parallelism on the
    lean kernel beside the autograd ones (one row each); a lean loop cheaper per layer than
    autograd is the fastest serial option and wins where serial wins."""
    c = _costs(lambda b: 1e-5, N=64)
    lean = replace(c, layer_fwd=st.Curve((1, 64), (1e-6, 1e-6)),
                   layer_fb=st.Curve((1, 64), (3e-6, 3e-6)))
    opts, _ = planner.choose(c, 64, 2, FREE, (), lean=lean)
    rows = {(o.kind, o.P_L, o.P_D, o.settings.get("kernel")) for o in opts}
    assert {("serial", 1, 1, None), ("serial", 1, 1, "lean"), ("data parallel", 1, 2, None),
            ("data parallel", 1, 2, "lean")} <= rows and len(rows) == len(opts)
    lean_serial = next(o for o in opts if o.kind == "serial" and o.settings)
    assert lean_serial.time == pytest.approx(64 * 3e-6)
    best = planner.simplest(opts, 0.10)  # call-bound layers: DP gains nothing, serial lean wins
    assert best.kind == "serial" and best.settings == {"kernel": "lean"}
    assert "kernel lean" in best.label
    # without lean costs: no lean row
    assert all(not o.settings.get("kernel") for o in planner.choose(c, 64, 2, FREE)[0])


def test_lean_netcosts_only_for_dense_steps():
    """lean_netcosts keeps head / tail / fixed costs and swaps in the lean loop's per-layer
    costs (> 0, at the same batch sizes); a network with another step kind has none."""
    net = _tiny_network(N=8)
    c = _costs(lambda b: 1e-5, N=8, opt_other=1e-4)
    lc = planner.lean_netcosts(net, c, 2, 64, repeats=1)
    assert lc.n_layers == 8 and lc.opt_other == 1e-4 and lc.mgrit is None
    assert lc.layer_fb.sizes == c.layer_fb.sizes and all(t > 0 for t in lc.layer_fb.times)
    other = planner.Network.from_factory(
        lambda k: nn.Sequential(nn.Linear(3, 3), nn.Tanh()).double(), 8, (3,))
    assert planner.lean_netcosts(other, c, 2, 64, repeats=1) is None


def _tiny_network(N=8, w=3, act="tanh"):
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(5, w), nn.Tanh()).double()
    tail = nn.Linear(w, 2).double()
    return planner.Network.from_factory(lambda k: DenseStep(w, act).double(), N, (w,), T=2.0,
                                        head=head, tail=tail,
                                        loss_fn=lambda o, t: nn.functional.cross_entropy(o, t))


def test_probe_exact_where_fcf_is_exact():
    """N = 8, m = 2: 4 coarse intervals; after k FCF cycles the first 2k are exact, so two
    forward (and two adjoint) cycles give the exact gradient (round-off), one does not."""
    net = _tiny_network()
    x = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 0, 1, 1, 0])
    p = planner.probe(net, x, y, planner.MGRITConfig(2, 2, "FCF"), max_iters=2)
    assert p.fwd_err[1] < 1e-12 and p.bwd_err[1] < 1e-12, p
    assert p.fwd_err[0] > 1e-8 and p.bwd_err[0] > 1e-8, p


def test_recommend_end_to_end_with_given_costs():
    """recommend() with synthetic costs: probes real solves of the network (cheapest first),
    verifies the chosen (K_f, K_b) with a real combined solve, and recommends the fastest."""
    net = _tiny_network(N=16)
    x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.arange(8) % 2
    c = _costs(lambda b: 1e-6, N=16, mgrit=_mgrit_costs(1e-9))
    rec = planner.recommend(net, x, 4, y, comm=FREE, costs=c, grad_tol=1e-3,
                            configs=[planner.MGRITConfig(2, 2, "FCF"), planner.MGRITConfig(4, 2, "F")])
    assert rec.probes and all(p.err is None or p.err <= 1e-3 for p in rec.probes)
    assert rec.best.time == min(o.time for o in rec.options)
    text = rec.report()
    assert "Recommendation for P = 4" in text and "| GPipe | 4 x 1 |" in text and "serial" in text
    with pytest.raises(ValueError, match="P="):
        planner.recommend(net, x, 0, y, costs=c)


def test_network_from_sequential():
    """The main job's serial model (opening, residual steps, closing) splits as such."""
    body = serial_resnet(lambda k: DenseStep(4, "tanh"), 6)
    seq = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), *body, nn.Linear(4, 2))
    net = planner.Network.from_sequential(seq, (4,))
    assert net.n_layers == 6 and math.isclose(net.T, 1.0)
    x = torch.randn(5, 3)
    assert torch.allclose(net.serial()(x), seq(x))
    with pytest.raises(ValueError, match="ResidualStep"):
        planner.Network.from_sequential(nn.Sequential(nn.Linear(2, 2)), (2,))


def test_mgrit_configs():
    cs = planner.mgrit_configs(32, cfactors=(4, 8, 16), max_levels=3, relaxes=("F",))
    assert {(c.cfactor, c.levels) for c in cs} == {(4, 2), (4, 3), (8, 2), (16, 2)}
    assert all(32 // c.cfactor ** (c.levels - 1) >= 2 for c in cs)


def test_netcal_costs_are_the_counts_they_stand_for():
    """module_costs / lean_costs with a clock that counts torch calls: a residual layer's cost
    is the count of one layer (the slope drops fixed costs), the same at every batch size;
    the lean loop's per-layer cost is the count of its whole forward over N; the strategies
    built on them add up."""
    net = _tiny_network(N=16, w=3)
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.arange(8) % 2
    clk = OpClock()
    with clk:
        c = netcal.module_costs(net.head, net.steps, net.h, net.tail, net.loss_fn, x, y, (2, 8),
                                repeats=2, clock=clk, depth=16)
    z = torch.randn(8, 3, dtype=torch.float64)
    layer = ResidualStep(net.steps[0], net.h)
    with torch.no_grad():
        one = clk.count(lambda: layer(z))
        head = clk.count(lambda: net.head(x))
    assert c.layer_fwd(2) == c.layer_fwd(8) == one, (c.layer_fwd(2), one)
    assert c.head_fwd(8) == head and c.n_layers == 16
    # (the autograd engine's backward ops do not pass __torch_function__: fb >= forward)
    assert c.layer_fb(8) >= c.layer_fwd(8) > 0 and c.tail_fb(8) >= c.tail_fwd(8) > 0
    assert c.layer_bytes == (9 + 3) * 8 and c.state_bytes == 3 * 8
    assert st.serial_step(c, 8) == pytest.approx(c.head_fb(8) + 16 * c.layer_fb(8) + c.tail_fb(8)
                                                 + c.step_fixed + 16 * c.opt_layer + c.opt_other)
    lean = LeanResNet.from_sequential(serial_resnet(lambda k: DenseStep(4, "tanh"), 12).double())
    with clk:
        lc = netcal.lean_costs(lean, (1, 4), repeats=2, clock=clk)
    xl = torch.randn(4, 4, dtype=torch.float64)
    assert lc.layer_fwd(4) == clk.count(lambda: lean.forward(xl)) / 12
    rt = st.netcosts_from_json(st.netcosts_to_json(lc))
    assert rt == lc and st.reduce_netcosts([lc, rt], max) == lc


def test_simplest_option_within_the_margin():
    """The recommendation is the simplest kind predicted within the margin of the fastest:
    a more complex option must win by more than the margin (the model's error)."""
    O = planner.Option
    opts = [O("data parallel", 1, 2, 0.97), O("serial", 1, 1, 1.0), O("MGRIT", 2, 1, 0.5),
            O("GPipe", 2, 1, 0.95)]
    assert planner.simplest(opts, 0.0).kind == "MGRIT"      # 2x faster: it wins at any margin
    assert planner.simplest(opts, 0.10).kind == "MGRIT"
    near = [o for o in opts if o.kind != "MGRIT"]
    assert planner.simplest(near, 0.0).kind == "GPipe"      # the fastest prediction
    assert planner.simplest(near, 0.10).kind == "serial"    # 5% and 3% gains: within 10%
    assert planner.simplest(near, 0.04).kind == "data parallel"  # 3% is within 4%, 5% is not
    assert planner.simplest(near, 0.02).kind == "GPipe"


def test_recommend_reports_the_margin_choice():
    net = _tiny_network(N=16)
    x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.arange(8) % 2
    c = _costs(lambda b: 1e-6, N=16)  # call-bound, no MGRIT costs: DP / GPipe ~ serial
    rec = planner.recommend(net, x, 4, y, comm=FREE, costs=c, margin=1.0)
    assert rec.best.kind == "serial"
    if min(o.time for o in rec.options) < rec.best.time:
        assert "the simpler option is recommended" in rec.report()
    assert planner.recommend(net, x, 4, y, comm=FREE, costs=c, margin=0.0).best.time == \
        min(o.time for o in rec.options)
    with pytest.raises(ValueError, match="margin"):
        planner.recommend(net, x, 4, y, comm=FREE, costs=c, margin=-0.1)


def test_bad_inputs_of_simplest_and_resnet_times():
    with pytest.raises(ValueError, match="options is empty"):
        planner.simplest([], 0.1)
    o = MGRITOptions(max_levels=2, cfactor=4)
    with pytest.raises(ValueError, match="costs must be TrainCosts, got NoneType"):
        perf.resnet_times(16, 1, None, o, o, 1, 1)
    c = perf.TrainCosts(fwd=perf.StepCost(1, 1, 1), adj=perf.StepCost(1, 1, 1), serial_fwd=1,
                        serial_bwd=1)
    with pytest.raises(ValueError, match="bwd must be MGRITOptions"):
        perf.resnet_times(16, 1, c, o, None, 1, 1)
    with pytest.raises(ValueError, match="N=0"):
        perf.resnet_times(0, 1, c, o, o, 1, 1)


def test_unresolved_calibration_is_clamped_and_flagged_never_divided_by():
    """A calibration whose timings give zero (a clock that never moves) or negative (a
    monotonic clock on which more work takes less time, as when load drops during the
    calibration: deeper networks time faster) per-layer costs: the layer costs are
    clamped to a positive floor and noted as unreliable; recommend() warns, its report says so
    and divides by nothing <= 0 (the ZeroDivisionError of issue 25); NetCosts refuses a zero
    layer cost outright."""
    net = _tiny_network(N=8, w=3)
    x = torch.randn(4, 5, dtype=torch.float64)
    y = torch.arange(4) % 2
    ops, state = OpClock(), {"t": 0.0, "n": 0}

    def less_work_slower():
        state["t"] += 1e4 - (ops.n - state["n"])  # monotonic while an interval has < 1e4 calls
        state["n"] = ops.n
        return state["t"]
    for clock in (lambda: 1.0, less_work_slower):
        with ops:
            c = netcal.module_costs(net.head, net.steps, net.h, net.tail, net.loss_fn, x, y, (2, 4),
                                    repeats=1, clock=clock, depth=8)
        assert all(v > 0 for v in c.layer_fwd.times + c.layer_fb.times), c
        assert len(c.unreliable) == 4 and all("clamped" in n for n in c.unreliable)
        assert "per-layer forward cost at batch 2" in c.unreliable[0]
        assert ("fitted 0 <=" if clock() == 1.0 else "fitted -") in c.unreliable[0]
        assert st.netcosts_from_json(st.netcosts_to_json(c)) == c
        with pytest.warns(RuntimeWarning, match="calibration unreliable"):
            rec = planner.recommend(net, x, 2, y, comm=FREE, costs=c, configs=[])
        text = rec.report()
        assert "**Calibration unreliable**" in text and "A layer costs" in text
    with pytest.raises(ValueError, match=r"NetCosts.layer_fb times \(0.0,\): a residual layer costs > 0"):
        st.NetCosts(4, st.Curve.const(1e-6), st.Curve.const(0.0))
