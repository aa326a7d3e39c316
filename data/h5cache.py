"""HDF5 cache of prepared splits: atomic writing, validated lazy reading.

File layout (format version :data:`FORMAT_VERSION` = 1), one file per split,
written by ``python -m data prepare NAME --out DIR`` as ``DIR/NAME-train.h5``
and ``DIR/NAME-test.h5``. Both datasets are chunked by whole rows (about
:data:`data.h5format.CHUNK_BYTES` per chunk) with HDF5's Fletcher-32 checksum
filter, which HDF5 verifies on every read: a corrupted chunk is an error naming
the file and dataset, never silently wrong data. Caches written before the
checksums (contiguous datasets, no filter) are refused with the command that
rebuilds them.

* dataset ``x``: raw inputs in the source dtype, unnormalized -- uint8
  ``(n, C, H, W)`` pixel values for image sets, float32 ``(n, 2)`` for peaks.
* dataset ``y``: int64 (little-endian) labels ``(n,)`` in ``[0, num_classes)``.
* attributes: ``format_version`` (int), ``name`` (str), ``split``
  (``"train"``/``"test"``), ``source`` (str), ``checksum`` (hex SHA-256 of
  the C-order bytes of ``x`` followed by those of ``y``), ``normalization``
  (JSON ``{"mean": [...], "std": [...], "axis", "computed_on": "train"}``,
  train statistics in raw units), ``class_names`` (JSON list),
  ``num_classes`` (int); informational: ``seed``, ``split_rule``,
  ``created_by``.

Writing goes to a temporary file in the destination folder
(``.NAME-SPLIT.*.h5.tmp``) that is renamed with :func:`os.replace` only after
both splits are complete; on any exception (including KeyboardInterrupt) the
temporary files are deleted, so an interrupted run leaves nothing behind.

Reading (:func:`data.h5reader.open_h5_split`) validates the attributes, the checksum
filters, the dataset shapes and the labels (``y`` is read whole, 8 bytes per sample), then
closes the file; the ``x`` rows are read lazily, only the chunks holding requested rows, by
``LazyRows`` through h5py (no MPI-IO -- PyPI's h5py has no parallel HDF5, and each rank
reads only its own rows independently).  The file is
reopened on first access in each process, so an :class:`data.h5reader.H5Split` can be
pickled to worker processes.

Errors: :class:`FileNotFoundError` for a missing file (says how to create it);
:class:`~data.errors.DataFormatError` naming the file and the found/expected
values for a non-HDF5 file, another ``format_version``, missing attributes or
datasets, datasets without the Fletcher-32 filter, inconsistent shapes, labels out of range,
a Fletcher-32 mismatch on any read, or a SHA-256 mismatch (``H5Split.verify_checksum``;
:func:`~data.h5reader.open_h5_pair`, the training path, checks it once per file and process).  Reading lives in :mod:`data.h5reader`; the format
constants and the checksum shared by both in :mod:`data.h5format`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import h5py
import numpy as np

from .datasets import canonical_name, load_raw
from .h5format import FORMAT_VERSION, REQUIRED_ATTRS, checksum, chunk_shape
from .split import Split, check_labels

__all__ = ["FORMAT_VERSION", "REQUIRED_ATTRS", "checksum", "write_split_h5", "prepare"]


def _write_file(path: Path, split: Split, extra: dict) -> None:
    """Write ``split`` (raw inputs, normalization stats) to ``path`` (no atomicity here)."""
    x = np.ascontiguousarray(split.x)
    if x.dtype.byteorder == ">":
        x = x.astype(x.dtype.newbyteorder("<"))
    y = check_labels(split.y, split.num_classes, f"{split.name}/{split.split}").astype("<i8")
    norm = {k: v for k, v in split.normalization.items() if k != "applied"}
    if "mean" not in norm or "std" not in norm:
        raise ValueError(f"{split.name}/{split.split}: split has no normalization statistics to store")
    with h5py.File(path, "w") as f:
        for key, arr in (("x", x), ("y", y)):  # chunked + Fletcher-32: HDF5 verifies every read
            f.create_dataset(key, data=arr, chunks=chunk_shape(arr.shape, arr.itemsize) if len(arr) else None,
                             fletcher32=True)
        a = f.attrs
        a["format_version"] = np.int64(FORMAT_VERSION)
        a["name"] = split.name
        a["split"] = split.split
        a["source"] = split.source
        a["checksum"] = checksum(x, y)
        a["normalization"] = json.dumps(norm)
        a["class_names"] = json.dumps(list(split.class_names))
        a["num_classes"] = np.int64(split.num_classes)
        a["created_by"] = "layerpar data.h5cache"
        for k, v in extra.items():
            a[k] = v


def _atomic_write(items) -> list:
    """Write ``[(split, final_path, extra_attrs), ...]`` via temp files, renamed at the end."""
    temps = []
    try:
        for split, final, extra in items:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{final.stem}.", suffix=".h5.tmp", dir=final.parent)
            os.close(fd)
            temps.append(Path(tmp))
            _write_file(Path(tmp), split, extra)
        umask = os.umask(0)
        os.umask(umask)
        for tmp, (_, final, _) in zip(temps, items):
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a cache is meant to be shared
            os.replace(tmp, final)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    return [final for _, final, _ in items]


def write_split_h5(split: Split, path: str | os.PathLike, **extra_attrs) -> Path:
    """Atomically write one raw :class:`~data.split.Split` (with normalization stats) to ``path``."""
    return _atomic_write([(split, Path(path), extra_attrs)])[0]


def prepare(name: str, out_dir: str | os.PathLike, root: str | os.PathLike | None = None,
            seed: int = 0, test_fraction: float = 0.2) -> tuple[Path, Path]:
    """Load data set ``name`` and write ``out_dir/NAME-train.h5`` and ``out_dir/NAME-test.h5``.

    Args match :func:`data.load_dataset`; ``name`` is one of
    :func:`data.datasets.source_datasets` (``"hdf5"`` is already a cache).  Existing files are
    replaced atomically.  Returns the two paths ``(train_path, test_path)``.
    """
    name = canonical_name(name)
    train, test, rule = load_raw(name, root=root, seed=seed, test_fraction=test_fraction)
    out = Path(out_dir)
    extra = {"seed": np.int64(seed), "split_rule": rule}
    return tuple(_atomic_write([(train, out / f"{name}-train.h5", extra),
                                (test, out / f"{name}-test.h5", extra)]))
