"""MPI test cases (run on every rank by tests/mpi_harness.py): the solver core, data parallelism, the cost model and traces."""
