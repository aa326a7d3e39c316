"""Persistent flat gradient buffers for data-parallel training (:class:`GradientBuckets`,
re-exported by :mod:`mgrit.parallel.dataparallel`, whose module doc describes the bucketing, the
has-gradient flags and the device paths).

Contract of the buffers (a fast path: the ``.grad`` tensors are views of buffers laid out once):
they assume the averaged set -- the parameters that require grad or hold a ``.grad``, their
identities, order, shapes, dtypes and devices -- is what it was when the buffers were laid
out. Its fingerprint is checked at every :meth:`GradientBuckets.zero_grad` and
:meth:`GradientBuckets.average`: the per-parameter "averaged" flags and storage pointers, and,
when the buckets were given a module or a callable, the parameter list itself, enumerated again
whenever a parameter or module was registered anywhere in the process since the last check
(torch's global registration hooks count them: ``module.weight = nn.Parameter(...)``,
``load_state_dict(..., assign=True)``). A changed fingerprint lays the buffers out again (the
current gradients are kept). Every :meth:`GradientBuckets.average` agrees on the layout's
signature (count, shapes, dtypes) over the replicas before any gradient is communicated, so a
parameter frozen, unfrozen or replaced on some replicas only is an error on every rank, never
a silently mismatched reduction.
"""
from __future__ import annotations

import hashlib
import time
from typing import Callable, Iterable

import torch
from mpi4py import MPI
from torch import nn
from torch.nn.modules import module as _module

from ._flatbuffers import distinct_tensors
from ._flatbuffers import (DEFAULT_BUCKET_BYTES, _buckets, _check_bucket_bytes, _check_comm,
                           _check_params, _reduce_bucket, _weight_error)
from ..comm import raise_agreed

__all__ = ["GradientBuckets"]

_REGISTRATIONS = [0]  # parameters and modules registered in this process (global torch hooks)


def _count_registration(*_):
    _REGISTRATIONS[0] += 1  # returns None: the registration proceeds unchanged


_module.register_module_parameter_registration_hook(_count_registration)
_module.register_module_module_registration_hook(_count_registration)


def _averaged(p: torch.Tensor) -> bool:
    """A parameter is averaged when it requires grad or holds a gradient (the optimizer
    applies any ``.grad``, so a parameter frozen after its backward is averaged too)."""
    return p.requires_grad or p.grad is not None


class GradientBuckets:
    """Persistent flat gradient buffers; after :meth:`average` the parameters' ``.grad`` are
    views of them.

    The averaged parameters (those that require grad or hold a ``.grad``) are grouped into
    buckets exactly as :func:`average_gradients` does (by dtype and device, at most
    ``bucket_bytes`` each, same order on every replica) and one flat buffer is allocated per
    bucket. Each :meth:`average` is one in-place ``Allreduce`` per bucket; compared with
    :func:`average_gradients` it saves the buffer allocation and the unpack copy (the reduced
    buffer slices simply become the ``.grad`` tensors). Results equal
    :func:`average_gradients` bit for bit.

    The layout follows the model (see the module doc for the contract and its fingerprint): a
    parameter unfrozen by a callback is averaged from the next :meth:`average` on, a frozen
    one leaves the buffers, and -- when ``parameters`` is a module or a callable -- a replaced
    parameter (``module.weight = nn.Parameter(...)``, ``load_state_dict(..., assign=True)``)
    is averaged in place of the old one; a dtype, device or shape change (``.double()``,
    ``p.data = ...``) lays the buffers out again too. Freezing, unfreezing and replacing must
    happen alike on every replica (an error on every rank otherwise).

    Two ways to clear gradients (:meth:`zero_grad`):

    * ``set_to_none=True`` (default, like ``optimizer.zero_grad()``): backward allocates fresh
      gradients and :meth:`average` copies them into the buffers (one pack copy). A parameter
      whose ``.grad`` is ``None`` on every replica keeps ``None`` (the optimizer skips it).
    * ``set_to_none=False`` (PyTorch DDP's ``gradient_as_bucket_view``): the buffers are zeroed
      and the views stay the ``.grad`` tensors, so backward accumulates straight into the
      buffers and :meth:`average` copies nothing; every parameter then has a gradient (zeros if
      unused), so momentum or weight decay also move unused parameters. Zeroing plus in-place
      accumulation moves about as many bytes as the pack copy: on CPU it measured no faster
      (``experiments/benchmarks/bench_dataparallel.py``); it saves memory (no second gradient copy).

    Either way every known parameter's gradient is cleared, the frozen ones' too (as
    ``optimizer.zero_grad()`` does for its parameters).

    Use::

        buckets = GradientBuckets(model, grid.data_comm)   # or model.parameters()
        for x, y in shards:
            buckets.zero_grad()
            loss_fn(model(x), y).backward()
            buckets.average()              # mean over the replicas, one call per bucket
            optimizer.step()

    Args:
        parameters: the replica's parameters, same order, shapes and dtypes on every rank of
            ``comm`` (check once with :func:`check_replicas_consistent`): an ``nn.Module``
            (its ``parameters()``, enumerated again when a parameter or module was registered
            since the last check: follows replaced parameters), a callable returning an
            iterable of parameters (called likewise), or an iterable of parameters (a fixed
            list: follows ``requires_grad`` changes, not replacement). Existing ``.grad``
            values are copied into the buffers.
        comm: the data-parallel communicator (``ProcessGrid.data_comm``).
        bucket_bytes: maximum bytes of gradient data per buffer (default 25 MiB), > 0.

    Raises:
        ValueError: for a non-positive ``bucket_bytes``, an unsupported dtype or a sparse
            gradient of an averaged parameter (at construction: no communication happens in
            the constructor; later, in :meth:`average`, on every rank before any gradient is
            communicated), a ``weight`` that is not a finite real number, or replicas whose
            averaged parameters differ in count, shapes or dtypes (in :meth:`average`, on
            every rank, naming each replica's layout signature).
        TypeError: ``parameters`` a single tensor or an item that is not a tensor, or ``comm``
            not a communicator.
        Duplicated parameters (tied weights listed twice) get one slot.
    """

    def __init__(self, parameters: (nn.Module | Callable[[], Iterable[torch.Tensor]]
                                    | Iterable[torch.Tensor]),
                 comm: MPI.Comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        bucket_bytes = _check_bucket_bytes(bucket_bytes)
        _check_comm(comm)
        self.comm, self.bucket_bytes = comm, bucket_bytes
        if isinstance(parameters, nn.Module):
            self._source: Callable | None = parameters.parameters
        elif callable(parameters) and not isinstance(parameters, torch.Tensor):
            self._source = parameters
        else:
            self._source = None
            self._known = self._enumerate(parameters)
        if self._source is not None:
            self._known = self._enumerate(self._source())
        self._registrations = _REGISTRATIONS[0]
        self._build()

    @staticmethod
    def _enumerate(parameters: Iterable[torch.Tensor]) -> list:
        """Every distinct tensor of ``parameters`` (frozen ones too: they may be unfrozen)."""
        if isinstance(parameters, torch.Tensor):
            raise TypeError(f"parameters must be a module, a callable or an iterable of "
                            f"tensors (e.g. model.parameters()), got a {type(parameters).__name__}")
        return distinct_tensors(parameters)

    def _build(self) -> None:
        """Lay the buffers out for the currently averaged parameters (the fingerprint's
        reference). Per bucket: flat buffer (n gradient values + one flag per parameter), n,
        params, their offsets and shapes, the views and the storage pointers."""
        averaged = _check_params(self._known, select=_averaged)
        self._stale = False
        self._flags = [_averaged(p) for p in self._known]
        self._buckets = []
        with torch.no_grad():
            for bucket in _buckets(averaged, self.bucket_bytes):
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
        layout = repr([(tuple(p.shape), str(p.dtype)) for p in averaged])
        self._signature = (f"{len(averaged)} tensors, "
                           f"{sum(p.numel() for p in averaged)} values, layout "
                           f"{hashlib.sha1(layout.encode()).hexdigest()[:12]}")

    @property
    def num_buckets(self) -> int:
        """Number of flat buffers (= ``Allreduce`` calls per :meth:`average`)."""
        return len(self._buckets)

    def _refresh_known(self) -> None:
        """Enumerate the source again if a parameter or module was registered since the last
        look; a different list marks the layout stale."""
        if self._source is not None and self._registrations != _REGISTRATIONS[0]:
            known = self._enumerate(self._source())
            self._registrations = _REGISTRATIONS[0]
            if len(known) != len(self._known) \
                    or any(a is not b for a, b in zip(known, self._known)):
                self._known, self._stale = known, True

    def _sync(self) -> None:
        """Check the fingerprint (module doc); lay the buffers out again when it changed,
        else re-make the views of parameters whose storage moved with the same dtype, device
        and shape (``Module._apply`` may have converted the old view in place)."""
        self._refresh_known()
        changed = self._stale
        if not changed:
            changed = [p.requires_grad or p.grad is not None for p in self._known] != self._flags
        if not changed:
            for flat, _, params, offsets, shapes, views, ptrs in self._buckets:
                if [q.data_ptr() for q in params] == ptrs:
                    continue  # the common case: one comparison of pointer lists per bucket
                for i, q in enumerate(params):
                    if q.data_ptr() == ptrs[i]:
                        continue
                    if (q.dtype, q.device, q.shape) != (flat.dtype, flat.device, shapes[i]):
                        changed = True
                        break
                    views[i] = flat[offsets[i]:offsets[i] + q.numel()].view(shapes[i])
                    ptrs[i] = q.data_ptr()
                if changed:
                    break
        if changed:
            self._build()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: ``.grad = None`` (default), or zero every buffer and (re-)attach
        the views as the ``.grad`` tensors (``set_to_none=False``; see the class doc). The
        gradients of known parameters outside the buffers (frozen ones) are cleared alike
        (``None``, or zeroed in place). Raises ValueError for an averaged parameter of an
        unsupported dtype (see the class doc)."""
        self._refresh_known()
        with torch.no_grad():
            for p in self._known:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
            if set_to_none:
                return
            self._sync()
            for flat, _, params, offsets, shapes, views, ptrs in self._buckets:
                flat.zero_()
                for p, v in zip(params, views):
                    if p.grad is not v:
                        p.grad = v

    def average(self, weight: float | None = None, timings: dict | None = None) -> int:
        """Average the gradients over ``comm`` in place (``weight`` and ``timings`` as in
        :func:`average_gradients`); returns the number of ``Allreduce`` calls. On a 1-rank
        communicator without ``weight`` nothing is done (0 calls, gradients untouched);
        otherwise every ``.grad`` is a buffer view afterwards, or ``None`` where no replica had
        a gradient. Errors (a bad ``weight``, an unsupported dtype, replicas whose averaged
        parameters differ) are raised on every rank before any gradient is communicated: one
        small ``allgather`` of the layout signature per call on more than one rank."""
        error = _weight_error(weight)
        try:
            self._sync()
        except (ValueError, TypeError) as exc:
            error = error or str(exc)
        if self.comm.Get_size() > 1 or error:  # rank-local checks: agreed before any Allreduce
            raise_agreed(self.comm, error, same=None if error else self._signature,
                         what="averaged parameters (a parameter frozen, unfrozen or replaced "
                              "on some replicas only?)")
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
