"""Every HDF5 dataset the training library writes (metrics.h5, results.h5) carries HDF5's
Fletcher-32 checksum, so a corrupted file is a read error, never wrong numbers."""

import h5py
import numpy as np
import pytest

from mgrit.training.metrics import write_metrics
from mgrit.reporting.writers import save_series


def test_metrics_and_results_files_are_checksummed(tmp_path):
    hist = {"loss": [0.5, 0.25, None], "acc": [0.1, 0.2, 0.3]}
    write_metrics(tmp_path, hist, {"lr": 0.1})
    save_series(tmp_path / "results.h5", {"t": np.arange(40.0), "k": [1, 2]}, {"what": "test"})
    with h5py.File(tmp_path / "metrics.h5", "r") as f:
        assert all(f[k].fletcher32 for k in f) and sorted(f) == ["acc", "loss"]
        np.testing.assert_array_equal(f["loss"][()], [0.5, 0.25, np.nan])
        info = f["loss"].id.get_chunk_info(0)
    with h5py.File(tmp_path / "results.h5", "r") as f:
        assert all(f[k].fletcher32 for k in f)
        np.testing.assert_array_equal(f["t"][()], np.arange(40.0))
    with open(tmp_path / "metrics.h5", "r+b") as fh:  # flip the stored 0.25
        fh.seek(info.byte_offset + 8)
        b = fh.read(8)
        fh.seek(info.byte_offset + 8)
        fh.write(bytes(x ^ 0xFF for x in b))
    with h5py.File(tmp_path / "metrics.h5", "r") as f:
        np.testing.assert_array_equal(f["acc"][()], [0.1, 0.2, 0.3])
        with pytest.raises(OSError, match="filter returned failure"):
            f["loss"][()]
