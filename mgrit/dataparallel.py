"""Data-parallel gradient averaging with bucketed flat-buffer Allreduce.

TorchBraid averages with one Allreduce per parameter; here the gradients of a list of
parameters are grouped by (dtype, device), packed into flat buffers of at most ``bucket_bytes``
of gradient data each, reduced with one ``Allreduce`` per bucket through mpi4py's buffer API in
the parameters' own dtype (no float64 -> float32 downcast, no pickling), and unpacked. With the
default 25 MiB buckets a model of one dtype costs one call per step (plus one per extra 25 MiB).
:class:`GradientBuckets` keeps the buffers across steps and makes their slices the ``.grad``
tensors (no allocation, no unpack copy): use it in training loops, :func:`average_gradients`
for one-off averaging.

Exactness: with ``P_D`` replicas reading their shards of the same global batch
(:class:`data.GlobalBatchSampler`) and each computing the *mean* loss over its shard, averaging
the gradients gives the gradient of the mean loss over the global batch when the shards are
equally sized; pass ``weight = shard_size / global_batch_size`` otherwise. Training then equals
single-replica training with the same global batch up to rounding (sum order of the reduction).

Each bucket carries, after the gradient values, one flag per parameter (1 if that rank has a
``.grad``); after the sum a parameter that has no gradient on *any* replica keeps
``.grad = None`` (so ``torch.optim`` skips it, exactly as in single-replica training), and one
that has a gradient on some replicas only is averaged with zeros for the others (DDP's
``find_unused_parameters`` semantics). The flags cost ``n_params`` elements per step, no call.

Devices and costs (per bucket of ``n`` bytes, ``B`` = PCIe bandwidth, about 25 GB/s for PCIe 4):

* CPU tensors: one pack copy, the Allreduce (ring or recursive doubling in the MPI library:
  about ``2 n (P_D-1)/P_D / link-bandwidth + log2(P_D) * latency``), one unpack copy.
* CUDA tensors with CUDA-aware MPI (:func:`mgrit.comm.cuda_aware` true): the flat device
  buffer is handed to mpi4py directly (it exposes ``__cuda_array_interface__``); the current
  CUDA stream is synchronized first because MPI does not order itself after torch's kernels.
  No host copies.
* CUDA tensors otherwise: staged through host memory, one device-to-host and one host-to-device
  copy, ``2 n / B`` extra (about 80 us per MB round trip, 2 ms for a 25 MiB bucket), plus the
  synchronization the copies imply. Bigger buckets amortize latency, not this copy.
"""
from __future__ import annotations

import hashlib
import operator
import time
from typing import Iterable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from .comm import cuda_aware

__all__ = ["average_gradients", "GradientBuckets", "broadcast_parameters",
           "check_replicas_consistent", "DEFAULT_BUCKET_BYTES", "SUPPORTED_DTYPES"]

#: Default bucket size (25 MiB of gradient data, PyTorch DDP's default).
DEFAULT_BUCKET_BYTES = 25 * 2**20

_MPI_TYPES = {torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT,
              torch.complex128: MPI.C_DOUBLE_COMPLEX, torch.complex64: MPI.C_FLOAT_COMPLEX}
#: dtypes whose gradients can be averaged (MPI has no portable half/bfloat16 reduction).
SUPPORTED_DTYPES = tuple(_MPI_TYPES)


def _check_bucket_bytes(bucket_bytes) -> int:
    try:
        b = operator.index(bucket_bytes)
    except TypeError:
        b = None
    if b is None or isinstance(bucket_bytes, bool) or b <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} is not allowed: use a positive int")
    return b


def _buckets(params: Sequence[torch.Tensor], bucket_bytes: int):
    """Group ``params`` by (dtype, device), keeping their order within a group (first-seen order
    of groups), and split each group into runs of at most ``bucket_bytes`` (a parameter larger
    than that is a bucket of its own). Deterministic given the list, so identical on replicas."""
    groups: dict = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    for group in groups.values():
        bucket, size = [], 0
        for p in group:
            nbytes = p.numel() * p.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(p)
            size += nbytes
        if bucket:
            yield bucket


def _collective_inplace(comm: MPI.Comm, flat: torch.Tensor, mpitype, op, timings, root=None):
    """In-place Allreduce (``root is None``) or Bcast of the contiguous 1-D tensor ``flat``."""
    def call(buf):
        t0 = time.perf_counter()
        if root is None:
            comm.Allreduce(MPI.IN_PLACE, [buf, mpitype], op=op)
        else:
            comm.Bcast([buf, mpitype], root=root)
        if timings is not None:
            timings["allreduce"] = timings.get("allreduce", 0.0) + time.perf_counter() - t0

    if flat.device.type == "cpu":
        call(flat.numpy())
    elif flat.is_cuda and cuda_aware():
        torch.cuda.current_stream(flat.device).synchronize()
        call(flat)
    else:
        t0 = time.perf_counter()
        host = flat.cpu()
        if timings is not None:
            timings["stage"] = timings.get("stage", 0.0) + time.perf_counter() - t0
        call(host.numpy())
        t0 = time.perf_counter()
        flat.copy_(host)
        if timings is not None:
            timings["stage"] = timings.get("stage", 0.0) + time.perf_counter() - t0


def _check_params(parameters) -> list:
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.dtype not in _MPI_TYPES:
            raise ValueError(f"parameter dtype {p.dtype} is not supported for gradient averaging: "
                             f"use one of {[str(d) for d in SUPPORTED_DTYPES]}")
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError("sparse gradients are not supported for gradient averaging")
    return params


def _reduce_bucket(comm, flat, n, has_grad, weight, timings) -> torch.Tensor:
    """Sum ``flat`` (``n`` gradient values, then one flag per parameter) over ``comm`` in place
    and apply the mean (``weight is None``: scaled by ``1/size`` after the sum) or ``weight``
    (scaled before the sum, each rank its own). Returns the per-parameter "has a gradient on
    some rank" mask (numpy bool)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        if weight is not None:
            flat[:n].mul_(float(weight))
        flat[n:].copy_(torch.tensor(has_grad, dtype=flat.dtype))
    t1 = time.perf_counter()
    _collective_inplace(comm, flat, _MPI_TYPES[flat.dtype], MPI.SUM, timings)
    t2 = time.perf_counter()
    with torch.no_grad():
        if weight is None:
            flat[:n].mul_(1.0 / comm.Get_size())
        has = (flat[n:].real if flat.is_complex() else flat[n:]).cpu().numpy() > 0.5
    if timings is not None:
        timings["pack"] = timings.get("pack", 0.0) + t1 - t0
        timings["unpack"] = timings.get("unpack", 0.0) + time.perf_counter() - t2
    return has


def average_gradients(parameters: Iterable[torch.nn.Parameter], comm: MPI.Comm,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, weight: float | None = None,
                      timings: dict | None = None) -> int:
    """Average ``.grad`` of ``parameters`` over ``comm`` in place; returns the number of
    Allreduce calls made (one per bucket; 0 on a 1-rank communicator without ``weight``).

    Packs the gradients into fresh flat buffers and unpacks them afterwards (two copies of the
    gradient data per step). For a training loop, :class:`GradientBuckets` avoids both copies by
    making the ``.grad`` tensors views of persistent buffers; this function suits one-off
    averaging and models whose parameters change between steps.

    Args:
        parameters: parameters in the same order on every rank of ``comm`` (same shapes and
            dtypes; use :func:`check_replicas_consistent` once to verify). Those with
            ``requires_grad=False`` are skipped. A ``.grad`` of ``None`` counts as zeros; it
            stays ``None`` only if it is ``None`` on every rank (see module doc).
        comm: the data-parallel communicator (``ProcessGrid.data_comm``; never ``COMM_WORLD``
            implicitly). Open/close layers are averaged on the ranks that hold them: pass the
            parameters this rank holds and its grid's ``data_comm``.
        bucket_bytes: maximum bytes of gradient data per flat buffer (default 25 MiB), > 0;
            ``bucket_bytes=1`` gives one call per parameter (TorchBraid's scheme, for
            comparison).
        weight: if given, each rank's gradients are multiplied by ``weight`` and summed (use
            ``weight = shard_size / global_batch_size`` for unequal shards); default: mean.
        timings: optional dict; seconds are added under ``"pack"``, ``"allreduce"`` (the MPI
            calls), ``"stage"`` (host staging of CUDA buffers) and ``"unpack"``.

    Raises:
        ValueError: ``bucket_bytes`` not a positive int, an unsupported dtype (float32/float64/
            complex64/complex128 only) or a sparse gradient.
    """
    bucket_bytes = _check_bucket_bytes(bucket_bytes)
    params = _check_params(parameters)
    if comm.Get_size() == 1 and weight is None:
        return 0
    calls = 0
    for bucket in _buckets(params, bucket_bytes):
        t0 = time.perf_counter()
        n = sum(p.numel() for p in bucket)
        flat = torch.empty(n + len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        offset = 0
        with torch.no_grad():
            for p in bucket:
                k = p.numel()
                if p.grad is None:
                    flat[offset:offset + k].zero_()
                else:
                    flat[offset:offset + k].copy_(p.grad.reshape(-1))
                offset += k
        t1 = time.perf_counter()
        has = _reduce_bucket(comm, flat, n, [p.grad is not None for p in bucket], weight, timings)
        calls += 1
        t2 = time.perf_counter()
        with torch.no_grad():
            offset = 0
            for i, p in enumerate(bucket):
                k = p.numel()
                if has[i]:
                    g = flat[offset:offset + k].view_as(p)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                offset += k
        if timings is not None:
            timings["pack"] = timings.get("pack", 0.0) + t1 - t0
            timings["unpack"] = timings.get("unpack", 0.0) + time.perf_counter() - t2
    return calls


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
            if a parameter changed dtype, device or shape since construction (``.to()``,
            ``.double()``: build a new ``GradientBuckets``).
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], comm: MPI.Comm,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        bucket_bytes = _check_bucket_bytes(bucket_bytes)
        self.comm = comm
        self._buckets = []  # (flat buffer with n + len(params) elements, n, params, views)
        with torch.no_grad():
            for bucket in _buckets(_check_params(parameters), bucket_bytes):
                n = sum(p.numel() for p in bucket)
                flat = torch.zeros(n + len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                views, offset = [], 0
                for p in bucket:
                    v = flat[offset:offset + p.numel()].view_as(p)
                    if p.grad is not None:
                        v.copy_(p.grad)
                    p.grad = v
                    views.append(v)
                    offset += p.numel()
                self._buckets.append((flat, n, bucket, views))

    @property
    def num_buckets(self) -> int:
        """Number of flat buffers (= ``Allreduce`` calls per :meth:`average`)."""
        return len(self._buckets)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: ``.grad = None`` (default), or zero every buffer and (re-)attach
        the views as the ``.grad`` tensors (``set_to_none=False``; see the class doc)."""
        with torch.no_grad():
            for flat, _, params, views in self._buckets:
                if set_to_none:
                    for p in params:
                        p.grad = None
                    continue
                flat.zero_()
                for p, v in zip(params, views):
                    if p.grad is not v:
                        p.grad = v

    def average(self, weight: float | None = None, timings: dict | None = None) -> int:
        """Average the gradients over ``comm`` in place (``weight`` and ``timings`` as in
        :func:`average_gradients`); returns the number of ``Allreduce`` calls (0 on a 1-rank
        communicator without ``weight``). Every ``.grad`` is a buffer view afterwards, or
        ``None`` where no replica had a gradient."""
        if self.comm.Get_size() == 1 and weight is None:
            return 0
        for flat, n, params, views in self._buckets:
            t0 = time.perf_counter()
            with torch.no_grad():
                has_grad = []
                for p, v in zip(params, views):
                    if (p.dtype, p.device, p.shape) != (v.dtype, v.device, v.shape):
                        raise ValueError(f"parameter of shape {tuple(v.shape)} {v.dtype} on "
                                         f"{v.device} is now {tuple(p.shape)} {p.dtype} on "
                                         f"{p.device}: build a new GradientBuckets after .to()")
                    g = p.grad
                    has_grad.append(g is not None)
                    if g is None:
                        v.zero_()
                    elif g is not v and g.data_ptr() != v.data_ptr():
                        v.copy_(g)  # detached by set_to_none or replaced: one pack copy
            if timings is not None:
                timings["pack"] = timings.get("pack", 0.0) + time.perf_counter() - t0
            has = _reduce_bucket(self.comm, flat, n, has_grad, weight, timings)
            for p, v, h in zip(params, views, has):
                p.grad = v if h else None
        return len(self._buckets)


def broadcast_parameters(parameters: Iterable[torch.Tensor], comm: MPI.Comm, root: int = 0,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Copy the values of ``parameters`` (or buffers) from rank ``root`` of ``comm`` to every
    rank, in bucketed flat buffers (one ``Bcast`` per bucket, bit for bit); returns the number
    of calls. Use once at set-up so that replicas start from the same weights. Any dtype
    (bytes are broadcast)."""
    bucket_bytes = _check_bucket_bytes(bucket_bytes)
    tensors = list(parameters)
    if comm.Get_size() == 1:
        return 0
    calls = 0
    for bucket in _buckets(tensors, bucket_bytes):
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            _collective_inplace(comm, flat.view(torch.uint8), MPI.BYTE, None, None, root=root)
            calls += 1
            offset = 0
            for t in bucket:
                k = t.numel()
                t.copy_(flat[offset:offset + k].view_as(t))
                offset += k
    return calls


def _digest(t: torch.Tensor) -> str:
    a = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha1(a.tobytes()).hexdigest()[:16]


def check_replicas_consistent(parameters: Iterable[torch.nn.Parameter], comm: MPI.Comm,
                              what: str = "model", check_values: bool = False) -> None:
    """Raise ``ValueError`` on every rank of ``comm`` if the replicas' parameter lists differ
    (count, shapes or dtypes; with ``check_values`` also the values, bit for bit): one small
    allgather of a signature, done once at set-up. The message names the first rank that
    differs from data-parallel rank 0 and how."""
    params = list(parameters)
    sig = [(tuple(p.shape), str(p.dtype)) for p in params]
    digests = [_digest(p) for p in params] if check_values else None
    allsig = comm.allgather((sig, digests))
    sig0, dig0 = allsig[0]
    n0 = sum(int(np.prod(s)) for s, _ in sig0)
    for r, (s, d) in enumerate(allsig):
        if s != sig0:
            nr = sum(int(np.prod(x)) for x, _ in s)
            detail = ""
            if len(s) == len(sig0):
                i = next(i for i in range(len(s)) if s[i] != sig0[i])
                detail = f"; first difference at parameter {i}: {sig0[i]} vs {s[i]}"
            raise ValueError(f"{what} replicas differ: data-parallel rank 0 has {len(sig0)} "
                             f"parameter tensors ({n0} values), rank {r} has {len(s)} ({nr} "
                             f"values){detail}. Every replica must build the same model.")
        if check_values and d != dig0:
            i = next(i for i in range(len(d)) if d[i] != dig0[i])
            raise ValueError(f"{what} replicas differ in values: parameter {i} {sig0[i]} on "
                             f"data-parallel rank {r} is not equal to rank 0's (seed the models "
                             f"identically or call broadcast_parameters)")
