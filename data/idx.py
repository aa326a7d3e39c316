"""IDX files (MNIST, Fashion-MNIST): reading, writing and the two folder layouts.

Format (http://yann.lecun.com/exdb/mnist/): a 4-byte big-endian magic number
``0x0000TTDD`` -- two zero bytes, a type code ``TT`` (``0x08`` unsigned byte,
``0x09`` signed byte, ``0x0B`` int16, ``0x0C`` int32, ``0x0D`` float32,
``0x0E`` float64) and the number of dimensions ``DD`` -- followed by ``DD``
big-endian uint32 sizes and the row-major data.  MNIST images have magic
``0x00000803`` (ubyte, 3-D ``(n, 28, 28)``), labels ``0x00000801`` (ubyte,
1-D ``(n,)``).  Files may be gzip-compressed; compression is detected from the
gzip magic bytes ``1f 8b``, not from the file name.

Folder layouts accepted by :func:`load_mnist` for ``root``:

* torchvision's download layout ``root/MNIST/raw/<file>`` (Fashion-MNIST:
  ``root/FashionMNIST/raw/<file>``), also ``root/raw/<file>`` when ``root`` is
  the ``MNIST`` folder itself;
* a plain folder ``root/<file>`` with the four files.

``<file>`` is one of ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each raw or with a
``.gz`` suffix (the raw file is preferred when both exist).  The train/test
split is the one shipped (60,000 / 10,000).

Errors: :class:`FileNotFoundError` naming the missing file, the folders searched
and how to obtain it; :class:`~data.errors.DataFormatError` naming the file for
a wrong magic number, a size that does not match the header, a truncated or
corrupt gzip stream, a header that does not fit the file (any malformed header
or size), image/label count mismatch, or labels outside 0..9.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np

from .errors import DataFormatError
from .split import Split, check_labels

__all__ = ["IMAGES_MAGIC", "LABELS_MAGIC", "read_idx", "write_idx", "find_idx_file", "load_mnist"]

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801

_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

_VARIANTS = {
    "mnist": {
        "folder": "MNIST",
        "torchvision": "torchvision.datasets.MNIST(root, download=True)",
        "url": "https://ossci-datasets.s3.amazonaws.com/mnist/ (mirror of http://yann.lecun.com/exdb/mnist/)",
        "class_names": [str(i) for i in range(10)],
    },
    "fashion-mnist": {
        "folder": "FashionMNIST",
        "torchvision": "torchvision.datasets.FashionMNIST(root, download=True)",
        "url": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "class_names": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                        "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"],
    },
}


def _read_file_bytes(path: Path) -> bytes:
    """Whole file content, gunzipped when it starts with the gzip magic ``1f 8b``."""
    with open(path, "rb") as f:
        head = f.read(2)
    if head != b"\x1f\x8b":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataFormatError(
            f"{path}: gzip stream is truncated or corrupt ({e}); delete the file and obtain it again"
        ) from e


def read_idx(path: str | os.PathLike, expected_magic: int | None = None) -> np.ndarray:
    """Read one IDX file (raw or gzip) into a native-endian numpy array.

    Args:
        path: file path.
        expected_magic: if given (e.g. :data:`IMAGES_MAGIC`), the file's magic
            number must equal it.

    Returns:
        array of the header's shape and dtype (``uint8`` for MNIST files).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataFormatError: every malformed file: truncated/corrupt gzip, too short for its
            header, wrong or unknown magic number (type code, zero dimensions), a
            dimension of size 0, or a data size different from the product of the header
            dimensions (computed in Python integers, so huge declared sizes cannot wrap
            around); the message names the file and the found/expected values.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    raw = _read_file_bytes(path)
    if len(raw) < 4:
        raise DataFormatError(f"{path}: {len(raw)} bytes is too short for an IDX header (needs >= 4)")
    magic = int.from_bytes(raw[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise DataFormatError(
            f"{path}: wrong IDX magic number 0x{magic:08X}; expected 0x{expected_magic:08X} "
            f"({'images, ubyte, 3-D' if expected_magic == IMAGES_MAGIC else 'labels, ubyte, 1-D' if expected_magic == LABELS_MAGIC else 'IDX'})"
        )
    code, ndim = raw[2], raw[3]
    if raw[0] != 0 or raw[1] != 0 or code not in _IDX_DTYPES or ndim == 0:
        raise DataFormatError(
            f"{path}: invalid IDX magic number 0x{magic:08X}; expected 0x0000TTDD with type code TT "
            f"in {{{', '.join(f'0x{c:02X}' for c in _IDX_DTYPES)}}} and DD >= 1 dimensions"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataFormatError(
            f"{path}: IDX header declares {ndim} dimensions ({header} header bytes) but the file has {len(raw)} bytes"
        )
    # Python ints throughout: a header may declare sizes whose product overflows any fixed width
    dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    if 0 in dims:
        raise DataFormatError(
            f"{path}: IDX header declares a dimension of size 0 (dims {dims}); every size must be >= 1"
        )
    dtype = _IDX_DTYPES[code]
    expected = math.prod(dims) * dtype.itemsize
    found = len(raw) - header
    if found != expected:
        raise DataFormatError(
            f"{path}: IDX size mismatch: header dims {dims} of {dtype.itemsize}-byte items need "
            f"{expected} data bytes, file has {found}"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str | os.PathLike, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file; gzip-compressed when ``path`` ends in ``.gz``.

    Supported dtypes: uint8, int8, int16, int32, float32, float64.  The file is
    written to ``path + '.tmp'`` and renamed, so no partial file is left behind.
    """
    path = Path(path)
    array = np.asarray(array)
    code = {np.dtype(v).newbyteorder("=") if v.itemsize > 1 else v: k for k, v in _IDX_DTYPES.items()}
    key = array.dtype.newbyteorder("=") if array.dtype.itemsize > 1 else array.dtype
    if key not in code:
        raise ValueError(f"write_idx: dtype {array.dtype} not supported; use one of uint8, int8, int16, int32, float32, float64")
    if array.ndim == 0 or array.ndim > 255:
        raise ValueError(f"write_idx: array must have 1..255 dimensions, got {array.ndim}")
    if array.size == 0:
        raise ValueError(f"write_idx: array of shape {array.shape} is empty; IDX sizes must be >= 1 "
                         f"(read_idx rejects a dimension of size 0)")
    c = code[key]
    body = (bytes([0, 0, c, array.ndim])
            + np.asarray(array.shape, dtype=">u4").tobytes()
            + np.ascontiguousarray(array, dtype=_IDX_DTYPES[c]).tobytes())
    tmp = path.with_name(path.name + ".tmp")
    try:
        if path.name.endswith(".gz"):
            with gzip.open(tmp, "wb") as f:
                f.write(body)
        else:
            tmp.write_bytes(body)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _search_dirs(root: Path, variant: str) -> list:
    folder = _VARIANTS[variant]["folder"]
    return [root / folder / "raw", root / "raw", root]


def find_idx_file(root, variant: str, filename: str) -> Path:
    """Locate ``filename`` (raw preferred, else ``.gz``) for ``variant`` under ``root``.

    Raises:
        FileNotFoundError: naming the file, the folders searched and how to obtain it.
    """
    root = Path(root)
    dirs = _search_dirs(root, variant)
    for d in dirs:
        for name in (filename, filename + ".gz"):
            p = d / name
            if p.is_file():
                return p
    v = _VARIANTS[variant]
    raise FileNotFoundError(
        f"{variant}: file '{filename}' (or '{filename}.gz') not found; searched "
        + ", ".join(str(d) for d in dirs)
        + f". Obtain it from {v['url']} ({filename}.gz), or on a machine with internet run "
        f"{v['torchvision']} and copy the resulting '{v['folder']}' folder into root; root may also be "
        f"a plain folder holding the four IDX files."
    )


def _load_pair(root: Path, variant: str, split: str) -> Split:
    img_name, lab_name = _FILES[split]
    img_path = find_idx_file(root, variant, img_name)
    lab_path = find_idx_file(root, variant, lab_name)
    images = read_idx(img_path, IMAGES_MAGIC)
    labels = read_idx(lab_path, LABELS_MAGIC)
    if images.shape[0] != labels.shape[0]:
        raise DataFormatError(
            f"{img_path} has {images.shape[0]} images but {lab_path} has {labels.shape[0]} labels"
        )
    class_names = _VARIANTS[variant]["class_names"]
    y = check_labels(labels, len(class_names), str(lab_path))
    x = images.reshape(images.shape[0], 1, images.shape[1], images.shape[2])
    return Split(x=x, y=y, num_classes=len(class_names), class_names=list(class_names),
                 name=variant, source=f"IDX {img_path} + {lab_path}", split=split)


def load_mnist(root: str | os.PathLike, variant: str = "mnist") -> tuple[Split, Split]:
    """Load the shipped train/test splits of MNIST or Fashion-MNIST from IDX files.

    Args:
        root: folder in one of the layouts in the module docstring.
        variant: ``"mnist"`` or ``"fashion-mnist"``.

    Returns:
        ``(train, test)`` raw :class:`~data.split.Split` objects: ``x`` uint8
        ``(n, 1, 28, 28)`` pixel values 0..255, ``y`` int64 ``(n,)`` in 0..9.

    Raises:
        ValueError: unknown variant or ``root`` is None.
        FileNotFoundError, DataFormatError: see module docstring.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"unknown IDX variant {variant!r}; allowed: {sorted(_VARIANTS)}")
    if root is None:
        raise ValueError(
            f"{variant} is read from IDX files: pass root=<folder containing "
            f"{_VARIANTS[variant]['folder']}/raw/ or the four IDX files>"
        )
    root = Path(root)
    return _load_pair(root, variant, "train"), _load_pair(root, variant, "test")
