"""Point-to-point messages of the DGL pipeline (:mod:`layerwise.pipeline`): tensors travel as
raw bytes through mpi4py's buffer API (no pickling; float64 stays float64), sends are
non-blocking with a bounded number in flight, receives are posted ahead with a buffer of the
largest possible size and sized from the message status on arrival."""
from __future__ import annotations

import time
from collections import deque
from typing import Sequence

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["as_bytes", "PostedRecv", "Sender", "recv_tensor", "send_tensor"]


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's data as a flat uint8 numpy array (a copy only if not contiguous on CPU)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class PostedRecv:
    """Posted receives of one item: several tensors ``(n, *shape)`` with ``n <= max_n``
    unknown until they arrive. ``specs``: ``[(tag, dtype, shape, max_n)]``."""

    def __init__(self, comm: MPI.Comm, source: int, specs: Sequence[tuple]):
        self.specs, self.done, self.statuses = specs, False, [MPI.Status() for _ in specs]
        self.bufs, self.reqs = [], []
        for tag, dtype, shape, max_n in specs:
            nbytes = max(1, max_n * int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype))
            buf = np.empty(nbytes, dtype=np.uint8)
            self.bufs.append(buf)
            self.reqs.append(comm.Irecv([buf, MPI.BYTE], source=source, tag=tag))

    def test(self) -> bool:
        """Whether every tensor of the item has arrived (does not block)."""
        if not self.done:
            self.done = MPI.Request.Testall(self.reqs, self.statuses)
        return self.done

    def wait(self, stats: dict) -> list[torch.Tensor]:
        """Block until the item has arrived (time added to ``stats["comm_wait"]``); the
        tensors, viewing the receive buffers."""
        if not self.done:
            t0 = time.perf_counter()
            MPI.Request.Waitall(self.reqs, self.statuses)
            stats["comm_wait"] += time.perf_counter() - t0
            self.done = True
        out = []
        for (tag, dtype, shape, _), buf, st in zip(self.specs, self.bufs, self.statuses):
            count = st.Get_count(MPI.BYTE)
            per = int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
            if count % per:
                raise RuntimeError(f"received {count} bytes (tag {tag}), not a multiple of one "
                                   f"sample {shape} {dtype} ({per} bytes)")
            out.append(torch.from_numpy(buf[:count]).view(dtype).reshape(count // per, *shape))
        return out


class Sender:
    """Non-blocking sends to ``dest`` with at most ``max_pending`` items in flight (the
    oldest is waited for first); ``stats`` counts messages, bytes and waiting time."""

    def __init__(self, comm: MPI.Comm, dest: int, max_pending: int, stats: dict):
        self.comm, self.dest, self.max_pending, self.stats = comm, dest, max_pending, stats
        self._pending: deque = deque()

    def send(self, tensors: Sequence[torch.Tensor], tags: Sequence[int]) -> None:
        group = []
        for t, tag in zip(tensors, tags):
            buf = as_bytes(t)
            group.append((self.comm.Isend([buf, MPI.BYTE], dest=self.dest, tag=tag), buf))
            self.stats["messages"] += 1
            self.stats["bytes_sent"] += buf.nbytes
        self._pending.append(group)
        while len(self._pending) > self.max_pending:
            self._wait(self._pending.popleft())

    def _wait(self, group) -> None:
        t0 = time.perf_counter()
        MPI.Request.Waitall([req for req, _ in group])
        self.stats["comm_wait"] += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait for every send in flight."""
        while self._pending:
            self._wait(self._pending.popleft())


def send_tensor(comm: MPI.Comm, t: torch.Tensor, dest: int, tag: int) -> None:
    """Blocking send of ``t``'s bytes (evaluation: the receiver is already waiting for it)."""
    comm.Send([as_bytes(t), MPI.BYTE], dest=dest, tag=tag)


def recv_tensor(comm: MPI.Comm, shape: Sequence[int], dtype: torch.dtype, source: int,
                tag: int) -> torch.Tensor:
    """Blocking receive of a tensor of known ``shape`` and ``dtype`` (see :func:`send_tensor`)."""
    buf = np.empty(max(1, int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)),
                   dtype=np.uint8)
    status = MPI.Status()
    comm.Recv([buf, MPI.BYTE], source=source, tag=tag, status=status)
    n = status.Get_count(MPI.BYTE)
    return torch.from_numpy(buf[:n]).view(dtype).reshape(*shape)
