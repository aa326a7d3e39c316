"""MPI test cases (run on every rank by tests/mpi_harness.py): the layer-parallel modules (mgrit.nn)."""
