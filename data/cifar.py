"""CIFAR-10 from the official "python version" pickle batches.

Format (https://www.cs.toronto.edu/~kriz/cifar.html, ``cifar-10-python.tar.gz``):
the folder ``cifar-10-batches-py`` holds ``data_batch_1`` .. ``data_batch_5``
(train, 10,000 images each), ``test_batch`` (10,000) and ``batches.meta``.
Each batch is a pickled dict (protocol 2, written by Python 2's ``cPickle``),
with keys ``b"data"`` -- uint8 ``(10000, 3072)``, each row 1024 red, 1024
green, 1024 blue values of a 32x32 image in row-major order -- and
``b"labels"`` -- 10,000 ints in 0..9.  ``batches.meta`` has
``b"label_names"`` (10 byte strings: airplane, automobile, ...).

``root`` may be the folder containing ``cifar-10-batches-py`` (torchvision's
layout) or that folder itself.  Images are returned as uint8
``(n, 3, 32, 32)`` (a pure reshape of the rows), labels as int64.

Loading never runs code from the file: a plain ``pickle.load`` would call whatever global
a crafted file names (``os.system`` through ``__reduce__``, say), so the batches are read by a
restricted unpickler (:class:`CifarUnpickler`) that resolves only the globals the format
needs -- numpy's array reconstruction (``numpy.core.multiarray._reconstruct`` in the official
Python 2 files, ``numpy._core.multiarray._reconstruct`` from NumPy >= 2, ``_frombuffer`` of
protocol-5 pickles, ``scalar``), ``numpy.ndarray``, ``numpy.dtype``, and ``_codecs.encode``
restricted to latin-1 (Python 3's protocol <= 2 pickles of ``bytes``). Containers (dict, list,
tuple), ints, floats, ``str`` and ``bytes`` need no global. Any other global is a
:class:`~data.errors.DataFormatError` naming the file and the global, raised before anything
from the file is called.

Errors: :class:`FileNotFoundError` naming the missing file(s) and how to obtain
them; :class:`~data.errors.DataFormatError` naming the file for an unreadable
pickle, a forbidden global, a missing key, wrong data shape/dtype or labels outside 0..9.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np

from .errors import DataFormatError
from .split import Split, check_labels

__all__ = ["TRAIN_BATCHES", "TEST_BATCH", "META_FILE", "ALLOWED_GLOBALS", "CifarUnpickler",
           "read_cifar_batch", "load_cifar10"]

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
META_FILE = "batches.meta"
FOLDER = "cifar-10-batches-py"
_ROW = 3 * 32 * 32


def _latin1_encode(obj, encoding="utf-8"):
    """``_codecs.encode`` as protocol <= 2 pickles of ``bytes`` use it (``encode(str,
    'latin1')``); any other codec is refused (a codec lookup may import modules)."""
    if not isinstance(obj, str) or str(encoding).lower().replace("-", "").replace("_", "") not in ("latin1", "iso88591"):
        raise pickle.UnpicklingError(f"_codecs.encode({type(obj).__name__}, {encoding!r}) is not allowed: "
                                     f"only str -> bytes with latin-1 occurs in CIFAR pickles")
    return obj.encode("latin-1")


# the running numpy's own reconstruction functions (found through its reducers, so neither the
# deprecated numpy.core nor a private module path has to be imported)
_RECONSTRUCT = np.zeros(1).__reduce__()[0]
_FROMBUFFER = np.zeros(1).__reduce_ex__(5)[0]
_SCALAR = np.float64(0).__reduce__()[0]

#: ``(module, name)`` -> object: the only globals :class:`CifarUnpickler` resolves.
ALLOWED_GLOBALS = {
    **{(m, "_reconstruct"): _RECONSTRUCT for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "scalar"): _SCALAR for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "_frombuffer"): _FROMBUFFER for m in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


class CifarUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` (``encoding="bytes"``) that resolves only :data:`ALLOWED_GLOBALS`;
    any other global raises before it could be called. Persistent ids are refused too
    (``pickle.Unpickler``'s default)."""

    def __init__(self, file):
        super().__init__(file, encoding="bytes")

    def find_class(self, module, name):
        obj = ALLOWED_GLOBALS.get((module, name))
        if obj is None:
            raise _ForbiddenGlobal(f"{module}.{name}")
        return obj


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = CifarUnpickler(f).load()
    except _ForbiddenGlobal as e:
        raise DataFormatError(
            f"{path}: the pickle references the global '{e}', which a CIFAR batch never needs; "
            f"refusing to load it (a crafted pickle can run code this way). Allowed globals: "
            f"{', '.join(sorted({f'{m}.{n}' for m, n in ALLOWED_GLOBALS}))}"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError,
            ImportError, IndexError, UnicodeDecodeError, MemoryError, OverflowError) as e:
        raise DataFormatError(f"{path}: not a readable CIFAR pickle ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise DataFormatError(f"{path}: CIFAR pickle must contain a dict, found {type(obj).__name__}")
    return obj


def _get(obj: dict, key: bytes, path: Path):
    if key in obj:
        return obj[key]
    skey = key.decode()
    if skey in obj:  # batches re-pickled with str keys
        return obj[skey]
    raise DataFormatError(
        f"{path}: CIFAR pickle is missing required key {key!r}; found keys "
        f"{sorted(repr(k) for k in obj)}"
    )


def read_cifar_batch(path: str | os.PathLike, num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 batch file.

    Returns:
        ``(x, y)``: uint8 ``(n, 3, 32, 32)`` and int64 ``(n,)``.

    Raises:
        FileNotFoundError, DataFormatError (see module docstring).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CIFAR batch file not found: {path}")
    obj = _unpickle(path)
    data, labels = _get(obj, b"data", path), _get(obj, b"labels", path)
    try:
        data, labels = np.asarray(data), np.asarray(labels)
    except (ValueError, TypeError, OverflowError) as e:  # e.g. ragged nested lists
        raise DataFormatError(f"{path}: b'data'/b'labels' are not arrays ({type(e).__name__}: {e})") from e
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _ROW:
        raise DataFormatError(
            f"{path}: b'data' must be uint8 of shape (n, {_ROW}), found {data.dtype} {data.shape}"
        )
    if labels.shape != (data.shape[0],):
        raise DataFormatError(
            f"{path}: b'labels' has shape {labels.shape}, expected ({data.shape[0]},) to match b'data'"
        )
    y = check_labels(labels, num_classes, str(path))
    return data.reshape(-1, 3, 32, 32), y


def _resolve(root: Path) -> Path:
    return root / FOLDER if (root / FOLDER).is_dir() else root


def load_cifar10(root: str | os.PathLike) -> tuple[Split, Split]:
    """Load CIFAR-10's shipped train (50,000) / test (10,000) splits.

    Args:
        root: folder containing ``cifar-10-batches-py`` or that folder itself.

    Returns:
        ``(train, test)`` raw :class:`~data.split.Split` objects, ``x`` uint8
        ``(n, 3, 32, 32)`` pixel values 0..255, ``y`` int64 in 0..9,
        ``class_names`` from ``batches.meta``.
    """
    if root is None:
        raise ValueError(f"cifar10 is read from pickle batches: pass root=<folder containing {FOLDER}/>")
    folder = _resolve(Path(root))
    names = (*TRAIN_BATCHES, TEST_BATCH, META_FILE)
    missing = [folder / n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"cifar10: missing file(s) {', '.join(str(m) for m in missing)}. Download "
            f"cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html and extract it "
            f"into root (creates {FOLDER}/), or on a machine with internet run "
            f"torchvision.datasets.CIFAR10(root, download=True) and copy the folder."
        )
    meta_path = folder / META_FILE
    meta = _unpickle(meta_path)
    raw_names = _get(meta, b"label_names", meta_path)
    if not isinstance(raw_names, (list, tuple)) or not all(isinstance(n, (bytes, str)) for n in raw_names):
        raise DataFormatError(f"{meta_path}: b'label_names' must be a list of byte strings, found "
                              f"{type(raw_names).__name__}")
    class_names = [n.decode() if isinstance(n, bytes) else str(n) for n in raw_names]
    if len(class_names) < 2:
        raise DataFormatError(f"{meta_path}: b'label_names' has {len(class_names)} entries, expected 10")
    k = len(class_names)
    parts = [read_cifar_batch(folder / n, k) for n in TRAIN_BATCHES]
    xtr = np.concatenate([p[0] for p in parts])
    ytr = np.concatenate([p[1] for p in parts])
    xte, yte = read_cifar_batch(folder / TEST_BATCH, k)
    src = f"CIFAR-10 python batches in {folder}"
    train = Split(x=xtr, y=ytr, num_classes=k, class_names=class_names, name="cifar10", source=src, split="train")
    test = Split(x=xte, y=yte, num_classes=k, class_names=class_names, name="cifar10", source=src, split="test")
    return train, test
