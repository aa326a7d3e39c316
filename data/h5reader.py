"""Lazy, validated reading of the HDF5 cache files written by :mod:`data.h5cache`.

:func:`open_h5_split` checks, naming the file and the found/expected values
(:class:`~data.errors.DataFormatError`): that it is an HDF5 file, its
``format_version`` equals :data:`data.h5format.FORMAT_VERSION`, all
:data:`data.h5format.REQUIRED_ATTRS` and the datasets ``x``/``y`` exist with
consistent shapes and carry HDF5's Fletcher-32 checksum filter (a cache written
before checksums is refused with the command that rebuilds it),
``class_names``/``normalization`` match ``num_classes`` and the channels, and
every label lies in ``[0, num_classes)`` (``y`` is read whole, 8 bytes per
sample).  It then closes the file (:func:`open_h5_pair`, the training path, first compares the
SHA-256 of the content with the stored ``checksum``, once per file and process); rows of ``x`` are read on demand by
:class:`LazyRows` (whole chunks through h5py, so HDF5 verifies each chunk's
checksum; a mismatch is a :class:`~data.errors.DataFormatError` naming the file
and dataset; the file is reopened once per process, so an :class:`H5Split` can
be pickled to worker processes).  A missing file raises
:class:`FileNotFoundError` saying how to create it.  No MPI-IO: each rank reads
its own rows independently.
"""

from __future__ import annotations

import json
import operator
import os
from pathlib import Path

import h5py
import numpy as np
import numpy.typing as npt

from .errors import DataFormatError
from .h5format import (CACHE_BYTES, FORMAT_VERSION, REQUIRED_ATTRS, check_checksummed, checksum, read_error,
                       rebuild_hint, verified_once)
from .split import Split, apply_normalization, check_labels

__all__ = ["LazyRows", "H5Split", "open_h5_split", "open_h5_pair"]


def _attr_str(attrs, key):
    v = attrs[key]
    return v.decode() if isinstance(v, bytes) else str(v)


class LazyRows:
    """Array-like view of dataset ``x`` of an :class:`H5Split` that reads rows on demand.

    ``rows[i]`` (int), ``rows[a:b]`` (slice) and ``rows[idx]`` (int array in any
    order, duplicates and negatives allowed, or a boolean mask of length n)
    read only the requested rows: indices are sorted and de-duplicated for
    h5py (a dense index range is read as one slice), then put back in the
    requested order.  With ``reader="auto"`` (default) whole HDF5 chunks holding
    requested rows are read (runs of neighbouring chunks as one slice): HDF5
    verifies each chunk's Fletcher-32 checksum, and verified chunks stay in the
    file's chunk cache (:data:`data.h5format.CACHE_BYTES`), so a random batch of
    B rows costs at most B small chunk reads; ``reader="h5py"`` passes the
    row selection to h5py in one call (fewer bytes, slower for scattered rows).
    The result is a new array, never a view of the file; it is normalized
    float32 when the split was opened with ``normalize=True`` and
    ``(m, C*H*W)`` when ``flatten=True``.  A checksum mismatch or unreadable
    chunk raises :class:`~data.errors.DataFormatError` naming the file.
    """

    def __init__(self, owner: "H5Split"):
        self._owner = owner

    @property
    def shape(self) -> tuple:
        n, *rest = self._owner._stored_shape
        return (n, int(np.prod(rest))) if self._owner.flatten else (n, *rest)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32) if self._owner.normalize else self._owner._stored_dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def _finish(self, rows: np.ndarray) -> np.ndarray:
        o = self._owner
        if o.normalize:
            rows = apply_normalization(rows, o.normalization)
        if o.flatten:
            rows = rows.reshape(rows.shape[0], -1)
        return rows

    def __getitem__(self, key):
        n = self.shape[0]
        o = self._owner
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self._finish(o._read(slice(start, max(start, stop))))
            key = np.arange(start, stop, step)
        elif not isinstance(key, (np.ndarray, list, tuple)):
            try:
                i = operator.index(key)
            except TypeError:
                raise TypeError(f"index must be an int, slice or integer/boolean array, got {key!r}") from None
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of range for {n} rows of {o.path}")
            i %= n
            return self._finish(o._read(slice(i, i + 1)))[0]
        idx = np.asarray(key)
        if idx.dtype == bool:
            if idx.shape != (n,):
                raise IndexError(f"boolean index has shape {idx.shape}, expected ({n},)")
            idx = np.flatnonzero(idx)
        if idx.dtype.kind not in "iu" and idx.size:
            raise IndexError(f"index array must be integer or boolean, got dtype {idx.dtype}")
        idx = idx.astype(np.int64).reshape(-1)
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            raise IndexError(f"index {int(idx[bad][0])} is out of range for {n} rows of {o.path}")
        idx = np.where(idx < 0, idx + n, idx)
        if idx.size == 0:
            return self._finish(np.empty((0, *o._stored_shape[1:]), o._stored_dtype))
        uniq, inverse = np.unique(idx, return_inverse=True)
        lo, hi = int(uniq[0]), int(uniq[-1]) + 1
        if hi - lo <= 2 * uniq.size:
            rows = o._read(slice(lo, hi))[uniq - lo]
        elif o.reader == "h5py":
            rows = o._read(uniq)
        else:  # one read per run of neighbouring chunks holding requested rows
            c = o._chunk_rows
            cid = uniq // c
            starts = np.flatnonzero(np.r_[True, np.diff(cid) > 1])
            rows = np.empty((uniq.size, *o._stored_shape[1:]), o._stored_dtype)
            for a, b in zip(starts.tolist(), np.r_[starts[1:], uniq.size].tolist()):
                first = int(cid[a]) * c
                rows[a:b] = o._read(slice(first, min(n, (int(cid[b - 1]) + 1) * c)))[uniq[a:b] - first]
        return self._finish(rows[inverse])


class H5Split:
    """A split stored in an HDF5 cache file; same attributes as :class:`~data.split.Split`.

    ``x`` is a :class:`LazyRows` (reads on demand), ``y`` an in-memory int64
    array.  Use :func:`open_h5_split` to construct.  Also a context manager;
    :meth:`close` closes this process's file handle.
    """

    def __init__(self, path: str | os.PathLike, normalize: bool = True, flatten: bool = False, reader: str = "auto"):
        if reader == "memmap":
            raise ValueError("reader='memmap' is no longer offered: cache datasets are chunked with HDF5 "
                             "Fletcher-32 checksums, which a memmap would bypass; use 'auto' or 'h5py'")
        if reader not in ("auto", "h5py"):
            raise ValueError(f"reader={reader!r}; allowed: 'auto', 'h5py'")
        self.path = Path(path)
        self.normalize = bool(normalize)
        self.flatten = bool(flatten)
        self.reader = reader
        self._file = None
        self._x = None
        self._pid = None
        self._validate()
        self.x = LazyRows(self)

    def _validate(self) -> None:
        p = self.path
        if not p.is_file():
            raise FileNotFoundError(
                f"HDF5 cache file not found: {p}; create it with `python -m data prepare NAME --out {p.parent}`"
            )
        try:
            f = h5py.File(p, "r")
        except OSError as e:
            raise DataFormatError(f"{p}: not a readable HDF5 file ({e})") from e
        with f:
            a = f.attrs
            if "format_version" not in a:
                raise DataFormatError(
                    f"{p}: missing required HDF5 attribute 'format_version' (expected {FORMAT_VERSION}); "
                    f"not a layerpar data cache -- re-create it with `python -m data prepare`"
                )
            try:
                version = int(a["format_version"])
            except (TypeError, ValueError):
                version = a["format_version"]
            if version != FORMAT_VERSION:
                raise DataFormatError(
                    f"{p}: HDF5 cache has format_version={version!r}, expected {FORMAT_VERSION}; "
                    f"re-create it with `python -m data prepare`"
                )
            missing = [k for k in REQUIRED_ATTRS if k not in a]
            if missing:
                raise DataFormatError(
                    f"{p}: missing required HDF5 attribute(s) {', '.join(repr(m) for m in missing)} "
                    f"(format_version {FORMAT_VERSION} requires {', '.join(REQUIRED_ATTRS)})"
                )
            for key in ("x", "y"):
                if key not in f or not isinstance(f[key], h5py.Dataset):
                    raise DataFormatError(f"{p}: missing required HDF5 dataset '{key}' (needs 'x' and 'y')")
            self.name = _attr_str(a, "name")
            check_checksummed(p, f, self.name)
            self.split = _attr_str(a, "split")
            self.source = _attr_str(a, "source")
            self.checksum = _attr_str(a, "checksum")
            try:
                self.num_classes = int(a["num_classes"])
                self.class_names = list(json.loads(_attr_str(a, "class_names")))
                norm = dict(json.loads(_attr_str(a, "normalization")))
                mean, std = list(norm["mean"]), list(norm["std"])
            except (TypeError, ValueError, KeyError) as e:
                raise DataFormatError(
                    f"{p}: malformed attribute num_classes/class_names/normalization ({type(e).__name__}: {e}); "
                    f"expected an int and JSON values"
                ) from e
            if len(self.class_names) != self.num_classes:
                raise DataFormatError(
                    f"{p}: class_names has {len(self.class_names)} entries but num_classes={self.num_classes}"
                )
            x, y = f["x"], f["y"]
            if x.ndim not in (2, 4) or y.ndim != 1 or x.shape[0] != y.shape[0]:
                raise DataFormatError(
                    f"{p}: dataset shapes x{x.shape}, y{y.shape} invalid; expected x (n, C, H, W) or (n, d) "
                    f"and y (n,)"
                )
            if len(mean) != x.shape[1] or len(std) != x.shape[1]:
                raise DataFormatError(
                    f"{p}: normalization has {len(mean)} mean / {len(std)} std values but x has "
                    f"{x.shape[1]} channels/features"
                )
            self._stored_shape = tuple(x.shape)
            self._stored_dtype = x.dtype
            self._chunk_rows = int(x.chunks[0]) if x.chunks and x.chunks[0] else 1
            try:
                labels = y[()]
            except OSError as e:
                raise read_error(p, "y", e, self.name) from e
            self.y = check_labels(labels, self.num_classes, str(p))
            self.attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in a.items()}
        self.normalization = {**norm, "applied": self.normalize}

    def _dataset(self):
        if self._file is None or self._pid != os.getpid():
            # a large chunk cache (per open dataset, so ``x`` is opened once): verified chunks are
            # read (and checksummed) once per process
            self._file = h5py.File(self.path, "r", rdcc_nbytes=CACHE_BYTES, rdcc_nslots=100003)
            self._x = self._file["x"]
            self._pid = os.getpid()
        return self._x

    def _read(self, key):
        """``x[key]`` through h5py (HDF5 verifies the chunks' Fletcher-32 checksums)."""
        try:
            return self._dataset()[key]
        except OSError as e:
            raise read_error(self.path, "x", e, self.name) from e

    def close(self) -> None:
        """Close the file handle of this process (reopened on the next read)."""
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
        self._file = None
        self._x = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_file"], state["_x"], state["_pid"] = None, None, None
        return state

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple:
        """Shape of one sample as returned by ``x[i]``."""
        return tuple(self.x.shape[1:])

    def get_batch(self, idx: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """``(x[idx], y[idx])`` reading only the requested rows."""
        idx = np.asarray(idx)
        return self.x[idx], self.y[idx]

    def load(self) -> Split:
        """Read everything into an in-memory :class:`~data.split.Split` (same normalize/flatten)."""
        return Split(x=self.x[:], y=self.y.copy(), num_classes=self.num_classes,
                     class_names=list(self.class_names), name=self.name,
                     normalization=dict(self.normalization), source=f"{self.path} ({self.source})",
                     split=self.split)

    def verify_checksum(self) -> str:
        """Read all of ``x``/``y`` (HDF5 verifies every chunk's Fletcher-32 checksum), recompute
        their SHA-256 and compare it with the ``checksum`` attribute; returns the SHA-256.

        Raises:
            DataFormatError: naming the file and both checksums on mismatch, or the file and
                dataset when a chunk fails its Fletcher-32 check.
        """
        try:  # ``y`` was read (and Fletcher-32 verified) whole when the file was opened
            found = checksum(self._dataset(), self.y)
        except OSError as e:
            raise read_error(self.path, "x", e, self.name) from e
        if found != self.checksum:
            raise DataFormatError(f"{self.path}: checksum mismatch (SHA-256): computed {found}, attribute "
                                  f"says {self.checksum}: the file is corrupted; rebuild it with "
                                  f"`{rebuild_hint(self.path, self.name)}`")
        return found

    def __repr__(self) -> str:
        return (f"H5Split(path={str(self.path)!r}, name={self.name!r}, split={self.split!r}, n={len(self)}, "
                f"input_shape={self.input_shape}, normalize={self.normalize}, flatten={self.flatten})")


def _verify_once(s: H5Split) -> None:
    """``s.verify_checksum()`` unless this process verified the same file already."""
    verified_once(s.path, s.checksum, s.verify_checksum)


def open_h5_split(path: str | os.PathLike, normalize: bool = True, flatten: bool = False,
                  verify: bool | str = False, reader: str = "auto") -> H5Split:
    """Open and validate one cache file.

    Args:
        path: ``NAME-SPLIT.h5`` written by ``prepare``.
        normalize: ``x`` reads return float32 normalized with the stored train
            mean/std (default True) or the raw stored dtype (False).
        flatten: ``x`` reads return ``(m, C*H*W)`` (default False).
        verify: ``True``: also read all of ``x`` (Fletcher-32 verified per chunk) and compare
            its SHA-256 with the ``checksum`` attribute; ``"once"``: the same, unless this
            process already verified this file (same path, device, inode, size and mtime);
            ``False`` (default): only the chunks that are read are checked (Fletcher-32, which
            cannot tell 16-bit words 0x0000 from 0xFFFF).
        reader: ``"auto"`` (whole chunks, cached) or ``"h5py"`` (row selections); see
            :class:`LazyRows`.

    Returns:
        :class:`H5Split` with lazy ``x`` and in-memory ``y``.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message says how to create it).
        DataFormatError: not a valid cache, a cache without checksums (older version; the
            message gives the command that rebuilds it), or corrupted content, naming the file.
        ValueError: unknown ``reader``.
    """
    if verify not in (True, False, "once"):
        raise ValueError(f"verify={verify!r}; allowed: True, False, 'once'")
    s = H5Split(path, normalize=normalize, flatten=flatten, reader=reader)
    if verify == "once":
        _verify_once(s)
    elif verify:
        s.verify_checksum()
    return s


def open_h5_pair(root: str | os.PathLike, normalize: bool = True, flatten: bool = False,
                 reader: str = "auto", verify: bool | str = "once") -> tuple[H5Split, H5Split]:
    """Open ``(train, test)`` cache files.

    ``root`` is either a folder holding exactly one ``NAME-train.h5`` /
    ``NAME-test.h5`` pair, or the path of either file of a pair (the other
    is found next to it), or the prefix ``DIR/NAME``. ``verify`` as in :func:`open_h5_split`;
    the default ``"once"`` compares each file's SHA-256 with its ``checksum`` attribute the
    first time this process opens it (one full read; what training loads), so a corruption
    that Fletcher-32 misses is an error naming the file too.

    Raises:
        ValueError: ``root`` is None, or a folder with zero or several pairs.
        FileNotFoundError, DataFormatError: see module docstring.
    """
    if root is None:
        raise ValueError("hdf5: pass root=<folder with NAME-train.h5/NAME-test.h5, or one of the files>")
    root = Path(root)
    if root.is_dir():
        trains = sorted(root.glob("*-train.h5"))
        if len(trains) != 1:
            raise ValueError(
                f"hdf5: folder {root} holds {len(trains)} '*-train.h5' files "
                f"({', '.join(t.name for t in trains) or 'none'}); expected exactly one -- pass the file path instead"
            )
        prefix = str(trains[0])[: -len("-train.h5")]
    else:
        s = str(root)
        for suffix in ("-train.h5", "-test.h5"):
            if s.endswith(suffix):
                s = s[: -len(suffix)]
                break
        prefix = s
    return (open_h5_split(prefix + "-train.h5", normalize, flatten, verify=verify, reader=reader),
            open_h5_split(prefix + "-test.h5", normalize, flatten, verify=verify, reader=reader))
