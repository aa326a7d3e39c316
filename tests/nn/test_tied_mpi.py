"""Weight-tied layers across ranks (``LayerParallelResNet(tie=...)``, mgrit/nn/resnet/tied.py) on 1-4
ranks, N = 7 layers (not divisible by 2, 3, 4), float64 exact mode, against serial PyTorch
autograd with the same tied module(s) (tests/mpi_cases/nn/tied_cases.py): loss, output, every
gradient right after ``backward()`` (a tied parameter's is the full serial gradient on every
rank holding it, with no extra call), parameters after 3 SGD-momentum steps (to 1e-9
relative), replicas bitwise identical. Cases: one module for all layers (a neural ODE), groups
of 3 layers (one group spans two ranks) plus an untied layer, one shared transformer block
(ALBERT); the batched MGRIT path, the per-layer MGRIT path and the one-level pipelined path.
Also: a drifted replica is detected, bad ``tie`` values and undeclared sharing raise one
ValueError on every rank, a checkpoint saved on 2 ranks loads on 3 (weights and momentum
equal, one stored copy per tie group); the main job's ``--tied`` ResNet equals its serial twin
(2 ranks); 2 layer ranks x 2 data-parallel replicas in the Trainer equal serial full-batch
training. One MPI job per rank count 2-4; one rank runs in the
test process.
"""
import pytest

from tests.mpi_cases.nn import tied_cases
from tests.mpi_harness import MPIBatch

pytestmark = pytest.mark.slow  # MPI launches / builds (the quick subset skips them)

C = "tests.mpi_cases.nn.tied_cases"
BATCH = MPIBatch()
CASES = {
    2: [("one", 2, True), ("groups", 1, True), ("albert", 2, True)],
    3: [("groups", 2, True), ("groups", 2, False), ("one", 1, True)],
    4: [("groups", 1, True)],
}
for k, cases in CASES.items():
    for kind, levels, batched in cases:
        BATCH.add(k, f"tied-{kind}-L{levels}-{'batched' if batched else 'per-layer'}",
                  f"{C}:check_tied", kind=kind, levels=levels, batched=batched)
BATCH.add(2, "replica_drift", f"{C}:check_replica_drift_detected")
BATCH.add(2, "job_tied_resnet", f"{C}:check_job_tied_resnet")
BATCH.add(3, "errors", f"{C}:check_errors")
BATCH.add(4, "tied_with_2_replicas", f"{C}:check_tied_with_replicas")
BATCH.add(3, "checkpoint_2_to_3_ranks", f"{C}:check_checkpoint")


@pytest.mark.parametrize("k,name", BATCH.ids())
def test_tied(k, name):
    results = BATCH.run(k, name)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    print(f"{name} on {k} ranks: {results[0]}")


@pytest.mark.parametrize("kind,levels,batched", [("one", 2, True), ("groups", 2, False)])
def test_tied_one_rank(kind, levels, batched):
    """P = 1 (in this process): the same checks; ties need no communication there."""
    print(tied_cases.check_tied(kind, levels, batched))


def test_tied_errors_one_rank():
    assert tied_cases.check_errors() == 5
