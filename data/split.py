"""In-memory data split, per-channel normalization and seeded stratified splits.

A :class:`Split` holds one split (train or test) of a data set:

* ``x`` -- images ``(n, C, H, W)`` or tabular inputs ``(n, d)``.  Raw splits keep
  the source dtype (``uint8`` pixel values for image sets, ``float32`` for
  ``peaks``); normalized splits are ``float32``.  With ``flatten=True`` in
  :func:`data.load_dataset` images become ``(n, C*H*W)`` (C-order).
* ``y`` -- ``int64`` labels ``(n,)`` in ``[0, num_classes)``.

Normalization (per data set, computed on the *train* split only, in the raw
units of the source, e.g. pixel values 0..255 for MNIST, 0..16 for digits):
``mean[c]`` and ``std[c]`` per channel ``c`` (axes ``(0, 2, 3)`` for images) or
per feature (axis 0 for tabular sets; axes ``(0, 2, 3, 4)`` for voxels ``(n, C, D, H, W)``); population std (``ddof=0``); a channel
with zero std uses std 1.  The normalized input is
``((x - mean[c]) / std[c]).astype(float32)``.  The same train statistics are
applied to the test split.  ``Split.normalization`` is the dict
``{"mean": [...], "std": [...], "axis": "channel"|"feature",
"computed_on": "train", "applied": bool}``.

Stratified splits for sets that ship no split use scikit-learn's
``train_test_split(np.arange(n), test_size=test_fraction, stratify=y,
random_state=seed)``; the returned (shuffled) index order is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from .errors import DataFormatError

__all__ = [
    "Split",
    "check_labels",
    "compute_normalization",
    "apply_normalization",
    "stratified_split",
]


@dataclass
class Split:
    """One split of a data set held in memory.

    Attributes:
        x: inputs, ``(n, C, H, W)`` images, ``(n, d)`` tabular or flattened
            images; raw source dtype or normalized ``float32`` (see module doc).
        y: ``int64`` labels ``(n,)``.
        num_classes: number of classes; labels lie in ``[0, num_classes)``.
        class_names: ``num_classes`` human-readable names.
        name: data set name (registry key, e.g. ``"mnist5k"``).
        normalization: mean/std dict (see module doc), ``{}`` if unknown.
        source: where the data came from (file paths or library function).
        split: ``"train"`` or ``"test"``.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    class_names: list
    name: str
    normalization: dict = field(default_factory=dict)
    source: str = ""
    split: str = "train"

    def __post_init__(self):
        if len(self.x) != len(self.y):
            raise ValueError(
                f"{self.name}/{self.split}: x has {len(self.x)} samples but y has {len(self.y)}"
            )
        if len(self.class_names) != self.num_classes:
            raise ValueError(
                f"{self.name}: {len(self.class_names)} class names for num_classes={self.num_classes}"
            )

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple:
        """Shape of one sample, e.g. ``(1, 28, 28)``, ``(2,)`` or ``(784,)`` when flattened."""
        return tuple(self.x.shape[1:])

    def get_batch(self, idx: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(x[idx], y[idx])`` for an index array ``idx`` (any order, duplicates allowed)."""
        idx = np.asarray(idx)
        return self.x[idx], self.y[idx]

    def with_x(self, x: np.ndarray, normalization: dict | None = None) -> "Split":
        """Copy of this split with new inputs (and optionally a new normalization dict)."""
        return replace(self, x=x, normalization=dict(normalization or self.normalization))


def check_labels(y: np.ndarray, num_classes: int, where: str) -> np.ndarray:
    """Return ``y`` as ``int64`` after checking ``0 <= y < num_classes``.

    Raises:
        DataFormatError: naming ``where`` (a file or data set), the first
            offending label, its index and the allowed range.
    """
    y = np.asarray(y)
    if y.ndim != 1:
        raise DataFormatError(f"{where}: labels must be 1-D, got shape {y.shape}")
    if y.dtype.kind not in "iu":
        raise DataFormatError(f"{where}: labels must be integers, got dtype {y.dtype}")
    bad = np.flatnonzero((y < 0) | (y >= num_classes))
    if bad.size:
        i = int(bad[0])
        raise DataFormatError(
            f"{where}: label {int(y[i])} at index {i} is out of range; "
            f"allowed labels are 0..{num_classes - 1} (num_classes={num_classes}); "
            f"{bad.size} label(s) out of range"
        )
    return y.astype(np.int64, copy=False)


def _stat_axes(x: np.ndarray) -> tuple:
    if x.ndim in (4, 5):  # images (n, C, H, W), voxels (n, C, D, H, W)
        return (0, *range(2, x.ndim))
    if x.ndim == 2:
        return (0,)
    raise ValueError(f"normalization expects (n, C, H, W), (n, C, D, H, W) or (n, d) inputs, "
                     f"got shape {x.shape}")


def compute_normalization(x: np.ndarray, chunk: int = 4096) -> dict:
    """Per-channel (images) or per-feature (tabular) mean and population std of ``x``.

    Computed in float64 in two chunked passes (no full float64 copy of ``x``).
    A zero std is replaced by 1.  Returns ``{"mean", "std", "axis",
    "computed_on": "train", "applied": False}`` with Python float lists.
    """
    axes = _stat_axes(x)
    n = x.shape[0]
    if n == 0:
        raise ValueError("cannot compute normalization of an empty split")
    count = n * int(np.prod([x.shape[a] for a in axes[1:]], dtype=np.int64))
    total = 0.0
    for s in range(0, n, chunk):
        total = total + x[s:s + chunk].sum(axis=axes, dtype=np.float64)
    mean = total / count
    shape = (1, -1) + (1,) * (x.ndim - 2)
    sq = 0.0
    for s in range(0, n, chunk):
        d = x[s:s + chunk].astype(np.float64) - mean.reshape(shape)
        sq = sq + (d * d).sum(axis=axes)
    std = np.sqrt(sq / count)
    std = np.where(std > 0, std, 1.0)
    return {
        "mean": [float(v) for v in np.atleast_1d(mean)],
        "std": [float(v) for v in np.atleast_1d(std)],
        "axis": "channel" if x.ndim in (4, 5) else "feature",
        "computed_on": "train",
        "applied": False,
    }


def apply_normalization(x: np.ndarray, normalization: dict) -> np.ndarray:
    """Return ``((x - mean[c]) / std[c]).astype(float32)`` for raw ``x`` of shape (n, C, ...) or (n, d)."""
    mean = np.asarray(normalization["mean"], dtype=np.float64)
    std = np.asarray(normalization["std"], dtype=np.float64)
    if x.ndim < 2 or x.shape[1] != mean.size or std.size != mean.size:
        raise ValueError(
            f"normalization has {mean.size} channel(s) but inputs have shape {x.shape}"
        )
    shape = (1, -1) + (1,) * (x.ndim - 2)
    out = x.astype(np.float32)
    out -= mean.reshape(shape).astype(np.float32)
    out /= std.reshape(shape).astype(np.float32)
    return out


def stratified_split(y: np.ndarray, test_fraction: float, seed: int):
    """Seeded stratified ``(train_idx, test_idx)`` via scikit-learn's ``train_test_split``.

    Args:
        y: ``(n,)`` integer labels.
        test_fraction: fraction of samples in the test split, ``0 < f < 1``.
        seed: non-negative int passed as ``random_state``.

    Raises:
        ValueError: ``test_fraction`` outside ``(0, 1)`` or too few samples per class.
    """
    if not (isinstance(test_fraction, (float, int)) and 0.0 < float(test_fraction) < 1.0):
        raise ValueError(f"test_fraction={test_fraction!r} must be a number with 0 < test_fraction < 1")
    # lazy: scikit-learn is heavy (~2 s to import) and only the unsplit bundled sets need it
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(y))
    try:
        tr, te = train_test_split(idx, test_size=float(test_fraction), stratify=y, random_state=seed)
    except ValueError as e:
        raise ValueError(f"cannot make a stratified split with test_fraction={test_fraction}: {e}") from e
    return tr.astype(np.int64), te.astype(np.int64)
