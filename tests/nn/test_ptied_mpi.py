"""Parameter-level ties across ranks (``LayerParallelResNet(tie={"lin.weight": ...})``,
mgrit/nn/resnet/tiespec.py and tied.py) on 1-4 ranks, N = 7 layers, float64 exact mode,
against an independently tied serial PyTorch network (tests/mpi_cases/nn/ptied_cases.py):
loss, output, every gradient right after ``backward()`` (a tied parameter's is the full serial
gradient on every rank holding it), parameters after 3 SGD-momentum steps (1e-10 relative),
replicas bitwise identical, the README's ``clip_grad_norm_(net, ...)``. Cases: one weight
shared by every layer with a bias and gain per layer (a neural ODE), and a mix of a whole-step
group with three parameter groups of different layers; the batched and per-layer MGRIT paths
and the one-level pipelined path. Also: bad specs raise one ValueError on every rank, a
checkpoint saved on 2 ranks loads on 3 (one stored copy per tied parameter), 2 layer ranks x
2 data-parallel replicas in the Trainer equal serial full-batch training.
"""
import pytest

from tests.mpi_cases.nn import ptied_cases
from tests.mpi_harness import MPIBatch

C = "tests.mpi_cases.nn.ptied_cases"
BATCH = MPIBatch()
CASES = {
    2: [("ode", 2, True, False), ("mixed", 1, True, True), ("mixed", 2, False, False)],
    3: [("ode", 1, True, True), ("mixed", 2, True, False), ("ode", 2, False, True)],
}
for k, cases in CASES.items():
    for kind, levels, batched, clip in cases:
        BATCH.add(k, f"ptied-{kind}-L{levels}-{'batched' if batched else 'per-layer'}"
                     f"{'-clip' if clip else ''}",
                  f"{C}:check_ptied", kind=kind, levels=levels, batched=batched, clip=clip)
BATCH.add(3, "errors", f"{C}:check_errors")
BATCH.add(3, "checkpoint_2_to_3_ranks", f"{C}:check_checkpoint")
BATCH.add(4, "ptied_with_2_replicas", f"{C}:check_with_replicas")


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_ptied(k, name):
    results = BATCH.run(k, name)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    print(f"{name} on {k} ranks: {results[0]}")


@pytest.mark.parametrize("kind,levels,batched,clip", [("ode", 2, True, True),
                                                       ("mixed", 1, True, False),
                                                       ("mixed", 2, False, True)])
def test_ptied_one_rank(kind, levels, batched, clip):
    """P = 1 (in this process): the same checks; ties need no communication there."""
    print(ptied_cases.check_ptied(kind, levels, batched, clip=clip))


def test_ptied_errors_one_rank():
    assert ptied_cases.check_errors() == 9
