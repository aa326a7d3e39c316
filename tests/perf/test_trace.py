"""Trace and replay of real runs (mgrit.perf.trace; issue 24, item 5).

* the replay of a hand-built 2-rank trace gives the critical path worked out by hand, and a
  trace that cannot have run (a receive without its send, collectives that differ) is refused;
* JSON round trip; a corrupted file is a ValueError;
* a traced run computes the same numbers as an untraced one (bitwise);
* the calibrated host work (``host``/``per_solve``) by hand; the cost model's training-step
  costs built from a calibration (:mod:`mgrit.perf.trace.calibrate`) by hand, and a small
  real calibration whose kept trace's tallies equal the solver's counters; the gradient error
  of an inexact setting is > 0 and of a setting iterated to exactness ~ 0 (float64);
* on 1 rank (in process) and on 2, 3 and 4 ranks (one MPI job each; issue 34 item 5: P = 1,
  2, 3): the trace's tallies equal the solver's own counters per rank and solve, sends and
  receives match one to one with equal bytes, and the cost model's predicted counts
  (:func:`mgrit.perf.model.simulate`: steps, batched calls and intervals, messages, bytes,
  collectives) equal the recorded ones exactly per rank, as do the replay's critical paths
  with and without per-message host costs (``tests/mpi_cases/core/trace_cases.py``). No
  timing assertions.
"""
import json
import math

import pytest
import torch
from mpi4py import MPI

from mgrit.options import MGRITOptions
from mgrit.perf.model import CommCost, StepCost
from mgrit.perf.trace import UNIT, Trace, replay, step_costs
from mgrit.perf.trace.resnet import trace_resnet
from tests.mpi_cases.core import trace_cases
from tests.mpi_harness import MPIBatch

BATCH = MPIBatch(timeout=600)
for _n in (2, 3, 4):
    for _c in ("solver_traces", "resnet_trace", "step_collectives"):
        BATCH.add(_n, _c, f"tests.mpi_cases.core.trace_cases:check_{_c}")


def _rank(r, solves):
    return {"rank": r, "size": 2, "solves": solves}


def _solve(events, t0=0.0, t1=10.0, label="s"):
    return {"label": label, "t0": t0, "t1": t1, "events": events}


def _two_ranks(extra0=(), extra1=()):
    """Rank 0: step, send 100 B to rank 1, batched step over 3, residual allreduce, step.
    Rank 1: step, receive it, step, residual allreduce."""
    r0 = [["step", 0.0, 1.0, 0, 0, 1, 0], ["send", 1.0, 1.0, 1, 1000, 100, 0],
          ["step", 1.0, 2.0, 0, 4, 3, 1], ["coll", 2.0, 3.0, "residual"],
          ["step", 3.0, 4.0, 0, 8, 1, 0], *extra0]
    r1 = [["step", 0.0, 1.0, 0, 8, 1, 0], ["recv", 1.0, 2.0, 0, 1000, 100, 0],
          ["step", 2.0, 3.0, 0, 9, 1, 0], ["coll", 3.0, 3.5, "residual"], *extra1]
    return Trace([_rank(0, [_solve(r0)]), _rank(1, [_solve(r1)])])


def test_replay_two_ranks_by_hand():
    tau, comm = StepCost(single=2.0, call=1.0, item=0.5), CommCost(latency=0.25, bandwidth=100.0)
    res = replay(_two_ranks(), tau, comm)
    # rank 0: step 2; send arrives 2 + 0.25 + 100/100 = 3.25; batched 1 + 3 * 0.5 -> 4.5
    # rank 1: step 2; receive max(2, 3.25) = 3.25; step -> 5.25
    # allreduce (P = 2: one stage of message(8) = 0.33): both at 5.58; rank 0 steps -> 7.58
    assert res.finish == pytest.approx([7.58, 5.58], abs=1e-12)
    assert res.critical_path == pytest.approx(7.58, abs=1e-12)
    assert res.counts[0] == {"steps_single": 2, "steps_batched_calls": 1,
                             "steps_batched_items": 3, "messages": 1, "bytes_sent": 100,
                             "allreduces": 1}
    assert res.wall == [10.0, 10.0]
    # per-level costs; a missing level is an error
    res2 = replay(_two_ranks(), {0: StepCost(1.0, 0.0, 1.0)})
    # rank 0: 1, batched 3 -> 4; rank 1: 1, receive at max(1, 1), 2; allreduce (free) at
    # max(4, 2) = 4 on both; rank 0 steps -> 5
    assert res2.finish == [5.0, 4.0]
    with pytest.raises(ValueError, match="levels \\[0\\]"):
        replay(_two_ranks(), {1: UNIT})
    with pytest.raises(ValueError, match="tau="):
        replay(_two_ranks(), 1.0)


def test_replay_message_host_and_collective_costs_by_hand():
    """Issue 34 item 5: the solver's library work per message end (``host``) and a measured
    small collective (``collective``) on the same hand-built trace."""
    tau = StepCost(single=2.0, call=1.0, item=0.5)
    comm = CommCost(latency=0.25, bandwidth=100.0, host=0.125, collective=0.5)
    res = replay(_two_ranks(), tau, comm)
    # rank 0: step 2; posting the send 0.125 -> 2.125, arrives 2.125 + 1.25 = 3.375; batched
    # 2.5 -> 4.625. rank 1: step 2; receive max(2, 3.375) + 0.125 = 3.5; step -> 5.5.
    # collective (one round of 0.5): both at 6.0; rank 0 steps -> 8.0
    assert res.finish == pytest.approx([8.0, 6.0], abs=1e-12)
    assert comm.reduction(1) == 0.0 and comm.reduction(4) == 1.0
    assert CommCost(0.25, 100.0, host=0.125).reduction(2) == pytest.approx(0.25 + 0.08 + 0.25)
    for bad in (dict(host=-1.0), dict(collective=-0.5), dict(host=math.inf)):
        with pytest.raises(ValueError, match="host and collective"):
            CommCost(0.25, 100.0, **bad)


def test_step_costs_of_two_depths_separate_call_and_interval():
    """A one-rank calibration fits its step costs to the runs at N and N / 2 (batched calls
    over 4 and over 2 intervals, as at P = 1 and P = 2): ``call`` and ``item`` come out
    exactly; from the N run alone the whole call is priced per interval (the issue-34 miss:
    a P = 2 batched call predicted at half the cost of a P = 1 one)."""
    from mgrit.perf.trace.calibrate import _both
    def one(n, dur):  # two single steps of 3 and two batched calls over n intervals
        ev = [["step", 0.0, 3.0, 0, 0, 1, 0], ["step", 3.0, 6.0, 0, 1, 1, 0],
              ["step", 6.0, 6.0 + dur, 0, 0, n, 1], ["step", 7.0, 7.0 + dur, 0, 0, n, 1]]
        return Trace([{"rank": 0, "size": 1, "solves": [_solve(ev, 0.0, 20.0)]}])
    full, half = one(4, 3.0), one(2, 2.5)  # call 2, item 0.25
    c = step_costs(_both(full, half))
    assert (c.single, c.call, c.item) == pytest.approx((3.0, 2.0, 0.25))
    alone = step_costs(full)
    assert (alone.call, alone.item) == (0.0, 0.75)  # 3 / 4: predicts 1.5 for 2 intervals, not 2.5


def test_replay_recorded_costs_and_overhead():
    # with the recorded durations and the host time between events, a one-rank trace
    # replays to its wall clock: 0.5 before, 1 step, 0.25 between, batched 2, 0.75 after
    t = Trace([{"rank": 0, "size": 1, "solves": [_solve(
        [["step", 0.5, 1.5, 0, 0, 1, 0], ["step", 1.75, 3.75, 1, 0, 4, 1]], 0.0, 4.5)]}])
    assert replay(t, "recorded", overhead=True).finish == [4.5] == [t.wall(0)]
    assert replay(t, "recorded").finish == [3.0]
    assert replay(t).finish == [5.0]  # unit costs: 1 + 4


def test_replay_calibrated_host_work_by_hand():
    # the host work (a StepCost in the form of tau) is added to every step and per_solve is
    # charged at each solve's start; messages and collectives keep their costs
    tau, comm = StepCost(single=2.0, call=1.0, item=0.5), CommCost(latency=0.25, bandwidth=100.0)
    host = StepCost(single=0.5, call=0.25, item=0.125)
    res = replay(_two_ranks(), tau, comm, host=host, per_solve=1.0)
    # rank 0: 1 (solve) + 2.5 (step) = 3.5; send arrives 3.5 + 1.25 = 4.75; batched
    #   (1 + 0.25) + 3 * (0.5 + 0.125) = 3.125 -> 6.625
    # rank 1: 1 + 2.5 = 3.5; receive max(3.5, 4.75) = 4.75; step 2.5 -> 7.25
    # allreduce at max(6.625, 7.25) + message(8) = 7.25 + 0.33 = 7.58; rank 0 steps -> 10.08
    assert res.finish == pytest.approx([10.08, 7.58], abs=1e-12)
    # per-level host work; a calibrated replay cannot also charge the recorded host time
    assert replay(_two_ranks(), tau, comm, host={0: host}, per_solve=1.0).finish == res.finish
    assert replay(_two_ranks(), tau, comm, host=StepCost(0.0, 0.0, 0.0)).finish == \
        replay(_two_ranks(), tau, comm).finish
    with pytest.raises(ValueError, match="levels \\[0\\]"):
        replay(_two_ranks(), tau, host={1: host})
    for bad in (-1.0, float("nan"), True):
        with pytest.raises(ValueError, match="per_solve="):
            replay(_two_ranks(), tau, per_solve=bad)
    with pytest.raises(ValueError, match="one of the two"):
        replay(_two_ranks(), "recorded", overhead=True, host=host)
    with pytest.raises(ValueError, match="host="):
        replay(_two_ranks(), tau, host="recorded")


def test_subset_keeps_whole_solves():
    t = Trace([_rank(r, [_solve(ev, label=lab) for lab in ("a", "b")])
               for r, ev in enumerate((_two_ranks().events(0), _two_ranks().events(1)))])
    sub = t.subset(1)
    assert [s["label"] for s in sub.solves(0)] == ["b"] and sub.nprocs == 2
    assert replay(sub).finish == replay(t, label="b").finish
    uneven = Trace([_rank(0, [_solve([])]), _rank(1, [])])
    with pytest.raises(ValueError, match="same number"):
        uneven.subset(1)


def test_trace_refuses_what_cannot_have_run():
    lost = _two_ranks(extra1=[["recv", 4.0, 5.0, 0, 1000, 100, 1]])  # never sent
    with pytest.raises(ValueError, match="waits forever"):
        replay(lost)
    with pytest.raises(ValueError, match="received but never sent"):
        lost.messages()
    unheard = _two_ranks(extra0=[["send", 4.0, 4.0, 1, 1000, 100, 1]])
    with pytest.raises(ValueError, match="never received"):
        replay(unheard)
    with pytest.raises(ValueError, match="never received"):
        unheard.messages()
    t = _two_ranks()
    t.ranks[1]["solves"][0]["events"][1][5] = 99
    with pytest.raises(ValueError, match="100 bytes sent, 99 received"):
        t.messages()
    t = _two_ranks()
    t.ranks[1]["solves"][0]["events"][3][3] = "agree"
    with pytest.raises(ValueError, match="collective 0 differs"):
        replay(t)


def test_json_round_trip_and_corruption(tmp_path):
    t = _two_ranks()
    t.meta["what"] = "hand-built"
    back = Trace.from_json(t.to_json(tmp_path / "t.json"))
    assert back.ranks == t.ranks and back.meta == t.meta
    assert replay(back).finish == replay(t).finish
    bad = json.loads((tmp_path / "t.json").read_text())
    bad["ranks"][0]["solves"][0]["events"][0] = ["step", 0.0, 1.0, 0, 0, -1, 0]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="must be a int >= 0"):
        Trace.from_json(tmp_path / "bad.json")
    bad["ranks"][0]["solves"][0]["events"][0] = ["jump", 0.0, 1.0]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="is not an event"):
        Trace.from_json(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a trace"):
        Trace.from_json(tmp_path / "junk.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(ValueError, match="not a layerpar trace"):
        Trace.from_json(tmp_path / "other.json")
    with pytest.raises(ValueError, match="rank record 1"):
        Trace([_rank(0, []), _rank(0, [])])


def test_tracing_changes_no_number():
    """The traced ResNet's output and gradients equal the untraced one's bitwise."""
    comm = MPI.COMM_SELF
    _, traced, _ = trace_resnet(comm, 16, 4, 4)
    _, plain, _ = trace_resnet(comm, 16, 4, 4, steps=0)  # the same model, not run
    plain.forward_solver.tracer = plain.backward_solver.tracer = None
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (plain(x).square().sum() / 4).backward()
    for (n, a), b in zip(traced.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), n
    assert torch.equal(traced.last_states, plain.last_states)


def _one_rank():
    if MPI.COMM_WORLD.Get_size() != 1:
        pytest.skip("run without mpiexec")


def test_counts_and_simulate_one_rank():
    _one_rank()
    out = trace_cases.check_solver_traces()
    assert out["messages"] == 0 and len(out["unit_critical_paths"]) == 7
    out = trace_cases.check_resnet_trace(n_layers=16)
    assert out["forward"] > 0 and out["adjoint"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("nprocs,check", [(n, c) for n in (2, 3, 4)
                                          for c in ("solver_traces", "resnet_trace",
                                                    "step_collectives")])
def test_trace_bookkeeping_mpi(nprocs, check):
    """Acceptance of issue 24 / issue 34 item 5: operation, message and byte counts at P = 2,
    3, 4 equal the solver's own counters and the model's predicted counts per rank; replay ==
    simulate."""
    res = BATCH.run(nprocs, check)
    if check == "step_collectives":  # per direction: the real count == the model's (checked there)
        assert len(set(res)) == 1 and res[0].startswith("["), res
        return
    assert "'messages': " in res[0] and "'messages': 0," not in res[0], res[0]


def test_step_costs_fitted_to_recorded_steps():
    ev = [["step", 0.0, 1.0, 0, 0, 1, 0], ["step", 1.0, 4.0, 0, 1, 1, 0],
          ["step", 4.0, 6.0, 1, 0, 1, 0],                       # singles 1, 3, 2: mean 2
          ["step", 6.0, 9.0, 0, 0, 2, 1], ["step", 9.0, 14.0, 0, 0, 4, 1]]  # 3 = c + 2i, 5 = c + 4i
    t = Trace([{"rank": 0, "size": 1, "solves": [_solve(ev, 0.0, 14.0)]}])
    c = step_costs(t)
    assert (c.single, c.call, c.item) == pytest.approx((2.0, 1.0, 1.0), abs=1e-12)
    one = Trace([{"rank": 0, "size": 1, "solves": [_solve(ev[:4], 0.0, 9.0)]}])
    assert step_costs(one).item == pytest.approx(1.5) and step_costs(one).call == 0.0
    with pytest.raises(ValueError, match="no single step"):
        step_costs(Trace([{"rank": 0, "size": 1, "solves": [_solve(ev[3:], 0.0, 14.0)]}]))


def test_one_level_resnet_has_nothing_to_trace():
    from mgrit.options import MGRITOptions
    one = MGRITOptions(max_levels=1)
    with pytest.raises(ValueError, match="one-level exact path"):
        trace_resnet(MPI.COMM_SELF, 8, 2, 2, forward=one, backward=one)


def _entry(scale=1.0):
    sc = lambda a, b, c: {"single": a * scale, "call": b * scale, "item": c * scale}  # noqa: E731
    return {"tau_f": sc(2.0, 1.0, 0.5), "tau_a": sc(3.0, 1.5, 0.75), "host_f": sc(0.5, 0.25, 0.125),
            "host_a": sc(0.25, 0.5, 0.0), "fixed_f": 4.0 * scale, "fixed_a": 5.0 * scale,
            "untraced_layer": 0.125 * scale, "untraced_step": 6.0 * scale, "untraced_share": 0.5}


def test_calibrated_train_costs_by_hand():
    # train_costs: step costs + host work, fixed per solve, the untraced part per layer and
    # per step; net_costs: linear in the batch between calibrated sizes, nearest outside
    from mgrit.perf.steptime import resnet_times
    from mgrit.perf.trace.calibrate import net_costs, train_costs
    tc = train_costs(_entry())
    assert (tc.fwd, tc.adj) == (StepCost(2.5, 1.25, 0.625), StepCost(3.25, 2.0, 0.75))
    assert (tc.pgrad_item, tc.fixed_fwd, tc.fixed_bwd) == (0.125, 4.0, 11.0)
    bare = train_costs(_entry(), host=False)
    assert (bare.fwd, bare.fixed_fwd, bare.fixed_bwd) == (StepCost(2.0, 1.0, 0.5), 0.0, 6.0)
    # the analytic step at P = 1: simulate's sweep plus the fixed and untraced parts
    f, b = resnet_times(8, 1, tc, MGRITOptions(max_levels=2, cfactor=4, max_iter=1, tol=0.0),
                        MGRITOptions(max_levels=2, cfactor=4, max_iter=1, tol=0.0), 1, 1)
    assert f > 4.0 and b > 11.0 + 8 * 0.125
    lean = {"n_layers": 8, "layer_fwd": [[1, 4], [1.0, 1.0]], "layer_fb": [[1, 4], [3.0, 3.0]],
            "opt_layer": 0.5, "layer_bytes": 160, "state_bytes": 32}
    nc = net_costs({"batches": {"2": _entry(), "6": _entry(3.0)}, "lean": lean})
    assert nc.mgrit(4).fwd == StepCost(5.0, 2.5, 1.25)  # halfway: 2x
    assert nc.mgrit(4).fixed_bwd == pytest.approx(22.0) and nc.mgrit(4).per_layer == 0.5
    assert nc.mgrit(1) == nc.mgrit(2) and nc.mgrit(64) == nc.mgrit(6)
    assert nc.layer_fb(2) == 3.0 and net_costs({"batches": {"2": _entry()}, "lean": lean},
                                               opt_layer=0.0).mgrit(9).per_layer == 0.0
    # strategy_times: the strategies' formulas on these costs; NaN where P cannot be used
    from mgrit.perf import strategies as st
    from mgrit.perf.trace.calibrate import strategy_times
    o = MGRITOptions(max_levels=2, cfactor=2, max_iter=1, tol=0.0)
    cal, comm = {"batches": {"2": _entry()}, "lean": lean}, CommCost(1.0, 1e3)
    t = strategy_times(cal, comm, 4, [16, 16, 4], [1, 8, 8], o, o, 1)
    c16 = net_costs(cal).__class__(**{**vars(net_costs(cal)), "n_layers": 16})
    assert t["serial"][:2] == [st.serial_step(c16, 4)] * 2 == [16 * 3.5] * 2
    assert t["GPipe"][1] == st.best_gpipe(c16, 4, 8, comm)[0]
    assert t["MGRIT"][1] == st.mgrit_step(c16, 4, 8, o, o, 1, 1, comm)["train"]
    assert math.isnan(t["data parallel"][1]) and math.isnan(t["MGRIT"][2])  # P > b; P > N
    assert t["MGRIT x DP"][1] == min(st.mgrit_step(c16, 4, pl, o, o, 1, 1, comm, pd)["train"]
                                     for pl, pd in ((2, 4), (4, 2)))


def test_calibrate_one_rank_runs():
    # the calibration's pieces exist and are consistent (no timing assertion): the one-rank
    # trace it keeps is the real code's run (counts = the solver's), shares in [0, 1]
    from mgrit.perf.trace.calibrate import calibrate, gradient_error
    fwd = MGRITOptions(max_levels=2, cfactor=2, max_iter=1, tol=0.0)
    traces = {}
    cal = calibrate(8, 2, [2], fwd, fwd, steps=2, repeats=1, traces=traces)
    e = cal["batches"]["2"]
    assert 0.0 <= e["untraced_share"] <= 1.0 and e["fixed_f"] >= 0 and e["untraced_layer"] >= 0
    assert traces[2].counts(0) == traces[2].solver_counts(0)
    assert len(traces[2].meta["step_walls"]) == 2 and cal["lean"]["n_layers"] == 8
    with pytest.raises(ValueError, match="steps >= 2"):
        calibrate(8, 2, [2], fwd, fwd, steps=1)
    # inexact (one forward cycle) is off the exact gradient; as many cycles as a two-level
    # F-relaxation needs (N / m) make it exact
    assert gradient_error(8, 2, 2, fwd, fwd) > 1e-6
    exact = MGRITOptions(max_levels=2, cfactor=2, max_iter=4, tol=0.0)
    assert gradient_error(8, 2, 2, exact, exact) < 1e-10
