"""The HDF5 cache format shared by the writer (:mod:`data.h5cache`) and the reader
(:mod:`data.h5reader`): version, required attributes, the content checksum, the chunk layout and
the integrity errors.

Integrity is HDF5's own: every dataset is chunked and carries the Fletcher-32 checksum filter
(``fletcher32=True``), which the HDF5 library verifies on every chunk it reads; a mismatch makes
h5py raise :class:`OSError` ("filter returned failure during read"), which the reader turns into a
:class:`~data.errors.DataFormatError` naming the file and the dataset (:func:`read_error`). The
SHA-256 ``checksum`` attribute additionally covers the whole content (``python -m data verify``,
and :func:`data.h5reader.open_h5_pair` once per file and process): Fletcher-32 sums 16-bit words
modulo 65535, so it cannot tell a word 0x0000 from 0xFFFF.

See :mod:`data.h5cache` for the file layout. Kept in its own module so that the writer, the
reader and the data-set registry import one way only (``datasets -> h5reader -> h5format``,
``h5cache -> datasets, h5format``).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np

from .errors import DataFormatError

__all__ = ["FORMAT_VERSION", "REQUIRED_ATTRS", "CHUNK_ROWS", "CHUNK_BYTES", "CACHE_BYTES", "checksum",
           "chunk_shape", "rebuild_hint", "check_checksummed", "read_error", "verified_once"]

#: Version written to (and required in) the ``format_version`` attribute.
FORMAT_VERSION = 1
#: Attributes every cache file must carry.
REQUIRED_ATTRS = ("format_version", "name", "split", "source", "checksum",
                  "normalization", "class_names", "num_classes")
#: Rows hashed (and written) per chunk: bounds the memory of checksumming a large ``x``.
CHUNK_ROWS = 8192
#: Target size of one HDF5 chunk of ``x``/``y`` in bytes (at least one row per chunk): each chunk
#: carries its own Fletcher-32 checksum, and a random batch reads whole chunks, so chunks are small.
CHUNK_BYTES = 16384
#: HDF5 chunk cache per open cache file (``rdcc_nbytes``): decoded, verified chunks stay in memory,
#: so a data set of up to this size is read from disk (and checksummed) once per process.
CACHE_BYTES = 64 << 20


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


def chunk_shape(shape, itemsize: int) -> tuple:
    """HDF5 chunk shape for a dataset of ``shape`` (rows first): whole rows, about
    :data:`CHUNK_BYTES` per chunk, at least one row and at most all of them."""
    row = int(itemsize) * int(np.prod(shape[1:], dtype=np.int64))
    rows = max(1, min(int(shape[0]), CHUNK_BYTES // max(row, 1)))
    return (rows, *(int(d) for d in shape[1:]))


def rebuild_hint(path, name=None) -> str:
    """The command that re-creates the cache ``path`` (``NAME`` when the data set is unknown)."""
    return f"python -m data prepare {name or 'NAME'} --out {Path(path).parent}"


def check_checksummed(path, f, name=None) -> None:
    """Raise :class:`DataFormatError` unless datasets ``x`` and ``y`` of the open file ``f`` are
    chunked with the Fletcher-32 filter (caches written before checksums existed are refused with
    the command that rebuilds them)."""
    plain = [k for k in ("x", "y") if not f[k].fletcher32]
    if plain:
        raise DataFormatError(
            f"{path}: dataset(s) {', '.join(repr(k) for k in plain)} carry no HDF5 Fletcher-32 checksum; "
            f"the cache was written by an older layerpar version and cannot be checked for corruption -- "
            f"rebuild it with `{rebuild_hint(path, name)}`"
        )


def read_error(path, dataset: str, err: OSError, name=None) -> DataFormatError:
    """The :class:`DataFormatError` for an :class:`OSError` raised while HDF5 read ``dataset`` of
    ``path`` (a Fletcher-32 mismatch reads "filter returned failure during read")."""
    what = ("Fletcher-32 checksum mismatch: the file is corrupted"
            if "filter returned failure" in str(err) else "the file is damaged or unreadable")
    return DataFormatError(f"{path}: cannot read HDF5 dataset '{dataset}' ({err}): {what}; "
                           f"rebuild it with `{rebuild_hint(path, name)}`")


#: SHA-256 verdicts of this process: (file identity, stored checksum) of the files verified
_VERIFIED: set = set()
_VERIFIED_LOCK = threading.Lock()


def verified_once(path, stored: str, verify) -> None:
    """Call ``verify()`` (raises on a mismatch) unless this process already verified the file
    ``path`` with the same identity -- resolved path, device, inode, size, modification time
    (ns) -- and stored checksum ``stored``; a rewritten or replaced file is verified again, and
    a failure is never remembered."""
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, stored)
    with _VERIFIED_LOCK:
        if key in _VERIFIED:
            return
    verify()
    with _VERIFIED_LOCK:
        _VERIFIED.add(key)
