"""Every script in ``examples/`` runs as written (``--quick``) on 2 ranks and prints what it
promises: the loss falls, the exported plain PyTorch model equals the layer-parallel net, the
resumed run on another grid equals the uninterrupted one, MGRIT on a user ODE equals
sequential time stepping. One MPI job runs them all (``tests/examples_runner.py``)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.mpi_harness import mpiexec_path
from tests.job.test_train_job import ROOT, TIMEOUT, job_env

pytestmark = pytest.mark.slow  # MPI launches / builds (the quick subset skips them)

RUNS = [  # (example, arguments), run in this order in one job
    ("resnet_custom_step", ["--quick"]),
    ("transformer_vit", ["--quick"]),
    ("gru_sequence", ["--quick"]),
    ("hybrid_checkpoint", ["--quick"]),
    ("layerwise_training", ["--quick"]),
    ("layerwise_training", ["--quick", "--method", "sequential"]),
    ("ode_solver", ["--quick"]),
    ("spatial_coarsening", ["--quick"]),
]
NUM = r"([-+0-9.e]+)"


def test_every_example_is_run_here():
    assert sorted({n for n, _ in RUNS}) == sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("examples")
    cmd = [mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py",
           str(ROOT / "tests" / "examples_runner.py"), str(out)]
    cmd += [f"{n}:{','.join(a)}" for n, a in RUNS]
    p = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True,
                       timeout=TIMEOUT)
    sys.stderr.write(p.stderr[-2000:])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return {i: (out / f"{i}-{n}.rank-0.txt").read_text() for i, (n, _) in enumerate(RUNS)}


def _floats(pattern: str, text: str) -> list[float]:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text}"
    return [float(g) for g in m.groups()]


def test_resnet_custom_step(outputs):
    text = outputs[0]
    before, after = _floats(rf"test loss before {NUM} after {NUM}", text)
    assert after < before
    (diff,) = _floats(rf"max \|diff\| {NUM}", text)
    assert diff < 1e-12  # float64, exact solves: the exported model is the same function


def test_transformer_vit(outputs):
    first, = _floats(rf"step 0 loss {NUM}", outputs[1])
    last, = _floats(rf"step 19 loss {NUM}", outputs[1])
    acc, = _floats(rf"test accuracy {NUM};", outputs[1])
    assert last < first - 0.3 and acc > 0.3  # 10 classes: chance is 0.1


def test_gru_sequence(outputs):
    first, = _floats(rf"first batch MSE {NUM};", outputs[2])
    mgrit, serial = _floats(rf"test MSE {NUM} \(3 MGRIT cycles\) {NUM}", outputs[2])
    assert mgrit < first and abs(mgrit - serial) < 0.01 * serial


def test_hybrid_checkpoint(outputs):
    resumed, = _floats(rf"then 2x1: test loss {NUM}", outputs[3])
    straight, = _floats(rf"throughout: test loss {NUM}", outputs[3])
    assert abs(resumed - straight) < 1e-9


@pytest.mark.parametrize("i", [4, 5])
def test_layerwise_training(outputs, i):
    before, after = _floats(rf"test accuracy {NUM} before, {NUM} after", outputs[i])
    assert after > before + 0.05


def test_ode_solver(outputs):
    err, = _floats(rf"max \|MGRIT - sequential\| = {NUM}", outputs[6])
    cycles, = _floats(r"(\d+) cycles", outputs[6])
    assert err < 1e-9 and cycles < 30


def test_spatial_coarsening(outputs):
    err, = _floats(rf"max \|space-time - serial\| = {NUM}", outputs[7])
    time_only, space_time = _floats(r"time-only (\d+) cycles, space-time (\d+) cycles",
                                    outputs[7])
    assert err < 1e-9 and 1 <= time_only < 50 and 1 <= space_time < 50
    cost, = _floats(rf"level-1 step costs {NUM} of a fine step", outputs[7])
    assert abs(cost - 343 / 3375) < 1e-4
    first, last = _floats(rf"training loss {NUM} -> {NUM}", outputs[7])
    assert last < first
