"""Persistent flat gradient buffers for data-parallel training (:class:`GradientBuckets`,
re-exported by :mod:`mgrit.parallel.dataparallel`, whose module doc describes the bucketing, the
has-gradient flags and the device paths)."""
from __future__ import annotations

import time
from typing import Iterable

import torch
from mpi4py import MPI

from ._flatbuffers import (DEFAULT_BUCKET_BYTES, _buckets, _check_bucket_bytes, _check_comm,
                           _check_params, _reduce_bucket, _weight_error)
from ..comm import raise_agreed

__all__ = ["GradientBuckets"]


class GradientBuckets:
    """Persistent flat gradient buffers; after :meth:`average` the parameters' ``.grad`` are
    views of them.

    At construction the parameters are grouped into buckets exactly as
    :func:`average_gradients` does (by dtype and device, at most ``bucket_bytes`` each, same
    order on every replica) and one flat buffer is allocated per bucket, once. Each
    :meth:`average` is one in-place ``Allreduce`` per bucket; compared with
    :func:`average_gradients` it saves the buffer allocation and the unpack copy (the reduced
    buffer slices simply become the ``.grad`` tensors). Results equal
    :func:`average_gradients` bit for bit.

    Two ways to clear gradients (:meth:`zero_grad`):

    * ``set_to_none=True`` (default, like ``optimizer.zero_grad()``): backward allocates fresh
      gradients and :meth:`average` copies them into the buffers (one pack copy). A parameter
      whose ``.grad`` is ``None`` on every replica keeps ``None`` (the optimizer skips it).
    * ``set_to_none=False`` (PyTorch DDP's ``gradient_as_bucket_view``): the buffers are zeroed
      and the views stay the ``.grad`` tensors, so backward accumulates straight into the
      buffers and :meth:`average` copies nothing; every parameter then has a gradient (zeros if
      unused), so momentum or weight decay also move unused parameters. Zeroing plus in-place
      accumulation moves about as many bytes as the pack copy: on CPU it measured no faster
      (``experiments/bench_dataparallel.py``); it saves memory (no second gradient copy).

    Use::

        buckets = GradientBuckets(model.parameters(), grid.data_comm)
        for x, y in shards:
            buckets.zero_grad()
            loss_fn(model(x), y).backward()
            buckets.average()              # mean over the replicas, one call per bucket
            optimizer.step()

    Args:
        parameters: the replica's parameters, same order, shapes and dtypes on every rank of
            ``comm`` (check once with :func:`check_replicas_consistent`); ``requires_grad=False``
            ones are skipped. Existing ``.grad`` values are copied into the buffers.
        comm: the data-parallel communicator (``ProcessGrid.data_comm``).
        bucket_bytes: maximum bytes of gradient data per buffer (default 25 MiB), > 0.

    Raises:
        ValueError: at construction for a non-positive ``bucket_bytes``, an unsupported dtype or
            a sparse gradient (no communication happens in the constructor); in :meth:`average`
            (on every rank, before any gradient is communicated) if a parameter changed dtype,
            device or shape since construction (``.to()``, ``.double()``: build a new
            ``GradientBuckets``) or ``weight`` is not a finite real number.
        TypeError: ``parameters`` a single tensor or module, or ``comm`` not a communicator.
        Duplicated parameters (tied weights listed twice) get one slot.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], comm: MPI.Comm,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        bucket_bytes = _check_bucket_bytes(bucket_bytes)
        _check_comm(comm)
        self.comm = comm
        # per bucket: flat buffer (n gradient values + one flag per parameter), n, params,
        # their offsets and shapes, and the current views (re-made if .to() replaced them)
        self._buckets = []
        with torch.no_grad():
            for bucket in _buckets(_check_params(parameters), bucket_bytes):
                n = sum(p.numel() for p in bucket)
                flat = torch.zeros(n + len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                offsets, offset = [], 0
                for p in bucket:
                    offsets.append(offset)
                    offset += p.numel()
                shapes = [p.shape for p in bucket]
                views = [flat[o:o + p.numel()].view(p.shape) for o, p in zip(offsets, bucket)]
                for p, v in zip(bucket, views):
                    if p.grad is not None:  # None stays None (torch's semantics)
                        v.copy_(p.grad)
                        p.grad = v
                ptrs = [q.data_ptr() for q in bucket]  # a conversion moves the storage
                self._buckets.append((flat, n, bucket, offsets, shapes, views, ptrs))

    @property
    def num_buckets(self) -> int:
        """Number of flat buffers (= ``Allreduce`` calls per :meth:`average`)."""
        return len(self._buckets)

    def _views(self, flat, params, offsets, shapes, views, ptrs) -> list:
        """The buffer views, checked: a parameter whose storage moved (``.to()``,
        ``.double()``, ``p.data = ...``) is re-examined: a changed dtype/device/shape raises
        ValueError; otherwise its view is made again (``Module._apply`` may have converted the
        old one in place). One pointer comparison per parameter on the common path."""
        for i, q in enumerate(params):
            if q.data_ptr() == ptrs[i]:
                continue
            o, shape = offsets[i], shapes[i]
            if (q.dtype, q.device, q.shape) != (flat.dtype, flat.device, shape):
                raise ValueError(f"parameter {i} of shape {tuple(shape)} {flat.dtype} on "
                                 f"{flat.device} is now {tuple(q.shape)} {q.dtype} on {q.device}: "
                                 f"build a new GradientBuckets after .to()/.double()/.cuda()")
            views[i] = flat[o:o + q.numel()].view(shape)
            ptrs[i] = q.data_ptr()
        return views

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: ``.grad = None`` (default), or zero every buffer and (re-)attach
        the views as the ``.grad`` tensors (``set_to_none=False``; see the class doc).
        Raises ValueError if a parameter changed dtype, device or shape (see the class doc)."""
        with torch.no_grad():
            for flat, _, params, offsets, shapes, views, ptrs in self._buckets:
                if set_to_none:
                    for p in params:
                        p.grad = None
                    continue
                views = self._views(flat, params, offsets, shapes, views, ptrs)
                flat.zero_()
                for p, v in zip(params, views):
                    if p.grad is not v:
                        p.grad = v

    def average(self, weight: float | None = None, timings: dict | None = None) -> int:
        """Average the gradients over ``comm`` in place (``weight`` and ``timings`` as in
        :func:`average_gradients`); returns the number of ``Allreduce`` calls. On a 1-rank
        communicator without ``weight`` nothing is done (0 calls, gradients untouched);
        otherwise every ``.grad`` is a buffer view afterwards, or ``None`` where no replica had
        a gradient. Errors (a changed parameter, a bad ``weight``) are raised on every rank
        before any gradient is communicated."""
        error = _weight_error(weight)
        for flat, _, params, offsets, shapes, views, ptrs in self._buckets:
            try:
                self._views(flat, params, offsets, shapes, views, ptrs)
            except ValueError as exc:
                error = error or str(exc)
        if weight is not None or error:  # rank-local checks: agreed before any Allreduce
            raise_agreed(self.comm, error)
        if self.comm.Get_size() == 1 and weight is None:
            return 0
        for flat, n, params, offsets, shapes, views, ptrs in self._buckets:
            t0 = time.perf_counter()
            with torch.no_grad():
                has_grad = []
                for p, v in zip(params, views):
                    g = p.grad
                    has_grad.append(g is not None)
                    if g is None:
                        v.zero_()
                    elif g is not v and g.data_ptr() != v.data_ptr():
                        v.copy_(g)  # fresh gradients (set_to_none) or replaced: one pack copy
            if timings is not None:
                timings["pack"] = timings.get("pack", 0.0) + time.perf_counter() - t0
            has = _reduce_bucket(self.comm, flat, n, has_grad, weight, timings)
            for p, v, h in zip(params, views, has):
                if not h:
                    p.grad = None
                elif p.grad is not v:  # (the setter validates: skip it when already set)
                    p.grad = v
        return len(self._buckets)
