"""Rank-side checks of issue 22 items 4 and 10 (tests/nn/test_global_agreement.py), float64, exact
MGRIT solves, against plain serial PyTorch loops on the same weights and global batches:

* item 4: a parameter frozen when the Trainer is built and unfrozen by a callback, and a
  parameter replaced (with a new optimizer) later, are averaged over the replicas: training
  equals the serial run and the replicas stay bitwise identical;
* item 10: ``clip_grad_norm_`` over the layer x data grid equals
  ``torch.nn.utils.clip_grad_norm_`` on the serial model (norms 2, 3 and inf; the Trainer's
  ``clip_grad_norm`` over several SGD-with-momentum steps), while the plain per-rank call
  does not.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.parallel import ProcessGrid, clip_grad_norm_
from mgrit.parallel.dataparallel import check_replicas_consistent
from mgrit.training import Trainer
from tests.mpi_cases.training.trainer_cases import _max_rel, _params, data, mgrit_net, serial_net

COMM = MPI.COMM_WORLD
N_LAYERS, LR = 6, 0.1
FROZEN = ("3.F.linear.weight", "7.bias")  # layer 2's weight, the closing layer's bias


def _named(net) -> dict:
    """Global name -> parameter on this rank (serial: the Sequential's own names)."""
    if isinstance(net, nn.Sequential):
        return dict(net.named_parameters())
    return dict(net.named_global_parameters())


def _shard(x, y, grid):
    idx = np.array_split(np.arange(len(y)), grid.data_size)[grid.data_rank]
    j = torch.as_tensor(idx)
    return x[j], y[j]


class _Unfreeze:
    """Unfreezes FROZEN after step ``at`` (the Trainer was built with them frozen)."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, trainer, rec):
        if trainer.steps_done == self.at:
            for name, p in _named(trainer.net).items():
                if name in FROZEN:
                    p.requires_grad_(True)


def _replace_closing(net, named):
    """A new closing weight Parameter (same values): the old one is no longer in the model."""
    closing = net[-1] if isinstance(net, nn.Sequential) else net.closing
    if closing is not None:
        closing.weight = nn.Parameter(closing.weight.detach().clone())


def check_buckets_follow_model(data_parallel: int) -> float:
    """Items 4 and 10 together: FROZEN frozen at build, unfrozen after step 1; after step 3
    the closing weight is replaced and a new optimizer made; 5 steps with global-norm
    clipping; equals the serial loop (same freeze/unfreeze/replace/clip) to 1e-10 and the
    replicas are bitwise identical; a replica perturbed afterwards makes Trainer.save raise on
    every rank."""
    grid = ProcessGrid(COMM, data_parallel=data_parallel)
    x, y = data(40)
    ref = serial_net(N_LAYERS)
    net = mgrit_net(grid.layer_comm, N_LAYERS, levels=1)  # exact in one (pipelined) sweep
    for m in (ref, net):
        for name, p in _named(m).items():
            if name in FROZEN:
                p.requires_grad_(False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9), grid,
                      callbacks=[_Unfreeze(1)], clip_grad_norm=0.3)
    norms = []
    for step in range(5):
        if step == 3:
            _replace_closing(net, None)
            _replace_closing(ref, None)
            trainer.optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
        b = slice(8 * step, 8 * step + 8)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x[b]), y[b]).backward()
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3))
        ref_opt.step()
        if step == 0:
            for name, p in _named(ref).items():
                if name in FROZEN:
                    p.requires_grad_(True)
        trainer.step(*_shard(x[b], y[b], grid))
        assert abs(trainer.grad_norm - want) <= 1e-12 * want, (step, trainer.grad_norm, want)
        assert want > 0.3, f"step {step}: norm {want} not clipped: the test cannot fail"
        norms.append(want)
    err = _max_rel(_params(net), _params(ref))
    assert err <= 1e-10, f"rank {COMM.rank}: {err}"
    check_replicas_consistent(net.parameters(), grid.data_comm, check_values=True)
    with torch.no_grad():  # a replica that drifted: the checkpoint refuses on every rank
        if grid.data_rank == 1:
            next(net.parameters()).add_(1e-3)
    try:
        trainer.save("/nonexistent-dir/never-written.pt")
    except ValueError as exc:
        assert "drifted" in str(exc) and "differ in values" in str(exc), str(exc)
    else:
        raise AssertionError("a drifted replica was saved")
    frozen_moved = [name for name, p in _named(net).items() if name in FROZEN]
    grid.free()
    return f"err {err:.1e}, norms {['%.3f' % n for n in norms]}, unfrozen here {frozen_moved}"


def check_clip_equals_serial(data_parallel: int) -> str:
    """One backward; clip_grad_norm_ (norms 2, 3, inf) on the grid == torch's on the serial
    model (gradients after clipping to 1e-12, norms to 1e-12 relative), every rank the same
    norm bits; the per-rank torch call gives different gradients (on more than 1 layer rank);
    a parameter replicated on every layer rank counts once; bad arguments raise the same
    ValueError on every rank."""
    grid = ProcessGrid(COMM, data_parallel=data_parallel)
    x, y = data(16)
    out = []
    for norm_type in (2.0, 3.0, math.inf):
        ref, net = serial_net(N_LAYERS), mgrit_net(grid.layer_comm, N_LAYERS)
        F.cross_entropy(ref(x), y).backward()
        xs, ys = _shard(x, y, grid)
        net.loss(net(xs), ys, F.cross_entropy).backward()
        for p in net.parameters():  # the data-parallel average (equal shards)
            grid.data_comm.Allreduce(MPI.IN_PLACE, p.grad.numpy())
            p.grad /= grid.data_size
        naive = {}  # copies for the plain per-rank torch call
        for n, p in _named(net).items():
            naive[n] = nn.Parameter(p.detach().clone())
            naive[n].grad = p.grad.clone()
        got = float(clip_grad_norm_(net, 0.05, grid, norm_type=norm_type))
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type))
        assert abs(got - want) <= 1e-12 * want and want > 0.05, (norm_type, got, want)
        assert len(set(COMM.allgather(got))) == 1, "ranks disagree on the norm"
        torch.nn.utils.clip_grad_norm_(list(naive.values()), 0.05, norm_type=norm_type)
        ref_g = dict(ref.named_parameters())
        worst = naive_err = 0.0
        for name, p in _named(net).items():
            r = ref_g[name].grad
            worst = max(worst, float((p.grad - r).abs().max() / r.abs().max()))
            naive_err = max(naive_err, float((naive[name].grad - r).abs().max() / r.abs().max()))
        assert worst <= 1e-12, (norm_type, worst)
        naive_err = COMM.allreduce(naive_err, op=MPI.MAX)
        if grid.layer_size > 1:
            assert naive_err > 1e-3, f"the per-rank clip agrees with serial ({naive_err})"
        else:  # one layer rank: the plain call is the global one
            assert naive_err <= 1e-12, naive_err
        out.append(f"p={norm_type}: {got:.4f} (per-rank clip off by {naive_err:.1e})")
    # a parameter on every layer rank with identical gradients (as a ParallelGRU's weights):
    # passed as replicated, it counts once
    ref, net = serial_net(N_LAYERS), mgrit_net(grid.layer_comm, N_LAYERS)
    F.cross_entropy(ref(x), y).backward()
    net.loss(net(xs), ys, F.cross_entropy).backward()
    for p in net.parameters():
        grid.data_comm.Allreduce(MPI.IN_PLACE, p.grad.numpy())
        p.grad /= grid.data_size
    shared, shared_ref = (nn.Parameter(torch.zeros(3)) for _ in range(2))
    shared.grad, shared_ref.grad = torch.full((3,), 0.25), torch.full((3,), 0.25)
    got = float(clip_grad_norm_([*net.parameters(), shared], 0.05, grid, replicated=[shared]))
    want = float(torch.nn.utils.clip_grad_norm_([*ref.parameters(), shared_ref], 0.05))
    assert abs(got - want) <= 1e-12 * want, ("replicated", got, want)
    assert torch.allclose(shared.grad, shared_ref.grad, rtol=1e-12, atol=0)
    bads = [((0.0, 2.0), "max_norm=0.0"), ((1.0, -1.0), "norm_type=-1.0")]
    if grid.layer_size > 1:
        bads.append(((1.0 + grid.layer_rank, 2.0), "disagree"))
    for bad, words in bads:
        try:
            clip_grad_norm_(net, bad[0], grid, norm_type=bad[1])
        except ValueError as exc:
            msg = str(exc)
        else:
            raise AssertionError(f"no error for {bad}")
        assert words in msg, msg
        assert len(set(COMM.allgather(msg))) == 1, msg
    grid.free()
    return "; ".join(out)
