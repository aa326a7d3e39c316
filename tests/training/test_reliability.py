"""Reliability acceptance (mgrit.training.support.faults, mgrit.training.guard, mgrit.training.checkpoint).

1. Fault injection: one job per phase (5: each phase once; P = 2, 3, 4, gradient averaging at
   P = 4 = 2 layer ranks x 2 replicas; random ranks and entries from a fixed seed; 2 of them
   launched without ``-m mpi4py``), run a few at a time; each must exit non-zero, name the
   rank and phase, and die within 30 s of the injected fault (``FAULT_DEADLINE``); a job
   still running after ``HANG_TIMEOUT`` counts as a hang. (20 random trials until issue 39:
   each start costs about 5 CPU-s per rank, and the 15 more covered no other phase, P or
   launch mode.) (The whole-job wall time includes
   starting torch on every rank, which on a heavily shared 2-core machine alone takes 10-25 s,
   so the 30 s are measured from the fault, whose time the injector prints.)
2. >= 25 bad inputs, one 3-rank job, the message asserted on every rank.
3. kill -9 during a checkpoint write; bitwise resume on P = 2 (exact and inexact/warm start);
   a P = 2 checkpoint resumed on P = 1 and P = 3 (1e-10), determinism across P.
4. A diverging configuration triggers the guard: warn / add_iterations / serial.
"""
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.mpi_harness import MPIBatch, mpiexec_path

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

ROOT = Path(__file__).resolve().parents[2]
C = "tests.mpi_cases.training.reliability_cases"
V = "tests.mpi_cases.training.bad_input_cases"  # acceptance 2
TMP = tempfile.mkdtemp(prefix="layerpar-rel-")
BATCH = MPIBatch(timeout=300)

BATCH.add(3, "bad_inputs", f"{V}:check_bad_inputs", tmp_dir=TMP)
for mode in ("exact", "inexact"):
    BATCH.add(2, f"resume_bitwise-{mode}", f"{C}:check_resume_bitwise", ckpt_dir=TMP, mode=mode)
BATCH.add(2, "save_for_repartition", f"{C}:check_save_for_repartition", ckpt_dir=TMP)
for action in ("warn", "add_iterations", "serial"):
    BATCH.add(2, f"guard-{action}", f"{C}:check_guard", action=action, log_dir=TMP)
BATCH.add(2, "nonfinite_state", f"{C}:check_nonfinite_state_named")
RESUME = MPIBatch(timeout=300, shared=False)  # own jobs: they need the P=2 checkpoint first
for k in (1, 3):
    RESUME.add(k, "resume_repartitioned", f"{C}:check_resume_repartitioned", ckpt_dir=TMP, saved_p=2)


# -- 2 ----------------------------------------------------------------------------------------
def test_bad_inputs_on_every_rank():
    results = BATCH.run(3, "bad_inputs")
    assert len(set(results)) == 1 and int(results[0]) >= 25, results


# -- 3 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "inexact"])
def test_resume_bitwise_same_p(mode):
    results = BATCH.run(2, f"resume_bitwise-{mode}")
    assert len(set(results)) == 1, results


@pytest.mark.parametrize("k", [1, 3])
def test_resume_on_other_p(k):
    ref2 = eval(BATCH.run(2, "save_for_repartition")[0])
    got = eval(RESUME.run(k, "resume_repartitioned")[0])
    assert len(got) == len(ref2) == 4
    assert max(abs(a - b) for a, b in zip(got, ref2)) <= 1e-10, (got, ref2)


def _child_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("LAYERPAR_INJECT_FAULT", None)
    return env


def test_kill9_during_checkpoint_write(tmp_path):
    path = tmp_path / "ckpt.pt"
    code = f"from {C} import kill_child; kill_child({str(path)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=_child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.strip() == "writing":
                break
        assert lines[-2:] == ["saved", "writing"], (lines, proc.stderr.read() if proc.poll() else "")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert Path(str(path) + ".tmp").exists()  # the interrupted write
    import torch
    from tests.mpi_cases.training.reliability_cases import params_after_one_step_loaded
    want, got, extra = params_after_one_step_loaded(str(path))
    assert extra["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(want, got))


# -- 4 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("action", ["warn", "add_iterations", "serial"])
def test_guard_on_diverging_config(action):
    hist = eval(BATCH.run(2, f"guard-{action}")[0])
    assert hist[-1] > hist[0]


def test_nonfinite_state_named():
    msgs = BATCH.run(2, "nonfinite_state")
    assert len(set(msgs)) == 1 and "x_6" in msgs[0], msgs


# -- 1 ----------------------------------------------------------------------------------------
PHASES = ["forward relaxation", "coarse solve", "adjoint", "data loading", "gradient averaging"]
# trial i: P = (2, 3, 4)[i % 3], with ``-m mpi4py`` for even i; this order puts gradient
# averaging on P = 4 (across the replicas) and gives every P and launch mode at least once
TRIAL_PHASES = ["forward relaxation", "coarse solve", "gradient averaging", "data loading",
                "adjoint"]
FAULT_DEADLINE = 30.0
HANG_TIMEOUT = float(os.environ.get("LAYERPAR_FAULT_HANG_TIMEOUT", "120"))
PARALLEL = int(os.environ.get("LAYERPAR_FAULT_PARALLEL", "4"))


def _trials():
    rng = random.Random(20240607)
    out = []
    for i, phase_name in enumerate(TRIAL_PHASES):
        P = (2, 3, 4)[i % 3]
        out.append((P, rng.randrange(P), phase_name, rng.randint(1, 2), i % 2 == 0))
    return out


def _run_trial(trial):
    P, rank, phase_name, entry, with_m = trial
    env = _child_env()
    env["LAYERPAR_INJECT_FAULT"] = f"{rank}:{phase_name}:{entry}"
    cmd = [mpiexec_path(), "-n", str(P), sys.executable] + (["-m", "mpi4py"] if with_m else []) \
        + [str(ROOT / "tests" / "mpi_cases" / "training" / "fault_job.py")]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=HANG_TIMEOUT)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = None, f"HUNG (> {HANG_TIMEOUT} s): {exc.stderr}"
    return trial, rc, out, time.time() - t0, time.time()


def test_fault_injection_trials():
    trials = _trials()
    assert sorted(t[2] for t in trials) == sorted(PHASES)  # every phase once
    assert {t[0] for t in trials} == {2, 3, 4} and {t[4] for t in trials} == {True, False}
    assert ("gradient averaging", 4) in {(t[2], t[0]) for t in trials}
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(_run_trial, trials))
    # A job that exited non-zero with no output at all lost its stdio in the launcher (seen
    # once, on a loaded 2-core machine): run that trial once more, alone.
    results = [_run_trial(r[0]) if (r[1] not in (None, 0) and not r[2].strip()) else r
               for r in results]
    problems = []
    for (P, rank, phase_name, entry, with_m), rc, out, wall, t_end in results:
        tag = f"P={P} rank={rank} phase={phase_name!r} entry={entry} -m mpi4py={with_m}"
        m = re.search(r"at t=(\d+\.\d+)", out)
        latency = t_end - float(m.group(1)) if m else None
        if rc is None:
            problems.append(f"{tag}: hung\n{out[-1500:]}")
        elif rc == 0:
            problems.append(f"{tag}: exited 0\n{out[-1500:]}")
        elif f"rank {rank} failed in phase {phase_name}" not in out:
            problems.append(f"{tag}: no 'rank {rank} failed in phase {phase_name}' (exit {rc})\n"
                            f"{out[-1500:]}")
        elif latency is None or latency > FAULT_DEADLINE:
            problems.append(f"{tag}: exit {latency} s after the fault (job {wall:.1f} s)")
    assert not problems, "\n\n".join(problems)
