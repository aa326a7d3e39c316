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
import time
from typing import Iterable

import numpy as np
import torch
from mpi4py import MPI

from ._flatbuffers import (DEFAULT_BUCKET_BYTES, SUPPORTED_DTYPES, _buckets, _check_bucket_bytes,
                           _check_comm, _check_params, _collective_inplace, _reduce_bucket,
                           _weight_error)
from ..comm import raise_agreed
from .gradbuckets import GradientBuckets

__all__ = ["average_gradients", "GradientBuckets", "broadcast_parameters",
           "check_replicas_consistent", "DEFAULT_BUCKET_BYTES", "SUPPORTED_DTYPES"]

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
            complex64/complex128 only), a sparse gradient, or ``weight`` not a finite real
            number on some rank (then on every rank, before any gradient is communicated).
        TypeError: ``parameters`` a single tensor or module, or ``comm`` not a communicator.
        Duplicated parameters (tied weights listed twice) are averaged once.
    """
    bucket_bytes = _check_bucket_bytes(bucket_bytes)
    params = _check_params(parameters)
    _check_comm(comm)
    if weight is not None:  # rank-local values: a bad one raises on every rank, before the sum
        raise_agreed(comm, _weight_error(weight))
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
