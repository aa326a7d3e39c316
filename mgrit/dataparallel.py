"""Data-parallel gradient averaging with bucketed flat-buffer Allreduce.

TorchBraid averages with one Allreduce per parameter; here the gradients of a list of
parameters are packed into flat buffers of at most ``bucket_bytes`` each (per dtype and
device), reduced with one ``Allreduce`` per bucket through mpi4py's buffer API in the
parameters' own dtype, and unpacked. With ``P_D`` replicas reading their shards of the same
global batch and each computing the *mean* loss over its shard, averaging the gradients gives
exactly the gradient of the mean loss over the global batch when the shards are equally sized
(use ``weights`` = shard sizes otherwise).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["average_gradients", "check_replicas_consistent", "DEFAULT_BUCKET_BYTES"]

#: Default bucket size (25 MiB, PyTorch DDP's default).
DEFAULT_BUCKET_BYTES = 25 * 2**20

_MPI_TYPES = {torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT}


def _buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int):
    bucket, size, key = [], 0, None
    for p in params:
        k = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        if bucket and (k != key or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
        key = k
    if bucket:
        yield bucket


def average_gradients(parameters: Iterable[torch.nn.Parameter], comm: MPI.Comm,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, weight: float | None = None) -> int:
    """Average ``.grad`` of ``parameters`` over ``comm`` in place; returns the number of
    Allreduce calls made.

    Args:
        parameters: parameters in the same order on every rank of ``comm`` (same shapes and
            dtypes; use :func:`check_replicas_consistent` once to verify). A parameter whose
            ``.grad`` is ``None`` contributes zeros (its ``.grad`` is created).
        comm: the data-parallel communicator (never ``COMM_WORLD`` implicitly).
        bucket_bytes: maximum bytes per flat buffer (default 25 MiB), > 0.
        weight: if given, each rank's gradients are multiplied by ``weight`` and summed (use
            ``weight = shard_size / global_batch_size`` for unequal shards); default: mean.

    Raises:
        ValueError: ``bucket_bytes <= 0`` or an unsupported dtype (float32/float64 only).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} is not allowed: use a positive int")
    params = [p for p in parameters if p.requires_grad]
    size = comm.Get_size()
    if size == 1 and weight is None:
        return 0
    scale = (1.0 / size) if weight is None else float(weight)
    calls = 0
    for bucket in _buckets(params, bucket_bytes):
        dtype = bucket[0].dtype
        if dtype not in _MPI_TYPES:
            raise ValueError(f"parameter dtype {dtype} is not supported for gradient averaging: "
                             f"use float32 or float64")
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                          .reshape(-1).to("cpu") for p in bucket])
        buf = flat.numpy()
        comm.Allreduce(MPI.IN_PLACE, [buf, _MPI_TYPES[dtype]], op=MPI.SUM)
        calls += 1
        flat.mul_(scale)
        offset = 0
        for p in bucket:
            n = p.numel()
            g = flat[offset:offset + n].view_as(p).to(p.device)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n
    return calls


def check_replicas_consistent(parameters: Iterable[torch.nn.Parameter], comm: MPI.Comm,
                              what: str = "model") -> None:
    """Raise ``ValueError`` on every rank of ``comm`` if the replicas' parameter lists differ
    (count, shapes or dtypes): one small allgather of a signature, done once at set-up."""
    sig = [(tuple(p.shape), str(p.dtype)) for p in parameters]
    sigs = comm.allgather(sig)
    for r, s in enumerate(sigs):
        if s != sigs[0]:
            n0 = sum(int(np.prod(x[0])) for x in sigs[0])
            nr = sum(int(np.prod(x[0])) for x in s)
            raise ValueError(f"{what} replicas differ: data-parallel rank 0 has {len(sigs[0])} "
                             f"parameter tensors ({n0} values), rank {r} has {len(s)} ({nr} values)")
