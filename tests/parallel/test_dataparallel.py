"""Data parallelism: process grid, bucketed gradient averaging, replicas = serial training.

Acceptance 1: P_D = 2 on 2 ranks reproduces 1-rank training with the same global batches over 3
SGD-with-momentum steps (float64, conv + MLP on ``digits``) to <= 1e-12 relative; the 1-rank
reference is computed serially on every rank inside the same job. Acceptance 2: P_L = 2 x P_D = 2 on 4 ranks, exact MGRIT
forward/adjoint solves (:mod:`mgrit.nn`), equals serial training (<= 1e-10). Acceptance 3: bad grid shapes
and mismatched replicas raise a clear ``ValueError`` on every rank. All checks for one rank count
run in one MPI job (2 jobs in all); a few single-process checks use ``COMM_SELF``.
"""
import pytest
import torch
from mpi4py import MPI

from mgrit.parallel.dataparallel import average_gradients, check_replicas_consistent
from mgrit.parallel.procgrid import ProcessGrid, check_grid_shape, device_for_rank
from tests.mpi_harness import MPIBatch

C = "tests.mpi_cases.core.dp_cases"
BATCH = MPIBatch()
BATCH.add(2, "dp_equals_serial", f"{C}:check_dp_equals_serial", global_batch=64)
BATCH.add(2, "dp_equals_serial-small_buckets", f"{C}:check_dp_equals_serial", global_batch=64,
          bucket_bytes=4096)
BATCH.add(2, "dp_equals_serial-unequal_shards", f"{C}:check_dp_equals_serial", global_batch=63,
          weighted=True)
for mode in ("buckets", "views", "set_to_none"):
    BATCH.add(2, f"dp_equals_serial-gradient_buckets-{mode}", f"{C}:check_dp_equals_serial",
              global_batch=64, persistent=mode)
BATCH.add(2, "dp_equals_serial-gradient_buckets-small-unequal", f"{C}:check_dp_equals_serial",
          global_batch=63, bucket_bytes=4096, weighted=True, persistent="buckets")
BATCH.add(4, "layer_parallel_x_dp_equals_serial", f"{C}:check_layer_parallel_dp_equals_serial",
          data_parallel=2)
for k in (2, 4):
    for dp in ((1, 2) if k == 2 else (1, 2, 4)):
        BATCH.add(k, f"grid_layout-dp{dp}", f"{C}:check_grid_layout", data_parallel=dp)
    for bad in ([3, 0, -2, 1.5, "2", True] if k == 2 else [3, 8]):
        BATCH.add(k, f"bad_grid-{bad!r}", f"{C}:check_bad_grid", value=bad)
    BATCH.add(k, "grid_disagree", f"{C}:check_grid_disagree")
    for kind in ("count", "shape", "values"):
        BATCH.add(k, f"mismatched_replicas-{kind}", f"{C}:check_mismatched_replicas", kind=kind)
    for name in ("bucket_counts", "mixed_dtypes", "none_grads", "weight", "bad_arguments",
                 "broadcast_fixes_values"):
        BATCH.add(k, name, f"{C}:check_{name}")
    for name in ("buckets_match_average_gradients", "buckets_errors"):
        BATCH.add(k, name, f"tests.mpi_cases.core.gradbuckets_cases:check_{name}")


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_dataparallel_mpi(k, name):
    results = BATCH.run(k, name)
    if name.startswith(("bad_grid", "grid_disagree", "mismatched")):
        assert len(set(results)) == 1, f"ranks disagree on the error: {results}"
    if name.startswith(("dp_equals_serial", "layer_parallel")):
        print(name, results)


def test_grid_shape_messages():
    assert check_grid_shape(6, 3) == 3
    with pytest.raises(ValueError, match=r"P_D=4 does not divide the number of ranks 6.*\[1, 2, 3, 6\]"):
        check_grid_shape(6, 4)
    for bad in (0, -1, 2.0, "2", None, True):
        with pytest.raises(ValueError, match="positive int"):
            check_grid_shape(6, bad)


def test_single_process():
    g = ProcessGrid(MPI.COMM_SELF)
    assert (g.layer_size, g.data_size, g.layer_rank, g.data_rank) == (1, 1, 0, 0)
    assert g.device == device_for_rank(MPI.COMM_SELF)
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    p.grad = torch.full((3,), 2.0, dtype=torch.float64)
    assert average_gradients([p], MPI.COMM_SELF) == 0
    assert torch.equal(p.grad, torch.full((3,), 2.0, dtype=torch.float64))
    assert average_gradients([p], MPI.COMM_SELF, weight=0.25) == 1
    assert torch.equal(p.grad, torch.full((3,), 0.5, dtype=torch.float64))
    check_replicas_consistent([p], MPI.COMM_SELF, check_values=True)
