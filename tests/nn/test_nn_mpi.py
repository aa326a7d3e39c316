"""Layer-parallel ResNet acceptance on 1-4 ranks against serial PyTorch autograd (float64).

Exact mode (forward and adjoint solves to 1e-13): output, loss, input and parameter gradients
within 1e-10 relative of serial autograd on the same weights, for dense / conv / two-conv steps,
tanh / relu / SmoothReLU, 2 and 3 levels, ``adjoint="mgrit"`` and ``"serial"``, N not divisible
by P, and through :class:`LayerParallelNet`. One level: bitwise. Inexact mode: the gradient
error falls with the iteration count. All checks for one rank count run in one MPI job.
"""
import ast

import pytest

from tests.mpi_harness import MPIBatch

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

C = "tests.mpi_cases.nn.nn_cases"
BATCH = MPIBatch()
EXACT_CASES = [  # kind, act, N, levels, cfactor, adjoint
    ("dense", "tanh", 13, 2, 4, "mgrit"),
    ("dense", "tanh", 10, 3, 2, "mgrit"),
    ("dense", "smoothrelu", 13, 3, 2, "serial"),
    ("dense", "tanh", 10, 2, 4, "serial"),
    ("conv", "relu", 10, 2, 4, "mgrit"),
    ("conv", "tanh", 13, 3, 2, "serial"),
    ("twoconv", "smoothrelu", 13, 3, 2, "mgrit"),
]
NET_CASES = [("dense", "tanh", 13, 3, 2, "mgrit"), ("conv", "smoothrelu", 10, 2, 4, "serial")]

for k in (1, 2, 3, 4):
    for kind, act, n, levels, m, adj in EXACT_CASES:
        BATCH.add(k, f"exact-{kind}-{act}-N{n}-L{levels}-m{m}-{adj}", f"{C}:check_exact",
                  kind=kind, act=act, n=n, levels=levels, cfactor=m, adjoint=adj)
    for kind, act, n, levels, m, adj in NET_CASES:
        BATCH.add(k, f"net_exact-{kind}-{act}-N{n}-L{levels}-m{m}-{adj}", f"{C}:check_net_exact",
                  kind=kind, act=act, n=n, levels=levels, cfactor=m, adjoint=adj)
    for kind, act, n in [("dense", "tanh", 13), ("conv", "smoothrelu", 10)]:
        BATCH.add(k, f"one_level_bitwise-{kind}-N{n}", f"{C}:check_one_level_bitwise",
                  kind=kind, act=act, n=n)
    BATCH.add(k, "to_serial-dense", "tests.mpi_cases.nn.nn_state_cases:check_to_serial", kind="dense", act="tanh", n=13,
              levels=3, cfactor=2)
    BATCH.add(k, "state_dict_roundtrip", "tests.mpi_cases.nn.nn_state_cases:check_state_dict_roundtrip", kind="dense",
              act="tanh", n=10)
for k in (1, 3):
    BATCH.add(k, "sgd_training-dense", f"{C}:check_sgd_training", kind="dense", act="tanh",
              n=13, levels=2, cfactor=4)
for k in (1, 4):
    BATCH.add(k, "to_serial-conv", "tests.mpi_cases.nn.nn_state_cases:check_to_serial", kind="conv", act="relu", n=10,
              levels=2, cfactor=4)
for k in (2, 3):
    BATCH.add(k, "inexact_converges", f"{C}:check_inexact_converges", kind="dense", act="tanh",
              n=13, levels=3, cfactor=2)
    BATCH.add(k, "warm_start", f"{C}:check_warm_start", kind="dense", act="tanh", n=13,
              levels=2, cfactor=2)
    BATCH.add(k, "construction_errors", f"{C}:check_construction_errors")
    BATCH.add(k, "warm_start_adjoint", f"{C}:check_warm_start_adjoint")
for k, adj in [(2, "mgrit"), (3, "serial")]:
    BATCH.add(k, f"finite_difference-{adj}", f"{C}:check_finite_difference", kind="dense",
              act="tanh", n=13, levels=2, cfactor=4, adjoint=adj)
BATCH.add(3, "finite_difference-twoconv", f"{C}:check_finite_difference", kind="twoconv",
          act="smoothrelu", n=10, levels=3, cfactor=2, adjoint="mgrit")
for k in (3, 4):
    BATCH.add(k, "state_dict_across_partitions", "tests.mpi_cases.nn.nn_state_cases:check_state_dict_across_partitions",
              kind="dense", act="tanh", n=13)


@pytest.mark.parametrize("k,name", BATCH.ids())
def test_nn(k, name):
    results = BATCH.run(k, name)
    if name.startswith(("exact", "net_exact", "to_serial", "sgd", "inexact", "finite", "warm")):
        assert len(set(results)) == 1, f"ranks disagree: {results}"
    if name.startswith("inexact"):
        errors = ast.literal_eval(results[0])
        print(f"{name} on {k} ranks: gradient errors for 1,2,4,8 iterations {errors}")
