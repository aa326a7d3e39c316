"""Writers of the real on-disk formats, written independently of data/ (struct/pickle/gzip)."""

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def idx_bytes(arr: np.ndarray) -> bytes:
    """IDX ubyte encoding: magic 0x0000 08 <ndim>, big-endian uint32 dims, data."""
    arr = np.asarray(arr, dtype=np.uint8)
    return (struct.pack(">BBBB", 0, 0, 0x08, arr.ndim)
            + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes())


def write_bytes(path: Path, payload: bytes, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)
    return path


def make_mnist_arrays(seed=0, n_train=12, n_test=7, hw=(28, 28)):
    rng = np.random.default_rng(seed)
    return {
        "train_images": rng.integers(0, 256, size=(n_train, *hw), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, size=n_train).astype(np.uint8),
        "test_images": rng.integers(0, 256, size=(n_test, *hw), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, size=n_test).astype(np.uint8),
    }


def write_mnist(folder: Path, arrays: dict, gz: bool) -> dict:
    """Write the four IDX files into ``folder``; returns {key: path}."""
    return {k: write_bytes(folder / MNIST_FILES[k], idx_bytes(arrays[k]), gz) for k in MNIST_FILES}


CIFAR_NAMES = [b"airplane", b"automobile", b"bird", b"cat", b"deer",
               b"dog", b"frog", b"horse", b"ship", b"truck"]


def make_cifar_arrays(seed=0, per_batch=4):
    rng = np.random.default_rng(seed)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batches[name] = (rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8),
                         [int(v) for v in rng.integers(0, 10, size=per_batch)])
    return batches


def write_cifar(folder: Path, batches: dict, drop_key=None, meta=True, protocol=2) -> Path:
    """CIFAR batches pickled by this Python (``protocol`` 2, 4 or 5), or ``protocol="py2"``:
    byte for byte what Python 2's cPickle wrote for the official files (:func:`py2_batch_pickle`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (data, labels) in batches.items():
        d = {b"batch_label": name.encode(), b"labels": labels, b"data": data,
             b"filenames": [f"img{i}.png".encode() for i in range(len(labels))]}
        if drop_key is not None and name == "data_batch_3":
            d.pop(drop_key)
        if protocol == "py2":
            (folder / name).write_bytes(py2_batch_pickle(d))
            continue
        with open(folder / name, "wb") as f:
            pickle.dump(d, f, protocol=protocol)
    if meta:
        with open(folder / "batches.meta", "wb") as f:
            pickle.dump({b"label_names": CIFAR_NAMES, b"num_cases_per_batch": 10000, b"num_vis": 3072}, f, protocol=2)
    return folder


def _py2_str(b: bytes) -> bytes:
    """Python 2 ``str``: SHORT_BINSTRING / BINSTRING (unpickled as bytes with encoding="bytes")."""
    return (b"U" + bytes([len(b)]) + b) if len(b) < 256 else (b"T" + struct.pack("<i", len(b)) + b)


def _py2_int(v: int) -> bytes:
    return b"K" + bytes([v]) if 0 <= v < 256 else b"J" + struct.pack("<i", v)


def _py2_value(v) -> bytes:
    if isinstance(v, bytes):
        return _py2_str(v)
    if isinstance(v, int):
        return _py2_int(v)
    if isinstance(v, list):
        return b"](" + b"".join(_py2_value(e) for e in v) + b"e"  # EMPTY_LIST MARK ... APPENDS
    if isinstance(v, np.ndarray):  # numpy 1.x ndarray.__reduce__ under Python 2 (protocol 2)
        assert v.dtype == np.uint8 and v.ndim == 2
        return (b"cnumpy.core.multiarray\n_reconstruct\n" b"cnumpy\nndarray\n"
                + _py2_int(0) + b"\x85" + _py2_str(b"b") + b"\x87R"           # (ndarray, (0,), 'b')
                + b"(" + _py2_int(1) + _py2_int(v.shape[0]) + _py2_int(v.shape[1]) + b"\x86"
                + b"cnumpy\ndtype\n" + _py2_str(b"u1") + _py2_int(0) + _py2_int(1) + b"\x87R"
                + b"(" + _py2_int(3) + _py2_str(b"|") + b"NNN" + _py2_int(-1) + _py2_int(-1)
                + _py2_int(0) + b"tb"                                          # dtype state
                + b"\x89" + _py2_str(v.tobytes()) + b"tb")                    # array state
    raise TypeError(type(v))


def py2_batch_pickle(d: dict) -> bytes:
    """A CIFAR batch dict as Python 2's ``cPickle.dump(d, f, 2)`` with numpy 1.x wrote it (the
    official ``cifar-10-batches-py`` files): str opcodes for keys, and the globals
    ``numpy.core.multiarray._reconstruct``, ``numpy.ndarray``, ``numpy.dtype``."""
    body = b"".join(_py2_value(k) + _py2_value(v) for k, v in d.items())
    return b"\x80\x02}(" + body + b"u."


def idx_raw(code: int, dims, payload: bytes = b"", magic_prefix: bytes = b"\x00\x00",
            ndim: int | None = None) -> bytes:
    """Raw IDX bytes with any header: ``magic_prefix`` + type ``code`` + ``ndim`` (default
    ``len(dims)``) + big-endian uint32 ``dims`` + ``payload`` (crafted-header tests)."""
    ndim = len(dims) if ndim is None else ndim
    return magic_prefix + bytes([code, ndim]) + struct.pack(f">{len(dims)}I", *dims) + payload
