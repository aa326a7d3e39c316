"""The gradient-bias monitor (mgrit.training.bias): the estimator against serial autograd and
plainly gathered inexact gradients on 1, 2 and 3 ranks (with data-parallel replicas), the
decision logic with injected numbers, the same decisions on every rank, no trace on training
when it never acts, resume with its state, and the main job's flags."""
import json
import math
import tempfile

import pytest
import torch
from mpi4py import MPI

from mgrit.parallel import ProcessGrid
from mgrit.training.bias import BiasMonitor, measure_bias
from layerpar.jobconfig import JobConfig
from tests.mpi_cases.training import bias_cases as cases
from tests.mpi_harness import MPIBatch

C = "tests.mpi_cases.training.bias_cases"
TMP = tempfile.mkdtemp(prefix="layerpar-bias-")
BATCH = MPIBatch(timeout=400)
BATCH.add(2, "estimator-P2", f"{C}:check_estimator", dp=1)
BATCH.add(2, "estimator-dp2", f"{C}:check_estimator", dp=2)
BATCH.add(3, "estimator-P3", f"{C}:check_estimator", dp=1, levels=3)
BATCH.add(2, "decisions-P2", f"{C}:check_same_decisions", dp=1, log_dir=TMP)
BATCH.add(2, "decisions-dp2", f"{C}:check_same_decisions", dp=2, log_dir=TMP)
BATCH.add(3, "decisions-P3", f"{C}:check_same_decisions", dp=1, log_dir=TMP)
BATCH.add(2, "no_trace", f"{C}:check_no_trace", log_dir=TMP)
BATCH.add(2, "resume", f"{C}:check_resume", ckpt_dir=TMP)


@pytest.mark.slow
@pytest.mark.parametrize("name,nprocs", [("estimator-P2", 2), ("estimator-dp2", 2),
                                         ("estimator-P3", 3)])
def test_estimator_equals_serial_autograd(name, nprocs):
    errs = BATCH.run(nprocs, name)
    assert all(float(e) <= 1e-10 for e in errs), errs


@pytest.mark.slow
@pytest.mark.parametrize("name,nprocs", [("decisions-P2", 2), ("decisions-dp2", 2),
                                         ("decisions-P3", 3)])
def test_every_rank_takes_the_same_decision(name, nprocs):
    actions = BATCH.run(nprocs, name)
    assert len(set(actions)) == 1, actions


@pytest.mark.slow
def test_monitor_that_never_acts_leaves_training_unchanged():
    losses = BATCH.run(2, "no_trace")
    assert len(set(losses)) == 1, losses


@pytest.mark.slow
def test_resume_keeps_the_monitor_state():
    losses = BATCH.run(2, "resume")
    assert len(set(losses)) == 1, losses


# -- in-process (one rank) -------------------------------------------------------------------
def test_estimator_one_rank():
    """One rank: the same comparison as on several ranks."""
    assert cases.check_estimator(dp=1) <= 1e-10


def _mon(**kw):
    return BiasMonitor(print_fn=lambda s: None, **kw)


def test_decision_logic_with_injected_numbers():
    m = _mon(action="raise", ratio=2.0, window=2)
    assert m.decide(1.0, 1.0) is None and m.streak == 0          # bias 1 <= 2 x noise 1
    assert m.decide(3.0, 1.0) is None and m.streak == 1          # dominated once
    assert m.decide(1.0, 1.0) is None and m.streak == 0          # the streak breaks
    assert m.decide(3.0, 1.0) is None and m.streak == 1
    assert m.decide(2.5, 1.0) == "raise" and m.streak == 0       # two in a row: act, reset
    assert m.decide(3.0, float("nan")) is None and m.streak == 0  # no estimate: no change
    m.decide(3.0, 1.0)
    assert m.decide(3.0, float("nan")) is None and m.streak == 1
    assert m.decide(5.0, 0.0) == "raise"                          # zero noise: any bias dominates
    assert m.checks == 9
    assert m.decide(0.0, 0.0) is None and m.streak == 0
    m.decide(3.0, 1.0)
    assert m.decide(3.0, 1.0, at_cap=True) == "serial"
    lm = _mon(action="raise", window=1, at_cap="log")
    assert lm.decide(3.0, 1.0, at_cap=True) == "log"
    assert _mon(action="serial", window=1).decide(3.0, 1.0) == "serial"
    assert _mon(action="log", window=1).decide(3.0, 1.0) == "log"
    assert _mon(window=1, ratio=0.5).decide(0.6, 1.0) == "raise"


@pytest.mark.parametrize("kw,msg", [
    (dict(action="switch"), "action='switch'"), (dict(every=0), "every=0"),
    (dict(ratio=-1.0), "ratio=-1.0"), (dict(ratio=math.inf), "ratio=inf"),
    (dict(window=True), "window=True"), (dict(micro_batches=1), "micro_batches=1"),
    (dict(reference="exact"), "reference='exact'"), (dict(at_cap="stop"), "at_cap='stop'"),
    (dict(max_fwd_iters=0), "max_fwd_iters=0"), (dict(log_path=3), "log_path=3")])
def test_bad_arguments_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        BiasMonitor(**kw)


def test_apply_restore_and_state_dict():
    """raise: +1 cycle each up to the caps; serial: one level; a fresh network gets the
    monitor's options back from its state_dict (restore)."""
    net = cases.make_net(MPI.COMM_SELF)
    m = _mon(max_fwd_iters=2, max_bwd_iters=3)
    assert m.apply(net, "raise") == {0: {"forward.max_iter": [1, 2], "backward.max_iter": [1, 2]}}
    assert not m._at_cap(net)
    assert m.apply(net, "raise") == {0: {"backward.max_iter": [2, 3]}}
    assert m._at_cap(net)
    state = m.state_dict()
    fresh = cases.make_net(MPI.COMM_SELF)
    m2 = _mon()
    m2.load_state_dict(json.loads(json.dumps(state)))  # plain contents
    m2.restore(fresh)
    r = fresh.resnet
    assert (r.fwd_opts.max_iter, r.bwd_opts.max_iter, r.fwd_opts.max_levels) == (2, 3, 2)
    m.apply(net, "serial")
    assert m.serial and net.resnet.fwd_opts.max_levels == net.resnet.bwd_opts.max_levels == 1
    m3 = _mon()
    m3.load_state_dict(m.state_dict())
    m3.restore(fresh)
    assert m3.serial and r.fwd_opts.max_levels == 1 and r.bwd_opts.max_iter == 3
    with pytest.raises(ValueError, match="'raise' or 'serial'"):
        m.apply(net, "log")


def test_serial_network_is_refused():
    net = torch.nn.Linear(3, 3)
    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="layer-parallel network"):
        measure_bias(net, x, y, ProcessGrid(MPI.COMM_SELF))


def test_job_flags_are_checked():
    ok = JobConfig(bias_monitor="raise", bias_every=10, bias_ratio=2.0, bias_window=3)
    assert ok.validated(1).bias_monitor == "raise"
    for kw, msg in [(dict(bias_monitor="on"), "--bias-monitor='on'"),
                    (dict(bias_every=0), "--bias-every=0"),
                    (dict(bias_ratio=0.0), "--bias-ratio=0.0"),
                    (dict(bias_window=0), "--bias-window=0"),
                    (dict(bias_monitor="raise", method="serial"), "--bias-monitor raise")]:
        with pytest.raises(ValueError, match=msg):
            JobConfig(**kw).validated(1)


@pytest.mark.slow
def test_main_job_logs_every_check(tmp_path, capsys):
    """The main job in this process (1 rank, digits, 8 layers, 3 levels, 4 steps) with
    ``--bias-monitor raise --bias-every 1 --bias-ratio 1e-6 --bias-window 1``: every check is
    logged to RUN/bias.jsonl; the first three raise the cycles (2/1 -> 3/2 -> 4/3 -> 5/4) and
    the measured bias falls with each; with 5/4 cycles on 3 levels of 8 layers the solve is
    exact (MGRIT is exact after N/cfactor cycles), the bias is float32 round-off and the fourth
    check does nothing. Actions are announced on the console."""
    from layerpar.job import run_job  # the main job imports layerwise and data: heavy
    c = JobConfig(dataset="digits", layers=8, cfactor=2, width=8, epochs=1, limit_train=100,
                  limit_test=20, batch_size=25, no_progress=True, bias_monitor="raise",
                  bias_every=1, bias_ratio=1e-6, bias_window=1,
                  out=str(tmp_path / "run")).validated(1)
    run_job(c, MPI.COMM_WORLD)
    lines = [json.loads(s) for s in (tmp_path / "run" / "bias.jsonl").read_text().splitlines()]
    assert [e["action"] for e in lines] == ["raise"] * 3 + ["none"]
    assert [(e["options"][0]["fwd_iters"], e["options"][0]["bwd_iters"]) for e in lines] == \
        [(3, 2), (4, 3), (5, 4), (5, 4)]
    bias = [e["bias"] for e in lines]
    assert bias[0] > bias[1] > bias[2] > 1e-6 * lines[2]["noise"], bias
    assert bias[3] <= 1e-6 * lines[3]["noise"] and bias[3] < 1e-2 * bias[2], bias
    assert all(e["noise"] > 0 and e["micro_batches"] == 4 for e in lines)
    out = capsys.readouterr().out
    assert "[bias] step 0: gradient bias" in out and "raised cycles" in out, out
