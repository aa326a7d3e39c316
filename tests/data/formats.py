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


def write_cifar(folder: Path, batches: dict, drop_key=None, meta=True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, (data, labels) in batches.items():
        d = {b"batch_label": name.encode(), b"labels": labels, b"data": data,
             b"filenames": [f"img{i}.png".encode() for i in range(len(labels))]}
        if drop_key is not None and name == "data_batch_3":
            d.pop(drop_key)
        with open(folder / name, "wb") as f:
            pickle.dump(d, f, protocol=2)
    if meta:
        with open(folder / "batches.meta", "wb") as f:
            pickle.dump({b"label_names": CIFAR_NAMES, b"num_cases_per_batch": 10000, b"num_vis": 3072}, f, protocol=2)
    return folder
