"""The authors' own program (Günther et al. 2020, github.com/steffi7574/LayerParallelLearning)
reproduced row by row: their reference outputs of 311bc40 (``../shared/data/lpl_peaks``, see its
README; the product ships no copy) against ``experiments/reproductions/guenther_authors.py``.

Tolerances: the reference's own runs on 1, 2 and 5 ranks (the same arithmetic, sums split
differently) disagree by up to 9.3e-15 (objective, loss) and 1.1e-12 (gradient norm) relative
in one-level mode over 20 iterations, 3.7e-14 and 4.6e-12 in the inexact two-level mode; the
first rows here are allowed 10x that (``guenther_authors.ALLOWANCE``), and every step size,
line-search trial and printed accuracy must be equal. All 20 iterations on 1, 2 and 5 ranks:
``python experiments/reproductions/reproduce_guenther.py --authors-config ../shared/data/lpl_peaks``.
"""
from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

import pytest

from experiments.reproductions import guenther_authors as ga
from experiments.reproductions.guenther_problem import glibc_rand
from tests.mpi_harness import run_mpi

# <repo>/../shared/data/lpl_peaks (CI: a copy of shared/ beside the clone); LAYERPAR_LPL_PEAKS
# overrides it (a work tree elsewhere)
DATA = Path(os.environ.get("LAYERPAR_LPL_PEAKS") or
            Path(__file__).resolve().parents[2].parent / "shared" / "data" / "lpl_peaks")
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"the authors' reference outputs are "
                                f"not here: {DATA} is absent (a copy of shared/ beside the clone)")
# the reference's own disagreement over rank counts (311bc40, 20 iterations), per mode
SPREAD = {1: {"objective": 9.3e-15, "loss": 9.3e-15, "gnorm": 1.1e-12},
          10: {"objective": 3.7e-14, "loss": 3.7e-14, "gnorm": 4.6e-12}}


def test_glibc_rand_equals_the_c_library():
    libc = ctypes.util.find_library("c")
    if libc is None or "libc.so.6" not in libc:
        pytest.skip(f"no glibc here to compare with (found {libc!r})")
    lib = ctypes.CDLL(libc)
    for seed in (1, 7, 0):
        lib.srand(seed)
        assert glibc_rand(seed, 1000) == [lib.rand() for _ in range(1000)], seed


@needs_data
def test_reference_spread_is_what_the_tolerances_say():
    """The tolerances above are the reference files' own disagreement (read back here)."""
    files = ga.find_files(DATA)
    for L in (1, 10):
        got = ga.spread([ga.read_reference(files[("311bc40", P, L)])[1] for P in (1, 2, 5)])
        for c, v in SPREAD[L].items():
            assert v * 0.9 <= got[c] <= v * 1.05, (L, c, got[c])


def _within(d, levels):
    assert d["mismatched_rows"] == 0, d
    for c, v in SPREAD[levels].items():
        assert d[c] <= ga.ALLOWANCE * v, (c, d)


@needs_data
def test_exact_mode_one_rank_all_rows():
    """One level (sequential), 1 rank, all 20 iterations, in this process."""
    from mpi4py import MPI
    files = ga.find_files(DATA)
    cfg, ref = ga.read_reference(files[("311bc40", 1, 1)])
    d = ga.rel_diffs(ga.run_rows(cfg, ga.load_data(files), MPI.COMM_SELF), ref)
    assert d["rows"] == 20
    _within(d, 1)


@needs_data
@pytest.mark.slow
@pytest.mark.parametrize("levels", [1, 10])
def test_two_ranks_first_rows(levels):
    """2 ranks, one level (exact) and XBraid's inexact two-level mode (2 cycles, warm
    restarts, the authors' adjoint emulated): the first 4 rows."""
    d = run_mpi("tests.mpi_cases.experiments.guenther_authors_cases:check_rows", 2, timeout=300,
                data_dir=str(DATA), levels=levels, iters=4)
    for r in d:
        r = eval(r)  # noqa: S307 -- the harness returns each rank's repr
        assert r["rows"] == 4
        _within(r, levels)


@needs_data
def test_inexact_mode_needs_the_xbraid_adjoint():
    """Inexact mode on 1 rank, 3 rows: with the XBraid adjoint emulated the rows match; with
    layerpar's own adjoint (coarse step at the reversed C-point's layer, gradients from the
    final adjoint states) the objective after one iteration is off by ~3e-10 relative."""
    from mpi4py import MPI
    files = ga.find_files(DATA)
    cfg, ref = ga.read_reference(files[("311bc40", 1, 10)])
    data = ga.load_data(files)
    _within(ga.rel_diffs(ga.run_rows(cfg, data, MPI.COMM_SELF, 3), ref), 10)
    own = ga.rel_diffs(ga.run_rows(cfg, data, MPI.COMM_SELF, 2, {"xbraid_adjoint": False}), ref)
    assert own["objective"] > 1e-11 and own["gnorm"] > 1e-7, own
