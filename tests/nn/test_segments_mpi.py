"""Several layer-parallel segments in one network, on 1-4 ranks, against serial PyTorch
autograd (float64, exact mode: solves to 1e-13, compared to 1e-10 relative).

A staged conv ResNet (stem, segments of 5 / 7 / 5 layers, two strided transitions, head) and a
decoder-style net (lift, two serial buffer layers, an 11-layer segment, a buffer, head): output,
loss, input gradient and every parameter gradient equal an independently built serial
``nn.Sequential`` with the same weights; 2 and 3 levels; layer counts not divisible by the rank
count. Several forwards before one backward; global state dicts; bad input raising the same
error on every rank; the example of ``mgrit/nn/__init__.py`` run as written on 1, 2 and 3 ranks
prints the same losses. All checks of one rank count run in one MPI job.
"""
import ast

import pytest

from tests.mpi_harness import MPIBatch

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

C = "tests.mpi_cases.nn.segments_cases"
BATCH = MPIBatch()
for k in (1, 2, 3, 4):
    for arch in ("staged_conv", "buffered"):
        for levels in (2, 3):
            BATCH.add(k, f"exact-{arch}-L{levels}", f"{C}:check_exact", arch=arch, levels=levels)
    BATCH.add(k, "several_forwards", f"{C}:check_several_forwards", levels=2)
for k in (2, 3):
    BATCH.add(k, "state_dicts", f"{C}:check_state_dicts")
    BATCH.add(k, "errors", f"{C}:check_errors")
    BATCH.add(k, "p2p_exact", f"{C}:check_p2p_exact")
for k in (1, 2, 3):
    BATCH.add(k, "docstring_example", f"{C}:check_docstring_example")


@pytest.mark.parametrize("k,name", [i for i in BATCH.ids() if i[1] != "docstring_example"])
def test_segments(k, name):
    results = BATCH.run(k, name)
    if name.startswith(("exact", "several")):
        assert len(set(results)) == 1, f"ranks disagree: {results}"
        print(f"{name} on {k} ranks: worst relative error {results[0]}")


def test_docstring_example_same_losses_on_1_2_3_ranks():
    """The documented example prints the same three losses for P = 1, 2, 3 (it trained from
    weights that depended on P before build() kept the caller's RNG state: step-0 loss
    1.746 / 1.784 / 1.796)."""
    losses = {}
    for k in (1, 2, 3):
        per_rank = [ast.literal_eval(r) for r in BATCH.run(k, "docstring_example")]
        assert all(r == per_rank[0] for r in per_rank), f"ranks of P={k} print {per_rank}"
        losses[k] = per_rank[0]
    print(f"example losses by P: {losses}")
    base = losses[1]
    for k, ls in losses.items():
        assert ls[0] == pytest.approx(base[0], rel=1e-6, abs=0), f"step-0 loss {losses}"
        assert ls == pytest.approx(base, rel=1e-5, abs=0), f"losses {losses}"
