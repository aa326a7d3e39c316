"""layerpar data: real data sets offline and from users' files, HDF5 cache,
rank-sharded deterministic reading.

Public API::

    from data import load_dataset, Split, GlobalBatchSampler, available_datasets
    train, test = load_dataset("mnist5k", root=None, seed=0, test_fraction=0.2,
                               normalize=True, flatten=False)
    sampler = GlobalBatchSampler(len(train), 256, seed=0, rank=r, num_replicas=R)
    sampler.set_epoch(epoch)
    for idx in sampler:
        xb, yb = train.get_batch(idx)

Modules: :mod:`data.datasets` (registry, bundled sets), :mod:`data.split`
(``Split``, normalization, stratified split), :mod:`data.idx` (MNIST IDX),
:mod:`data.cifar` (CIFAR-10 pickles), :mod:`data.peaks` (Peaks problem),
:mod:`data.voxels` (generated 3-D shapes on 15^3 / 31^3 grids),
:mod:`data.h5cache` (HDF5 cache writing), :mod:`data.h5reader` (lazy
reading), :mod:`data.h5format` (format constants and checksum shared by both),
:mod:`data.sharding` (global-batch sampler), :mod:`data.text` (character-level
text corpora for language models: ``load_text("pydoc-topics", context=64)``, the Python
documentation topics shipped with CPython), :mod:`data.errors`,
``python -m data`` (CLI: ``list``, ``prepare``, ``verify``).

Imports run one way (no circle): ``errors`` <- ``split`` <- ``idx``, ``cifar``, ``peaks``, ``voxels``;
``errors`` <- ``h5format`` <- ``h5reader`` <- ``datasets`` <- ``h5cache`` <- ``__main__``; ``split`` <-
``text``; ``sharding`` stands alone.
No torch or mpi4py is imported.

``data.__layerpar_data__`` marks this package as layerpar's: :mod:`mgrit.training` checks it, so
that a user's ``data.py`` (or ``data/`` package) shadowing this one is one clear error naming
the file. ``data.__version__`` is the installed layerpar version.
"""
from importlib import metadata as _metadata

#: Marker checked by :func:`mgrit.training.datapkg.require_data_package`.
__layerpar_data__ = True
try:
    __version__ = _metadata.version("layerpar")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

from .cifar import load_cifar10, read_cifar_batch
from .datasets import available_datasets, dataset_info, load_dataset, load_raw, source_datasets
from .errors import DataFormatError
from .h5cache import prepare, write_split_h5
from .h5format import FORMAT_VERSION
from .h5reader import H5Split, open_h5_pair, open_h5_split
from .idx import load_mnist, read_idx, write_idx
from .peaks import make_peaks
from .sharding import GlobalBatchSampler, global_permutation
from .split import Split
from .text import TEXT_CORPORA, load_text

__all__ = [
    "load_dataset", "load_raw", "available_datasets", "source_datasets", "dataset_info", "Split",
    "GlobalBatchSampler", "global_permutation", "DataFormatError",
    "FORMAT_VERSION", "H5Split", "open_h5_split", "open_h5_pair", "prepare", "write_split_h5",
    "read_idx", "write_idx", "load_mnist", "load_cifar10", "read_cifar_batch", "make_peaks",
    "load_text", "TEXT_CORPORA",
]
