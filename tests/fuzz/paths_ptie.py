"""The ``ptie`` path program (issue 36 item 14): parameter-level ties across ranks,
``LayerParallelResNet.build(..., tie={"lin.weight": ...})``, against an independently tied
serial network in float64 (relative ``1e-9``).

A program draws a step class, a random tie spec (per tieable parameter: untied, one group for
every layer, blocks of ``m`` consecutive layers, or random keys from a small alphabet with
``None``; sometimes a whole-step group ``""`` on some layers, the parameter paths then untied
there), the MGRIT levels and the batched or per-layer path, an optimizer (SGD with momentum or
Adam) and 1-3 steps, optionally the README's ``clip_grad_norm_(net, max_norm, comm)``, a
checkpoint saved and loaded into a net built with other weights (one stored copy per serial
``Parameter``), and two data-parallel replicas in the ``Trainer`` (even rank counts). Checked
after every step on every rank: each parameter and its gradient by global key against the
serial twin, the replicas of every tie group bitwise equal (``check_tied_replicas``).
"""
from __future__ import annotations

import copy
import os
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

from mgrit.nn import LayerParallelNet, LayerParallelResNet, ResidualStep, layer_seed
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid, clip_grad_norm_

DT = torch.float64
TOL = 1e-9


class GainStep(nn.Module):
    """``gain * tanh(lin(x))``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x):
        return self.gain * torch.tanh(self.lin(x))


class TwoStep(nn.Module):
    """``gain * tanh(b(tanh(a(x))))``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x):
        return self.gain * torch.tanh(self.b(torch.tanh(self.a(x))))


STEPS = {"gain": (GainStep, ["lin.weight", "lin.bias", "gain"]),
         "two": (TwoStep, ["a.weight", "a.bias", "b.weight", "b.bias", "gain"])}


def generate(c, p: dict) -> dict:
    """The ``ptie`` parameters (``p``: seed, layers, levels already drawn)."""
    n = p["layers"]
    step = c.pick(list(STEPS))
    whole = [None] * n
    if c.bool(0.3):
        whole = [c.pick([None, "m", "n"]) for _ in range(n)]
    keys = {}
    for path in STEPS[step][1]:
        kind = c.pick(["none", "all", "all", "blocks", "random"])
        if kind == "none":
            continue
        if kind == "all":
            seq = [0] * n
        elif kind == "blocks":
            m = c.int(2, 3)
            seq = [k // m for k in range(n)]
        else:
            seq = [c.pick([None, 0, 1]) for _ in range(n)]
        keys[path] = [None if whole[k] is not None else seq[k] for k in range(n)]
    if any(w is not None for w in whole):
        keys[""] = whole
    return dict(step=step, tie=keys, batched=c.bool(0.7), opt=c.pick(["sgd", "adam"]),
                steps=c.int(1, 3), clip=c.bool(0.3), ckpt=c.bool(0.3), dp=c.bool(0.3))


def serial_steps(make, n: int, tie: dict, seed: int) -> list:
    """Each layer's step by its own seed, then tied by hand: the later layers of a group take
    the first layer's module (``""``) or ``Parameter`` object."""
    steps = []
    for k in range(n):
        torch.manual_seed(layer_seed(seed, k))
        steps.append(make(k))
    for path, keys in tie.items():
        first = {}
        for k, key in enumerate(keys):
            if key is None or keys.count(key) < 2:
                continue
            k0 = first.setdefault(key, k)
            if k0 == k:
                continue
            if path == "":
                steps[k] = steps[k0]
            else:
                owner, _, leaf = path.rpartition(".")
                setattr(steps[k].get_submodule(owner), leaf, steps[k0].get_parameter(path))
    return copy.deepcopy(steps)


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def _nets(p, comm, seed):
    cls = STEPS[p["step"]][0]
    make = lambda k: cls().to(DT)  # noqa: E731
    n = p["layers"]
    o = MGRITOptions(max_levels=p["levels"], cfactor=2, min_coarse=1, tol=1e-13, max_iter=80,
                     batched=p["batched"])
    torch.manual_seed(seed)
    op, cl = nn.Linear(2, 3).to(DT), nn.Linear(3, 3).to(DT)
    ser = nn.Sequential(copy.deepcopy(op),
                        *[ResidualStep(s, 1.0 / n) for s in serial_steps(make, n, p["tie"], seed)],
                        copy.deepcopy(cl))
    seg = LayerParallelResNet.build(make, n, (3,), comm=comm, seed=seed, tie=p["tie"], T=1.0,
                                    forward=o, backward=o)
    return LayerParallelNet(op, seg, cl), ser


def _compare(net, ser, what, grads=True) -> None:
    ref = dict(ser.named_parameters(remove_duplicate=False))
    for key, q in net.named_global_parameters():
        e = _rel(q, ref[key])
        assert e <= TOL, f"{what}: parameter {key} off by {e:.2e}"
        if grads and ref[key].grad is not None:
            assert q.grad is not None, f"{what}: {key} has no .grad"
            e = _rel(q.grad, ref[key].grad)
            assert e <= TOL, f"{what}: {key}.grad off by {e:.2e}"
    net.segments[0].check_tied_replicas()


def _optimizer(p, params):
    if p["opt"] == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def path_ptie(p, comm):
    from mgrit.training import Trainer
    from mgrit.training.checkpoint import load_checkpoint, save_checkpoint
    dp = 2 if p["dp"] and comm.size % 2 == 0 else 1
    grid = ProcessGrid(comm, data_parallel=dp)
    net, ser = _nets(p, grid.layer_comm, p["seed"])
    opt, sopt = _optimizer(p, net.parameters()), _optimizer(p, ser.parameters())
    ids = [id(q) for g in opt.param_groups for q in g["params"]]
    assert len(ids) == len(set(ids)), "the optimizer holds a parameter twice"
    g = torch.Generator().manual_seed(p["seed"])
    batches = [(torch.randn(6, 2, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g))
               for _ in range(p["steps"] + 1)]
    state = {"net": net, "opt": opt, "trainer": Trainer(net, opt, grid) if dp > 1 else None}
    part = slice(3 * grid.data_rank, 3 * grid.data_rank + 3)

    def step(i, x, y):
        net, opt, trainer = state["net"], state["opt"], state["trainer"]
        sopt.zero_grad()
        F.cross_entropy(ser(x), y).backward()
        if trainer is not None:  # the replicas' halves, averaged: the full-batch gradient
            trainer.step(x[part], y[part], weight=0.5)
        else:
            opt.zero_grad()
            net.loss(net(x), y).backward()
            _compare(net, ser, f"gradients of step {i}")
            if p["clip"]:  # the README's call: the network says what it shares
                n = float(clip_grad_norm_(net, 0.05, grid.layer_comm))
                s = float(torch.nn.utils.clip_grad_norm_(ser.parameters(), 0.05))
                assert abs(n - s) <= TOL * max(1.0, s), f"clip norm {n} vs serial {s}"
                _compare(net, ser, f"clipped gradients of step {i}")
            opt.step()
        sopt.step()
        _compare(net, ser, f"after step {i}", grads=False)

    for i, (x, y) in enumerate(batches[:-1]):
        step(i, x, y)
    if p["ckpt"]:
        d = comm.bcast(tempfile.mkdtemp(prefix="fuzz-ptie-") if comm.rank == 0 else None)
        path = os.path.join(d, "ck.pt")
        save_checkpoint(path, state["net"], state["opt"], grid)
        net, _ = _nets(p, grid.layer_comm, p["seed"] + 7)  # other weights, then loaded
        opt = _optimizer(p, net.parameters())
        state.update(net=net, opt=opt, trainer=Trainer(net, opt, grid) if dp > 1 else None)
        load_checkpoint(path, net, opt, grid)
        _compare(net, ser, "loaded", grads=False)
        if comm.rank == 0:
            m = torch.load(path, weights_only=True)["model"]
            copies = {}
            for key, q in ser.named_parameters(remove_duplicate=False):
                copies.setdefault(id(q), set()).add(m[key].untyped_storage().data_ptr())
            assert all(len(v) == 1 for v in copies.values()), "a tied parameter saved twice"
            os.remove(path)
            os.rmdir(d)
    step(p["steps"], *batches[-1])
