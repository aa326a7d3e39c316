"""Depth transfer and MG/Opt on 2 and 3 ranks (float64), against serial references computed on
every rank: transferred weights bitwise (layer-parallel = serial operators = hand formulas),
round trips exact, O(h) output order of prolonged networks (ratios in [1.6, 2.4], N = 8..64),
errors agreed on every rank, MG/Opt first-order coherence 1e-12, layer-parallel MG/Opt = serial
MG/Opt (1e-9), data-parallel MG/Opt = full-batch serial MG/Opt (1e-12), L-BFGS refused under
layer parallelism. All checks of one rank count run in one MPI job (tests/mpi_harness.py)."""
import pytest

from tests.mpi_harness import MPIBatch

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

C = "tests.mpi_cases.training.multilevel_cases"
BATCH = MPIBatch()
for k in (2, 3):
    BATCH.add(k, "depth_transfer", f"{C}:check_depth_transfer")
    BATCH.add(k, "depth_errors", f"{C}:check_depth_errors")
    BATCH.add(k, "mgopt_coherence", f"{C}:check_mgopt_coherence")
    BATCH.add(k, "mgopt_lbfgs_refused", f"{C}:check_mgopt_lbfgs_refused")
    BATCH.add(k, "mgopt_bad_closure", f"{C}:check_mgopt_bad_closure")
    for method in ("constant", "linear"):
        BATCH.add(k, f"depth_order-{method}", f"{C}:check_depth_order", method=method)
BATCH.add(2, "mgopt_layer_parallel-N8-L2", f"{C}:check_mgopt_layer_parallel", n=8, levels=2)
BATCH.add(3, "mgopt_layer_parallel-N12-L2", f"{C}:check_mgopt_layer_parallel", n=12, levels=2)
BATCH.add(2, "mgopt_data_parallel", f"{C}:check_mgopt_data_parallel")


@pytest.mark.parametrize("k,name", BATCH.ids())
def test_multilevel(k, name):
    results = BATCH.run(k, name)
    if name.startswith(("depth_order", "mgopt_layer", "mgopt_coherence")):
        assert len(set(results)) == 1, f"ranks disagree: {results}"
    print(f"{name} on {k} ranks: {results[0]}")
