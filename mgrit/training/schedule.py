"""Data as the training loop sees it: tensors, the global-batch schedule of an epoch with this
replica's shard of every batch, and a fingerprint of the training data for checkpoints.

The schedule is :mod:`data.sharding`'s (permutation ``default_rng([seed, epoch])``, consecutive
global batches of ``B`` samples, replica ``r`` takes chunk ``r`` of ``np.array_split``), with
one difference: **no batch is dropped and no shard is refused**. A replica whose shard of a
(last, small) batch is empty gets weight 0 for that step (see :class:`~mgrit.training.Trainer`),
so every sample is used for every batch size and replica count.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

from data.sharding import global_permutation, shard_bounds

__all__ = ["as_tensors", "epoch_batches", "batches_per_epoch", "fingerprint"]


def as_tensors(data, dtype: torch.dtype, what: str = "train") -> tuple:
    """``(x, y)`` as CPU tensors (``x`` in ``dtype``, ``y`` as given, e.g. int64 labels) from a
    ``data`` object with ``.x``/``.y`` (a :class:`data.Split`) or a pair ``(x, y)`` of arrays
    or tensors.

    Raises:
        TypeError: anything else. ValueError: ``x`` and ``y`` of different lengths or empty.
    """
    if hasattr(data, "x") and hasattr(data, "y"):
        x, y = data.x, data.y
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = data
    else:
        raise TypeError(f"{what} must be a data.Split (with .x and .y) or a pair (x, y), got "
                        f"{type(data).__name__}")
    x = x if torch.is_tensor(x) else torch.as_tensor(np.asarray(x))
    y = y if torch.is_tensor(y) else torch.as_tensor(np.asarray(y))
    if x.is_floating_point() and x.dtype != dtype:
        x = x.to(dtype)
    if len(x) != len(y) or len(y) == 0:
        raise ValueError(f"{what}: x has {len(x)} samples and y {len(y)}: use equal, non-zero "
                         f"lengths")
    return x, y


def batches_per_epoch(n: int, batch_size: int) -> int:
    """Global batches per epoch (the last one may be smaller)."""
    return -(-n // batch_size)


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int, rank: int,
                  replicas: int) -> list:
    """``[(shard, global batch length)]`` of ``epoch``: this replica's int64 indices of every
    global batch (possibly empty) and the batch's size."""
    perm = global_permutation(n, seed, epoch)
    out = []
    for start in range(0, n, batch_size):
        batch = perm[start:start + batch_size]
        a, b = shard_bounds(len(batch), rank, replicas)
        out.append((batch[a:b], len(batch)))
    return out


def fingerprint(x: torch.Tensor, y: torch.Tensor) -> str:
    """``"N samples of shape S, checksum C"``: identifies the training data in checkpoints
    (CRC-32 of the labels and of the inputs as float64, so the same data in float32 or float64
    match; any change of samples, order or labels shows)."""
    crc = zlib.crc32(np.ascontiguousarray(y.cpu().numpy()).tobytes())
    for start in range(0, len(x), 4096):  # chunks: no float64 copy of the whole set
        chunk = x[start:start + 4096].cpu().to(torch.float64) if x.is_floating_point() \
            else x[start:start + 4096].cpu()
        crc = zlib.crc32(np.ascontiguousarray(chunk.numpy()).tobytes(), crc)
    return f"{len(y)} samples of shape {tuple(x.shape[1:])}, checksum {crc:08x}"
