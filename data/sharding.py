"""Deterministic, rank-count-independent shuffling and sharding of global batches.

Definition (identical on every rank, for any number of data-parallel ranks):

* Global permutation of epoch ``e``:
  ``perm = np.random.default_rng([seed, e]).permutation(num_samples)`` (int64).
* Global batch ``b``: ``perm[b*B:(b+1)*B]`` with ``B = global_batch_size``; the
  last batch has ``num_samples % B`` samples unless ``drop_last=True`` drops it.
* Rank ``r`` of ``R = num_replicas`` takes the contiguous chunk ``r`` of
  ``np.array_split(batch, R)`` (the first ``len(batch) % R`` chunks are one
  sample longer), in the order of ``perm``.

Hence the concatenation of all ranks' shards of a batch is the global batch,
the union over an epoch is the permutation, and 1 rank and R ranks see the
same global batches (same gradient of the mean loss if shards are weighted by
their size, :meth:`GlobalBatchSampler.weight`).

Every sample is used, for every batch size and replica count: nothing is dropped
unless the user asks for ``drop_last=True``.  A batch with fewer samples than
replicas (the last one, or every one when ``global_batch_size < num_replicas``,
or ``num_replicas > num_samples``) gives the last ranks an **empty** shard, an
int64 array of length 0.  Such a rank still takes part in every collective of
the step; it contributes weight 0 to the gradient average (its gradient is zero
or ``None``; see :mod:`mgrit.parallel.gradbuckets`, whose ``weight=0`` and
``None`` gradients are meant for this), so the averaged gradient equals the
single-replica gradient of the global batch.
"""

from __future__ import annotations

import operator

import numpy as np

__all__ = ["GlobalBatchSampler", "global_permutation", "shard_bounds"]


def _int(name: str, value, minimum: int) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name}={v} must be >= {minimum}")
    return v


def global_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """``np.random.default_rng([seed, epoch]).permutation(num_samples)`` as int64."""
    n = _int("num_samples", num_samples, 1)
    s = _int("seed", seed, 0)
    e = _int("epoch", epoch, 0)
    return np.random.default_rng([s, e]).permutation(n).astype(np.int64, copy=False)


def shard_bounds(batch_len: int, rank: int, num_replicas: int) -> tuple:
    """``(start, stop)`` of chunk ``rank`` of ``np.array_split(range(batch_len), num_replicas)``."""
    q, rem = divmod(batch_len, num_replicas)
    start = rank * q + min(rank, rem)
    return start, start + q + (1 if rank < rem else 0)


class GlobalBatchSampler:
    """Yields this rank's shard of every global batch of an epoch (see module doc).

    Args:
        num_samples: data set size n >= 1.
        global_batch_size: B >= 1, samples per global batch over all ranks (any B: with
            ``B < num_replicas`` some ranks get empty shards, see the module doc).
        seed: non-negative int.
        rank: this rank, ``0 <= rank < num_replicas`` (default 0).
        num_replicas: number of data-parallel ranks R >= 1 (default 1; may exceed n).
        drop_last: drop the final incomplete global batch (default False: every sample is
            used; advice: keep False unless a fixed batch size matters more than the data).

    Raises:
        ValueError: a value below its minimum, invalid ``rank``, or ``drop_last=True`` with
            ``num_samples < global_batch_size`` (no batch at all); each message names the
            values.
        TypeError: a non-integer argument.

    Usage::

        sampler = GlobalBatchSampler(len(train), 256, seed=0, rank=r, num_replicas=R)
        for epoch in range(E):
            sampler.set_epoch(epoch)
            for idx in sampler:          # int64 indices of this rank's shard (may be empty)
                xb, yb = train.get_batch(idx)
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, rank: int = 0,
                 num_replicas: int = 1, drop_last: bool = False):
        n = _int("num_samples", num_samples, 1)
        B = _int("global_batch_size", global_batch_size, 1)
        R = _int("num_replicas", num_replicas, 1)
        self.seed = _int("seed", seed, 0)
        r = operator.index(rank)
        if not 0 <= r < R:
            raise ValueError(f"rank={r} is invalid for num_replicas={R}; allowed 0..{R - 1}")
        if drop_last and n < B:
            raise ValueError(
                f"drop_last=True with num_samples={n} < global_batch_size={B} leaves no batch; "
                f"use drop_last=False or global_batch_size <= {n}"
            )
        self.num_samples, self.global_batch_size = n, B
        self.rank, self.num_replicas, self.drop_last = r, R, bool(drop_last)
        self.epoch = 0

    def __len__(self) -> int:
        """Batches per epoch, identical on every rank."""
        n, B = self.num_samples, self.global_batch_size
        return n // B if self.drop_last else -(-n // B)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (non-negative int) whose permutation ``__iter__`` uses."""
        self.epoch = _int("epoch", epoch, 0)

    def permutation(self, epoch: int | None = None) -> np.ndarray:
        """Global permutation of ``epoch`` (default: current epoch), int64 ``(n,)``."""
        return global_permutation(self.num_samples, self.seed, self.epoch if epoch is None else epoch)

    def global_batches(self, epoch: int | None = None) -> list:
        """All global batches (int64 index arrays) of ``epoch``; identical on every rank."""
        perm = self.permutation(epoch)
        B = self.global_batch_size
        return [perm[i * B:(i + 1) * B] for i in range(len(self))]

    def shard(self, batch: np.ndarray) -> np.ndarray:
        """This rank's contiguous chunk of ``batch`` (``np.array_split`` rule), int64; an
        empty int64 array when ``len(batch) <= rank`` (fewer samples than replicas)."""
        start, stop = shard_bounds(len(batch), self.rank, self.num_replicas)
        return np.asarray(batch, dtype=np.int64)[start:stop]

    def weight(self, batch: np.ndarray) -> float:
        """This rank's share ``len(shard(batch)) / len(batch)`` of the global batch: the
        ``weight`` of ``GradientBuckets.average`` / ``average_gradients`` when every rank
        computes the mean loss over its own shard (0.0 for an empty shard)."""
        start, stop = shard_bounds(len(batch), self.rank, self.num_replicas)
        return (stop - start) / len(batch)

    def __iter__(self):
        for batch in self.global_batches(self.epoch):
            yield self.shard(batch)

    def __repr__(self) -> str:
        return (f"GlobalBatchSampler(num_samples={self.num_samples}, global_batch_size="
                f"{self.global_batch_size}, seed={self.seed}, rank={self.rank}, "
                f"num_replicas={self.num_replicas}, drop_last={self.drop_last}, epoch={self.epoch})")
