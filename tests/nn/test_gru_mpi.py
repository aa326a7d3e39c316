"""ParallelGRU acceptance on 1-4 ranks against serial PyTorch autograd (float64).

Exact mode (forward and adjoint solves to 1e-13): final state, sequence output, input, initial
state and all parameter gradients within 1e-10 relative of an unrolled ``nn.GRUCell`` with the
same weights, for sequence lengths 10-23 (not divisible by the rank count), 2 and 3 levels,
both coarse propagators, with and without the sequence output in the loss. One level: outputs
bitwise ``nn.GRU``. Inexact mode: the gradient error falls with the iteration count. Bad input:
the same ValueError on every rank. Autograd patterns on 1-3 ranks
(``tests/mpi_cases/nn/gru_autograd_cases.py``): several forwards then one backward, F1 F2 B1 B2,
``retain_graph``, ``torch.autograd.grad``, an evaluation forward in between, non-reentrant
checkpointing, frozen parameters, in-place changes as serial autograd treats them -- gradients
within 1e-10 of serial autograd -- and the same RuntimeError on every rank for a second
backward without the graph, a saved tensor changed in place (also on one rank only), ranks
backpropagating different forwards, ``create_graph``. All checks for one rank count run in
one MPI job.
"""
import ast

import pytest

from tests.mpi_harness import MPIBatch

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

C = "tests.mpi_cases.nn.gru_cases"
A = "tests.mpi_cases.nn.gru_autograd_cases"
AUTOGRAD_CHECKS = ["forwards_then_one_backward", "interleaved_backwards", "retain_graph",
                   "autograd_grad", "eval_forward_between", "checkpoint", "frozen",
                   "inplace_like_serial", "inplace_raises", "create_graph_refused"]
BATCH = MPIBatch()
EXACT_CASES = [  # seq length, levels, cfactor, coarse, sequence output in the loss
    (10, 2, 2, "power", True),
    (13, 3, 2, "power", False),
    (23, 2, 4, "implicit", True),
    (17, 3, 2, "implicit", False),
    (23, 3, 2, "power", True),
]

for k in (1, 2, 3, 4):
    for n, levels, m, coarse, seq in EXACT_CASES:
        BATCH.add(k, f"exact-N{n}-L{levels}-m{m}-{coarse}-{'seq' if seq else 'last'}",
                  f"{C}:check_exact", n=n, levels=levels, cfactor=m, coarse=coarse, seq_out=seq)
    BATCH.add(k, "one_level_bitwise-N11", f"{C}:check_one_level_bitwise", n=11)
    BATCH.add(k, "bad_inputs", f"{C}:check_bad_inputs")
for k in (2, 3):
    BATCH.add(k, "inexact_converges", f"{C}:check_inexact_converges")
    BATCH.add(k, "several_forwards", f"{C}:check_several_forwards")
BATCH.add(2, "warm_start", f"{C}:check_warm_start")
for k in (1, 3):
    BATCH.add(k, "classifier_sgd", f"{C}:check_classifier_sgd")
for k in (1, 2, 3):
    for check in AUTOGRAD_CHECKS:
        BATCH.add(k, f"autograd_{check}", f"{A}:check_{check}")
    if k > 1:
        BATCH.add(k, "autograd_mismatched_backwards", f"{A}:check_mismatched_backwards")


@pytest.mark.parametrize("k,name", BATCH.ids())
def test_gru(k, name):
    results = BATCH.run(k, name)
    if not name.startswith("warm"):
        assert len(set(results)) == 1, f"ranks disagree: {results}"
    if name.startswith("inexact"):
        print(f"{name} on {k} ranks: gradient errors for 1,2,4,8 iterations "
              f"{ast.literal_eval(results[0])}")
