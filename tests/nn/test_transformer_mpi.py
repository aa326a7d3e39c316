"""Layer-parallel transformers on 1-4 ranks against serial PyTorch autograd (float64).

Exact mode (forward and adjoint solves to 1e-13): output, loss, input gradient and every
parameter gradient within 1e-10 relative of serial autograd on the same weights, for a pre-LN
encoder and a causal decoder (``h = 1``), 5 and 7 layers (not divisible by 2, 3, 4), 2 and 3
levels; batched relaxation is used on ranks with at least two C-point intervals; a tiny causal
language model through LayerParallelNet. All checks of one rank count run in one MPI job.
"""
import ast

import pytest

from tests.mpi_harness import MPIBatch

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

C = "tests.mpi_cases.nn.transformer_cases"
BATCH = MPIBatch()
EXACT_CASES = [  # causal, N, levels, cfactor
    (False, 7, 2, 2), (False, 5, 3, 2), (True, 7, 3, 2), (True, 5, 2, 2),
]

for k in (1, 2, 3, 4):
    for causal, n, levels, m in EXACT_CASES:
        kind = "decoder" if causal else "encoder"
        BATCH.add(k, f"exact-{kind}-N{n}-L{levels}-m{m}", f"{C}:check_exact", causal=causal,
                  n=n, levels=levels, cfactor=m)
    BATCH.add(k, "lm_exact-N7-L2-m2", f"{C}:check_lm_exact", n=7, levels=2, cfactor=2)


@pytest.mark.parametrize("k,name", BATCH.ids())
def test_transformer_mpi(k, name):
    results = BATCH.run(k, name)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    worst, extra = ast.literal_eval(results[0])
    assert worst <= 1e-10
    if name.startswith("exact") and k <= 2:  # some rank holds >= 2 C-point intervals
        assert extra > 0, f"no batched calls on {k} ranks"
    print(f"{name} on {k} ranks: worst rel err {worst:.2e}, {extra}")
