"""The HDF5 cache format shared by the writer (:mod:`data.h5cache`) and the reader
(:mod:`data.h5reader`): version, required attributes and the content checksum.

See :mod:`data.h5cache` for the file layout. Kept in its own module so that the writer, the
reader and the data-set registry import one way only (``datasets -> h5reader -> h5format``,
``h5cache -> datasets, h5format``).
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["FORMAT_VERSION", "REQUIRED_ATTRS", "CHUNK_ROWS", "checksum"]

#: Version written to (and required in) the ``format_version`` attribute.
FORMAT_VERSION = 1
#: Attributes every cache file must carry.
REQUIRED_ATTRS = ("format_version", "name", "split", "source", "checksum",
                  "normalization", "class_names", "num_classes")
#: Rows hashed (and written) per chunk: bounds the memory of checksumming a large ``x``.
CHUNK_ROWS = 8192


def checksum(x, y) -> str:
    """Hex SHA-256 of ``x``'s C-order bytes followed by ``y`` as little-endian int64.

    ``x`` is a numpy array or an ``h5py.Dataset`` (read ``CHUNK_ROWS`` rows at a time), ``y``
    an integer array ``(n,)``.
    """
    h = hashlib.sha256()
    for s in range(0, len(x), CHUNK_ROWS):
        h.update(memoryview(np.ascontiguousarray(x[s:s + CHUNK_ROWS])).cast("B"))
    h.update(np.ascontiguousarray(y, dtype="<i8").tobytes())
    return h.hexdigest()
