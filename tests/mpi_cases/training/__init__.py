"""MPI test cases (run on every rank by tests/mpi_harness.py): the runtime, the main job, layer-wise training, multilevel, models."""
