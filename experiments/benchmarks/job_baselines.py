"""The strongest baselines for the job's classifier network ``[opening, N residual steps,
classifier]`` (``mgrit.models.build_model("resnet", ...)``), used by
``experiments/studies/time_to_accuracy.py`` (issue 34, items 2-3).

* :class:`LeanJob` -- serial: the residual body as :class:`mgrit.perf.lean.LeanResNet` (the
  lean loop, closed-form backward), the opening and classifier through autograd, and the
  job's optimizer (momentum SGD, ``foreach``) over all of them, the body's two stacked tensors
  included; ``compiled=True``: the body compiled in blocks (:func:`mgrit.perf.lean.
  compiled_body`). Same numbers as autograd of the ``nn.Sequential`` to round-off
  (``tests/experiments/test_strong_baselines.py``).
* :class:`TorchJobPipeline` -- the network cut in 2 stages (rank 0: opening + first half of
  the steps; rank 1: the rest + classifier), ``torch.distributed.pipelining``'s
  ``ScheduleGPipe`` or ``Schedule1F1B`` over gloo, ``M`` micro-batches (dividing the batch),
  cross-entropy averaged over the micro-batches (``scale_grads``: the batch mean).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from experiments import measure
from mgrit.grid import Partition
from mgrit.perf.lean import LeanResNet, compiled_body

from .torch_pipeline import rendezvous

__all__ = ["LeanJob", "TorchJobPipeline", "JOB_SCHEDULES", "pick_pipeline"]

JOB_SCHEDULES = ("GPipe", "1F1B")


class LeanJob:
    """Serial training of ``net`` (trained in place through the lean copy of its body; the
    body's modules get the weights back at :meth:`model`)."""

    def __init__(self, net: nn.Sequential, lr: float, momentum: float, compiled: bool = False,
                 block: int = 64, backend: str = "inductor"):
        mods = list(net)
        self.net, self.open, self.close = net, mods[0], mods[-1]
        self.body = nn.Sequential(*mods[1:-1])
        self.lean = lean = LeanResNet.from_sequential(self.body)
        lean.WT.grad, lean.b.grad = lean.gWT, lean.gb  # views of grad_flat
        self.small = [*self.open.parameters(), *self.close.parameters()]
        self.opt = torch.optim.SGD([*self.small, lean.WT, lean.b], lr=lr, momentum=momentum,
                                   foreach=True)
        self.fb = compiled_body(lean, min(block, lean.n_layers), backend) if compiled else None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for p in self.small:
            p.grad = None
        h0 = self.open(x)
        if self.fb is None:
            u = self.lean.forward_store(h0.detach()).clone()
        else:
            u, saved = self.fb[0](h0.detach())
        u = u.detach().requires_grad_()
        F.cross_entropy(self.close(u), y).backward()
        g = (self.lean.backward(u.grad) if self.fb is None else self.fb[1](u.grad, saved))
        h0.backward(g)
        self.opt.step()

    def model(self) -> nn.Sequential:
        """The ``nn.Sequential`` with the lean body's current weights copied in."""
        W, b = self.lean.weights()
        with torch.no_grad():
            for k, layer in enumerate(self.body):
                layer.F.linear.weight.copy_(W[k])
                layer.F.linear.bias.copy_(b[k])
        return self.net


class TorchJobPipeline:
    """2-stage pipelined training of ``net`` (every rank builds the same ``net``; each keeps
    its stage). ``schedule``: ``"GPipe"`` or ``"1F1B"``; ``M`` must divide ``batch``."""

    def __init__(self, net: nn.Sequential, n_layers: int, world, schedule: str, M: int,
                 batch: int, lr: float, momentum: float):
        if schedule not in JOB_SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not allowed: use one of "
                             f"{list(JOB_SCHEDULES)}")
        if not (isinstance(M, int) and M >= 1 and batch % M == 0):
            raise ValueError(f"M={M!r} must be an int >= 1 dividing the batch {batch}")
        if world.Get_size() != 2:
            raise ValueError(f"TorchJobPipeline runs on 2 ranks, got {world.Get_size()}")
        import torch.distributed.pipelining as pp
        rendezvous(world)
        self.world, self.rank, self.net = world, world.Get_rank(), net
        mods = list(net)
        a, e = Partition.even(n_layers, 2).block(self.rank)
        mine = mods[:1 + min(e, n_layers)] if self.rank == 0 else mods[1 + a:]
        self.stage = nn.Sequential(*mine)
        st = pp.PipelineStage(self.stage, self.rank, 2, torch.device("cpu"))
        cls = pp.ScheduleGPipe if schedule == "GPipe" else pp.Schedule1F1B
        self.schedule = cls(st, n_microbatches=M, loss_fn=F.cross_entropy, scale_grads=True)
        self.opt = torch.optim.SGD(self.stage.parameters(), lr=lr, momentum=momentum,
                                   foreach=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y)
        self.opt.step()

    def model(self):
        """Rank 1's stage parameters sent to rank 0 (one broadcast of a flat vector); rank 0
        returns the whole network, rank 1 None (collective)."""
        mine = list(self.stage.parameters())
        n = self.world.bcast(sum(p.numel() for p in mine) if self.rank == 1 else None, root=1)
        flat = (nn.utils.parameters_to_vector(mine).detach() if self.rank == 1
                else torch.empty(n))
        self.world.Bcast(flat.numpy(), root=1)
        if self.rank == 0:
            ids = {id(p) for p in mine}
            theirs = [p for p in self.net.parameters() if id(p) not in ids]
            with torch.no_grad():
                nn.utils.vector_to_parameters(flat, theirs)
            return self.net
        return None


def pick_pipeline(make, micro, batch: int, data, world, reps: int = 3) -> tuple:
    """``((schedule, M), {(schedule, M): median seconds or "refused: ..."})``: ``make((schedule,
    M))`` builds a :class:`TorchJobPipeline`; one untimed and ``reps`` timed steps (max over the
    ranks) on the first training batch of ``data``, over :data:`JOB_SCHEDULES` x the M of
    ``micro`` dividing ``batch``; the fastest median wins. A candidate the schedule refuses
    (1F1B: M < 2; the same ValueError on every rank, before any message) is reported."""
    times = {}
    x, y = data[0][:batch], data[1][:batch]
    for cand in [(s, M) for s in JOB_SCHEDULES for M in micro if batch % M == 0]:
        try:
            p = make(cand)
        except ValueError as e:
            times[cand] = f"refused: {str(e)[:80]}"
            continue
        p.step(x, y)
        ts = sorted(measure.clock(lambda: p.step(x, y), world)[0] for _ in range(reps))
        times[cand] = ts[len(ts) // 2]
    ok = {k: t for k, t in times.items() if not isinstance(t, str)}
    return min(ok, key=ok.get), times
