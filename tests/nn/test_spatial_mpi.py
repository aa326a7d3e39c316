"""Spatial coarsening (mgrit/spatial/) on P = 2 and 3 layer ranks, float64 exact mode, against
serial PyTorch autograd (tests/mpi_cases/nn/spatial_cases.py, <= 1e-10): 2-D and 3-D conv
ResNets, 2 and 3 levels with one or two coarsened levels, vertex and cell grids, odd and even
sizes, batched kernels on and off; 2 layer ranks x 2 data-parallel replicas in the Trainer.
One MPI job per rank count."""
import pytest

from tests.mpi_harness import MPIBatch

pytestmark = pytest.mark.slow  # MPI launches

C = "tests.mpi_cases.nn.spatial_cases"
BATCH = MPIBatch()
CASES = {
    2: [dict(dims=2, size=7), dict(dims=2, size=8, batched=False, levels=3, coarsened=(1, 2)),
        dict(dims=3, size=5, grid="vertex", restrict="injection")],
    3: [dict(dims=2, size=8, grid="cell", levels=3, coarsened=(2,)),
        dict(dims=3, size=6, levels=3, coarsened=(1, 2), prolong="constant", batched=False),
        dict(dims=2, size=15, levels=3, coarsened=(1, 2))],
}
for k, cases in CASES.items():
    for kw in cases:
        name = "-".join(f"{a}{b}" for a, b in kw.items())
        BATCH.add(k, name, f"{C}:check_exact", **kw)
BATCH.add(4, "replicas", f"{C}:check_replicas")


@pytest.mark.parametrize("k,name", BATCH.ids())
def test_spatial(k, name):
    results = BATCH.run(k, name)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    print(f"{name} on {k} ranks: {results[0]}")
