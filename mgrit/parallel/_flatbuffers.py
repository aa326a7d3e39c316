"""Shared pieces of data-parallel gradient averaging (:mod:`mgrit.parallel.dataparallel`,
:mod:`mgrit.parallel.gradbuckets`): bucketing, argument checks, the in-place collective on a flat buffer
(CPU, CUDA-aware MPI or host staging) and the reduction of one bucket with its has-gradient
flags. Private: import the public names from :mod:`mgrit.parallel.dataparallel`."""
from __future__ import annotations

import math
import numbers
import operator
import time
from typing import Sequence

import torch
from mpi4py import MPI

from ..comm import cuda_aware

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


def _check_params(parameters, select=None) -> list:
    """The parameters that require grad (or satisfy ``select``), each once (first
    occurrence), validated."""
    if isinstance(parameters, (torch.Tensor, torch.nn.Module)):
        raise TypeError(f"parameters must be an iterable of tensors (e.g. model.parameters()), "
                        f"got a {type(parameters).__name__}")
    params, seen = [], set()
    for i, p in enumerate(parameters):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters must be tensors: item {i} is a {type(p).__name__}")
        if not (p.requires_grad if select is None else select(p)) or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dtype not in _MPI_TYPES:
            raise ValueError(f"parameter {i} of shape {tuple(p.shape)} has dtype {p.dtype}, "
                             f"which is not supported for gradient averaging: use one of "
                             f"{[str(d) for d in SUPPORTED_DTYPES]}")
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(f"parameter {i}: sparse gradients are not supported for gradient "
                             f"averaging")
        params.append(p)
    return params


def _check_comm(comm) -> None:
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator (e.g. ProcessGrid.data_comm), "
                        f"got {comm!r}")


def _weight_error(weight) -> str | None:
    """None if ``weight`` is None or a finite real number (0 is fine: an empty shard)."""
    if weight is None:
        return None
    ok = isinstance(weight, numbers.Real) and not isinstance(weight, bool)
    if not ok or not math.isfinite(weight):
        return (f"weight={weight!r} is not allowed: use a finite real number (e.g. shard size / "
                f"global batch size) or None for the mean")
    return None


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


def distinct_tensors(parameters) -> list:
    """The distinct tensors of an iterable, first occurrence first (shared parameters once);
    TypeError naming the first item that is not a tensor."""
    out, seen = [], set()
    for i, p in enumerate(parameters):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameters must be tensors: item {i} is a {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
