"""Point-to-point transfer of torch tensors over an mpi4py communicator, and fail-fast helpers.

Messages use mpi4py's buffer API (upper-case ``Isend``/``Irecv``, no pickling) on the raw bytes
of a contiguous tensor, so any dtype (float64, float32, bfloat16, ...) crosses ranks bit for
bit: no silent float64 -> float32 downcast (a pitfall of TorchBraid's CPU path), no partial
packing (XBraid issue #81). Shapes and dtypes are agreed statically by both ends (the solver
knows the state template on every rank); each message is checked for its byte count.

CUDA tensors are staged through host memory (one device-to-host copy before a send and one
host-to-device copy after a receive, each ``nbytes / PCIe-bandwidth``, about 40 us per MB on
PCIe 4). CUDA-aware MPI is used instead when :func:`cuda_aware` reports it.

Only the communicator handed in is ever used (never ``COMM_WORLD``: PyMGRIT issue #10).
"""
from __future__ import annotations

import time

import numpy as np
import torch
from mpi4py import MPI

from .collective import CollectiveTimeout, agreed, allgather_within, check_thread_level
from .stats import SolverStats

__all__ = ["Exchanger", "cuda_aware", "raise_agreed"]


def cuda_aware() -> bool:
    """True when the MPI library reports CUDA support (MPI 4.1 ``MPI_Query_cuda_support``)."""
    try:
        return bool(MPI.Query_cuda_support())
    except (AttributeError, NotImplementedError, MPI.Exception):
        return False


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """Contiguous host uint8 view of ``t``'s bytes (copies only when needed)."""
    t = t.detach()
    if t.is_cuda:
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


class Exchanger:
    """Non-blocking sends and blocking/posted receives of states of a fixed template.

    Args:
        comm: mpi4py communicator the solver was given.
        shape, dtype, device: template of every message (``torch.Size``, ``torch.dtype``,
            ``torch.device``).
        stats: counters to update (messages, bytes, ``comm_wait`` time).
    """

    def __init__(self, comm: MPI.Comm, shape, dtype: torch.dtype, device, stats: SolverStats):
        self.comm = comm
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.stats = stats
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        self._pending: list[tuple[MPI.Request, np.ndarray]] = []

    def isend(self, t: torch.Tensor, dest: int, tag: int) -> None:
        """Start sending ``t`` (shape and dtype must match the template) to ``dest``."""
        if t.shape != self.shape or t.dtype != self.dtype:
            raise ValueError(f"message tensor {tuple(t.shape)} {t.dtype} does not match the state "
                             f"template {tuple(self.shape)} {self.dtype}")
        buf = _as_bytes(t)
        self._pending.append((self.comm.Isend([buf, MPI.BYTE], dest=dest, tag=tag), buf))
        self.stats.messages += 1
        self.stats.bytes_sent += buf.nbytes
        if self.stats.tracer is not None:
            self.stats.tracer.send(dest, tag, buf.nbytes)

    def irecv(self, source: int, tag: int) -> "PostedRecv":
        """Post a receive of one state from ``source``; call ``.wait()`` for the tensor."""
        buf = np.empty(self.nbytes, dtype=np.uint8)
        posted = PostedRecv(self, self.comm.Irecv([buf, MPI.BYTE], source=source, tag=tag), buf,
                            source)
        if self.stats.tracer is not None:  # numbered at posting: MPI matches in posting order
            posted.trace_id = self.stats.tracer.post_recv(source, tag)
        return posted

    def recv(self, source: int, tag: int, timeout: float | None = None,
             what: str = "a state") -> torch.Tensor:
        """Blocking receive of one state from ``source``; with ``timeout`` (seconds), wait at
        most that long (see :meth:`PostedRecv.wait`)."""
        return self.irecv(source, tag).wait(timeout, what)

    def waitall(self) -> None:
        """Complete all pending sends (their buffers are released afterwards)."""
        if self._pending:
            t0 = time.perf_counter()
            MPI.Request.Waitall([r for r, _ in self._pending])
            self.stats.time["comm_wait"] += time.perf_counter() - t0
            self._pending.clear()


class PostedRecv:
    """A posted receive; :meth:`wait` returns the state as a tensor on the template's device."""

    def __init__(self, ex: Exchanger, req: MPI.Request, buf: np.ndarray, source: int = -1):
        self._ex, self._req, self._buf, self._source = ex, req, buf, source
        self.trace_id = None  # the tracer's number of this message (when one records)

    def wait(self, timeout: float | None = None, what: str = "a state") -> torch.Tensor:
        """The received state. ``timeout`` (seconds; default ``None``: wait forever): poll
        (``MPI_Test`` with a back-off of at most 0.5 ms between tests) and raise
        :class:`~mgrit.collective.CollectiveTimeout` naming the source rank and ``what`` when
        nothing arrived in time (the receive is cancelled; the communicator should not be used
        afterwards)."""
        ex = self._ex
        tracer = ex.stats.tracer
        t0 = time.perf_counter()
        c0 = tracer.clock() if tracer is not None else 0.0  # the tracer's clock (CPU or wall)
        status = MPI.Status()
        if timeout is None:
            self._req.Wait(status)
        else:
            deadline, pause = time.monotonic() + timeout, 0.0
            while not self._req.Test(status):
                if time.monotonic() > deadline:
                    self._req.Cancel()
                    self._req.Wait()
                    raise CollectiveTimeout(
                        f"rank {ex.comm.Get_rank()} waited {timeout:g} s for {what} from rank "
                        f"{self._source} that never came (that rank failed or never got "
                        f"there; the deadline is $LAYERPAR_COLLECTIVE_TIMEOUT or "
                        f"mgrit.collective.set_collective_timeout)")
                pause = min(5e-4, pause * 2 or 1e-6)
                time.sleep(pause)
        t1 = time.perf_counter()
        ex.stats.time["comm_wait"] += t1 - t0
        if tracer is not None:
            tracer.recv(self.trace_id, status.Get_count(MPI.BYTE), c0, tracer.clock())
        if status.Get_count(MPI.BYTE) != ex.nbytes:
            raise RuntimeError(f"received {status.Get_count(MPI.BYTE)} bytes from rank "
                               f"{status.Get_source()}, expected {ex.nbytes} for a state "
                               f"{tuple(ex.shape)} {ex.dtype}")
        t = torch.from_numpy(self._buf).view(ex.dtype).reshape(ex.shape)
        return t.to(ex.device) if ex.device.type != "cpu" else t


def raise_agreed(comm: MPI.Comm, error: str | None, stats: SolverStats | None = None,
                 same=None, what: str = "value") -> None:
    """Validation consensus: raise the same ``ValueError`` on every rank of ``comm`` if any
    rank found an ``error`` (a message, or ``None``), or if ``same`` (e.g. the state shape)
    differs between ranks. For checks that depend on rank-local data (the user's tensors or
    modules on one rank): one small ``allgather``, skipped on one rank, so no rank goes on to
    communicate while another has failed. The error is marked
    :func:`~mgrit.collective.agreed` (it passes the abort guard of collective sections). The
    allgather has the library's deadline (:func:`~mgrit.collective.allgather_within`): a rank
    that never arrives is a :class:`~mgrit.collective.CollectiveTimeout` naming it."""
    if comm.Get_size() > 1:
        check_thread_level()
        tracer = None if stats is None else stats.tracer
        if stats is not None:
            stats.allreduces += 1
        t0 = tracer.clock() if tracer is not None else 0.0
        gathered = allgather_within(comm, (error, same), f"the check of the {what}")
        if tracer is not None:
            tracer.collective("agree", t0, tracer.clock())
        errs = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
        vals = [v for _, v in gathered]
        if any(v != vals[0] for v in vals):
            errs.append(f"ranks disagree on the {what}: "
                        + ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals)))
        if errs:
            raise agreed(ValueError("; ".join(errs)))
    elif error:
        raise agreed(ValueError(error))
