"""Pipelining as a PyTorch user picks it: ``torch.distributed.pipelining`` over the gloo
backend, on the ranks of an mpi4py job (issue 34, item 2).

* :func:`rendezvous` -- ``torch.distributed.init_process_group("gloo")`` with the env
  rendezvous taken from MPI (``MASTER_ADDR`` 127.0.0.1 unless set, ``MASTER_PORT`` a free port
  chosen by rank 0 and broadcast, ``RANK``/``WORLD_SIZE`` from the communicator); idempotent.
* :class:`StackedStage` -- a block of dense tanh residual layers as an ``nn.Module`` with
  stacked parameters ``WT (n, w, w)`` (in x out) and ``b (n, w)``, unbound once per forward
  (autograd's stack backward: one gradient tensor per name, no per-layer ``.grad``).
* :class:`TorchPipeline` -- the network of a :class:`~mgrit.perf.lean.LeanResNet` cut into
  stages, one schedule of :data:`SCHEDULES` (``ScheduleGPipe``, ``Schedule1F1B``: one stage per
  rank; ``ScheduleInterleavedZeroBubble`` (zero bubble, interleaved: stages ``r, r + P``) and
  ``ScheduleZBVZeroBubble`` (zero bubble, V: stages ``r, 2P - 1 - r``): two per rank), ``M``
  micro-batches, the optimizer of :mod:`experiments.benchmarks.strong_baselines` per rank.
  Loss ``mean(out^2)`` over the global batch (each micro-batch's loss scaled by its share).
* :func:`pick_micro_batches` -- the micro-batch count by median step time over candidates
  (all of them reported).

Gradients equal serial autograd's (``tests/experiments/test_strong_baselines.py``).
"""
from __future__ import annotations

import os
import socket
import statistics
import time

import torch
from torch import nn

from .strong_baselines import optimizer

__all__ = ["SCHEDULES", "rendezvous", "StackedStage", "TorchPipeline", "pick_micro_batches",
           "available"]

#: name -> (torch class name, stages per rank, layout)
SCHEDULES = {"GPipe": ("ScheduleGPipe", 1, "loop"),
             "1F1B": ("Schedule1F1B", 1, "loop"),
             "ZB-interleaved": ("ScheduleInterleavedZeroBubble", 2, "loop"),
             "ZBV": ("ScheduleZBVZeroBubble", 2, "v")}


def available() -> tuple[bool, str]:
    """``(True, torch version)`` when ``torch.distributed.pipelining`` and gloo import here,
    else ``(False, reason)``."""
    try:
        import torch.distributed as dist
        import torch.distributed.pipelining  # noqa: F401
        if not dist.is_gloo_available():
            return False, "gloo is not built into this torch"
    except ImportError as e:
        return False, f"torch.distributed.pipelining: {e}"
    return True, torch.__version__


def rendezvous(comm) -> None:
    """Initializes torch.distributed (gloo) on the ranks of ``comm`` (collective; a no-op when
    already initialized with ``comm``'s size)."""
    import torch.distributed as dist
    if dist.is_initialized():
        if dist.get_world_size() != comm.Get_size():
            raise RuntimeError(f"torch.distributed is initialized with world size "
                               f"{dist.get_world_size()}, the communicator has {comm.Get_size()}")
        return
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(comm.Get_rank()), str(comm.Get_size())
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())


class StackedStage(nn.Module):
    """Layers ``x <- x + h tanh(x WT_k + b_k)`` with stacked parameters (copied from
    ``WT (n, w, w)``, ``b (n, w)``)."""

    def __init__(self, WT: torch.Tensor, b: torch.Tensor, h: float):
        super().__init__()
        self.WT = nn.Parameter(WT.detach().clone())
        self.b = nn.Parameter(b.detach().clone())
        self.h = float(h)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        h = self.h
        for WT, b in zip(self.WT.unbind(0), self.b.unbind(0)):
            u = u + h * torch.tanh(torch.addmm(b, u, WT))
        return u


def _stage_ids(layout: str, per: int, P: int, rank: int) -> list:
    if per == 1:
        return [rank]
    return [rank, 2 * P - 1 - rank] if layout == "v" else [rank + P * i for i in range(per)]


class TorchPipeline:
    """One pipelined training step per :meth:`step` (collective over ``comm``'s ranks).

    Args:
        lean: the whole network (every rank passes the same weights; each keeps its stages').
        comm: mpi4py communicator (its ranks become torch.distributed's, gloo).
        schedule: a key of :data:`SCHEDULES`.
        micro_batches: ``M`` (must divide the batch; the zero-bubble schedules may need more:
            torch raises its own error).
        batch: the global batch size.
        kind, lr, momentum: the optimizer (:func:`strong_baselines.optimizer`).

    Raises:
        ValueError: unknown schedule, ``M`` not dividing the batch, or fewer layers than
            stages.
    """

    def __init__(self, lean, comm, schedule: str, micro_batches: int, batch: int,
                 kind: str = "sgd", lr: float = 1e-3, momentum: float = 0.9):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not allowed: use one of "
                             f"{list(SCHEDULES)}")
        if not (isinstance(micro_batches, int) and micro_batches >= 1
                and batch % micro_batches == 0):
            raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1 dividing "
                             f"the batch {batch}")
        import torch.distributed.pipelining as pp
        cls_name, per, layout = SCHEDULES[schedule]
        P, rank = comm.Get_size(), comm.Get_rank()
        n_st = per * P
        N = lean.n_layers
        if N < n_st:
            raise ValueError(f"{N} layers cannot fill {n_st} stages")
        rng = [(N * i) // n_st for i in range(n_st + 1)]
        rendezvous(comm)
        self.comm, self.batch, self.ids = comm, batch, _stage_ids(layout, per, P, rank)
        self.n_stages, self.bounds = n_st, rng
        self.modules = [StackedStage(lean.WT[rng[i]:rng[i + 1]], lean.b[rng[i]:rng[i + 1]],
                                     lean.h) for i in self.ids]
        stages = [pp.PipelineStage(m, i, n_st, torch.device("cpu"))
                  for m, i in zip(self.modules, self.ids)]
        numel = batch * lean.width
        loss = lambda out, target: out.pow(2).sum() * (1.0 / numel)  # noqa: E731 (global mean)
        cls = getattr(pp, cls_name)
        self.schedule = cls(stages[0] if per == 1 else stages, n_microbatches=micro_batches,
                            loss_fn=loss, scale_grads=False)
        self.opt = optimizer([p for m in self.modules for p in m.parameters()], kind, lr,
                             momentum)
        self.first, self.last = 0 in self.ids, n_st - 1 in self.ids
        self._target = None

    def step(self, x: torch.Tensor) -> None:
        """One training step on the global batch ``x`` (read on the rank of the first stage)."""
        self.opt.zero_grad(set_to_none=True)
        if self.last and self._target is None:
            self._target = torch.zeros(self.batch, x.shape[1], dtype=x.dtype)
        kw = {"target": self._target} if self.last else {}
        if self.first:
            self.schedule.step(x, **kw)
        else:
            self.schedule.step(**kw)
        self.opt.step()

    def gradients(self) -> dict:
        """``{stage id: (dWT, db)}`` of this rank's stages (after :meth:`step` without the
        update: for tests, build with ``lr=0``)."""
        return {i: (m.WT.grad, m.b.grad) for i, m in zip(self.ids, self.modules)}


def pick_micro_batches(make, candidates, comm, reps: int = 3) -> tuple[int, dict]:
    """``(M, {M: median seconds})``: ``make(M)`` builds a pipeline, one untimed step, then
    ``reps`` timed steps (max over the ranks, after a barrier); the candidate with the lowest
    median wall time wins (ties: the smaller M). A candidate the schedule refuses is reported
    as its error's first line (``{M: "ValueError: ..."}``), agreed over the ranks."""
    from mpi4py import MPI
    x = None
    times = {}
    for M in candidates:
        try:
            pipe = make(M)
            err = None
        except (ValueError, RuntimeError) as e:
            pipe, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        errs = [e for e in comm.allgather(err) if e]
        if errs:
            times[M] = errs[0]
            continue
        if x is None:
            x = torch.randn(pipe.batch, pipe.modules[0].WT.shape[1])
        pipe.step(x)
        ts = []
        for _ in range(reps):
            comm.Barrier()
            t0 = time.perf_counter()
            pipe.step(x)
            ts.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        times[M] = statistics.median(ts)
    ok = {m: t for m, t in times.items() if not isinstance(t, str)}
    if not ok:
        raise RuntimeError(f"no micro-batch count ran: {times}")
    return min(ok, key=lambda m: (ok[m], m)), times
