"""Günther et al.'s own Peaks runs (their reference outputs) reproduced on this job's ranks
(``tests/experiments/test_guenther_authors.py``)."""
from __future__ import annotations

import torch
from mpi4py import MPI


def check_rows(data_dir: str, levels: int, iters: int, overrides=None) -> dict:
    """The first ``iters`` rows of the authors' ``peaks.npt{P}.ml{levels}`` configuration (311bc40)
    on COMM_WORLD; returns :func:`guenther_authors.rel_diffs` against their file."""
    from experiments.reproductions import guenther_authors as ga
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    files = ga.find_files(data_dir)
    cfg, ref = ga.read_reference(files[("311bc40", MPI.COMM_WORLD.Get_size(), levels)])
    rows = ga.run_rows(cfg, ga.load_data(files), MPI.COMM_WORLD, iters, overrides)
    return ga.rel_diffs(rows, ref)
