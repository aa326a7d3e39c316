"""Parameter-level ties across ranks (``LayerParallelResNet(tie={"lin.weight": ...})``), run on
k ranks by tests/nn/test_ptied_mpi.py (float64, exact mode: solves to 1e-13).

Reference: an independently built serial ``nn.Sequential``: each layer's step made by its own
seed (:func:`~mgrit.nn.layer_seed`, as ``build`` does), then the tied parameters of the later
layers of a group replaced by the group's first layer's ``Parameter`` object (the way a PyTorch
user writes ``F_k(x) = tanh(W x + b_k)``), trained by plain serial autograd with the same
optimizer. Each rank compares its parts by global key: loss and output (last layer rank),
every gradient (a tied parameter's is the full serial gradient on every holder), parameters
after 3 SGD-momentum steps, replicas bit for bit across ranks, the clipped gradients of
``clip_grad_norm_(net, ...)``.
"""
import copy
import hashlib
import os

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import LayerParallelNet, LayerParallelResNet, ResidualStep, layer_seed
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid, clip_grad_norm_
from mgrit.training.checkpoint import load_checkpoint, save_checkpoint

COMM = MPI.COMM_WORLD
DT = torch.float64
W, N, B, T = 4, 7, 5, 1.3


class Shared(nn.Module):
    """``tanh(W x + b)`` and a per-layer gain: the step of a neural ODE with a time-invariant
    weight (tied) and time-dependent bias and gain (owned)."""

    def __init__(self, width=W):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return self.gain * torch.tanh(self.lin(x))


TIES = {
    # every layer shares lin.weight, owns lin.bias and gain
    "ode": {"lin.weight": lambda k: 0},
    # a whole-step group (layers 0, 1), lin.weight shared by the rest, lin.bias in pairs, a
    # sequence of keys for gain (layers 2 and 6 share it), the others untied
    "mixed": {"": [0, 0, None, None, None, None, None],
              "lin.weight": lambda k: None if k < 2 else "w",
              "lin.bias": lambda k: None if k < 2 else k // 2,
              "gain": [None, None, "g", None, None, None, "g"]},
}


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _opts(levels, batched=True):
    return MGRITOptions(max_levels=levels, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80,
                        batched=batched)


def _make(k):
    return Shared().to(DT)


def _keys(spec, k):
    v = spec
    return v(k) if callable(v) else v[k]


def serial_steps(tie, seed=0):
    """The reference steps, built and tied by hand (see the module docstring)."""
    steps = []
    for k in range(N):
        torch.manual_seed(layer_seed(seed, k))
        steps.append(_make(k))
    for path, spec in tie.items():
        first = {}
        for k in range(N):
            key = _keys(spec, k)
            if key is None or sum(_keys(spec, j) == key for j in range(N)) < 2:
                continue
            k0 = first.setdefault(key, k)
            if k0 == k:
                continue
            if path == "":
                steps[k] = steps[k0]
            else:
                owner, _, leaf = path.rpartition(".")
                setattr(steps[k].get_submodule(owner), leaf, steps[k0].get_parameter(path))
    return copy.deepcopy(steps)  # one memo: ties kept


def _nets(kind, levels, batched=True, comm=COMM):
    tie = TIES[kind]
    torch.manual_seed(11)
    opening, closing = nn.Linear(3, W).to(DT), nn.Linear(W, 2).to(DT)
    ref = serial_steps(tie)
    serial = nn.Sequential(copy.deepcopy(opening), *[ResidualStep(s, T / N) for s in ref],
                           copy.deepcopy(closing))
    seg = LayerParallelResNet.build(_make, N, (W,), comm=comm, T=T, tie=tie,
                                    forward=_opts(levels, batched),
                                    backward=_opts(levels, batched))
    return LayerParallelNet(opening, seg, closing), serial


def _digests(net) -> dict:
    return {k: hashlib.sha1(p.detach().numpy().tobytes()).hexdigest()
            for k, p in net.named_global_parameters()}


def _replicas_equal(net, comm=COMM):
    seen = {}
    for r, d in enumerate(comm.allgather(_digests(net))):
        for key, h in d.items():
            r0, h0 = seen.setdefault(key, (r, h))
            assert h == h0, f"{key}: replicas on ranks {r0} and {r} differ"
    net.segments[0].check_tied_replicas()


def check_ptied(kind, levels, batched=True, steps=3, clip=False):
    """Loss, output, gradients (optionally clipped by the README's call) and parameters after
    ``steps`` SGD-momentum steps vs serial; replicas bitwise equal; the optimizer sees each
    shared parameter once."""
    net, serial = _nets(kind, levels, batched)
    x, y = _rand(B, 3, seed=2), torch.tensor([0, 1, 1, 0, 1])
    assert len(list(serial.parameters())) < sum(1 for _ in serial.named_parameters(
        remove_duplicate=False)), "the reference is not tied"
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    sopt = torch.optim.SGD(serial.parameters(), lr=0.2, momentum=0.9)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)), "the optimizer holds a parameter twice"
    sp = dict(serial.named_parameters(remove_duplicate=False))
    seg = net.segments[0]
    if seg._tied is not None and len(seg.steps) > 1:  # a shared parameter, one object here
        if batched and levels > 1:  # the stacked path takes a shared parameter (one row each)
            assert seg.batching_obstacle is None, seg.batching_obstacle
        ids = [id(p) for s in seg.steps for p in s.parameters()]
        assert len(set(ids)) < len(ids), "no parameter shared between this rank's layers"
    worst = 0.0
    for step in range(steps):
        opt.zero_grad()
        sopt.zero_grad()
        out = net(x)
        loss = net.loss(out, y)
        loss.backward()
        sout = serial(x)
        sloss = F.cross_entropy(sout, y)
        sloss.backward()
        if clip:
            n = float(clip_grad_norm_(net, 0.05, COMM))
            s = float(torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.05))
            assert abs(n - s) <= 1e-10 * max(1.0, s), f"norm {n} vs serial {s}"
        if net.is_last:
            worst = max(worst, _rel(out, sout), abs(loss.item() - sloss.item()) / sloss.item())
        for key, p in net.named_global_parameters():
            assert p.grad is not None, f"{key}: no gradient"
            e = _rel(p.grad, sp[key].grad)
            assert e < 1e-10, f"step {step} {kind} L{levels}: gradient of {key} off by {e:.2e}"
            worst = max(worst, e)
        opt.step()
        sopt.step()
    for key, p in net.named_global_parameters():
        e = _rel(p, sp[key])
        assert e < 1e-10, f"{kind}: parameter {key} after {steps} steps off by {e:.2e}"
        worst = max(worst, e)
    _replicas_equal(net)
    ser2 = net.to_serial()  # to_serial keeps the ties (one Parameter per group)
    s2 = dict(ser2.named_parameters(remove_duplicate=False))
    for key, p in sp.items():
        assert torch.equal(s2[key], p.detach()) or _rel(s2[key], p) < 1e-10, key
    assert len(list(ser2.parameters())) == len(list(serial.parameters()))
    worst = COMM.allreduce(worst, op=MPI.MAX)
    return f"{worst:.1e}"


def _block(comm=COMM):
    from mgrit.grid import Partition
    a, b = Partition.even(N, comm.Get_size()).block(comm.Get_rank())
    return a, min(b, N)


def check_errors():
    """Bad specs: one ValueError on every rank naming the problem (constructor and build)."""
    a, b = _block()
    P = COMM.Get_size()
    own = [_make(k) for k in range(a, b)]
    cases = [
        ("build", {"lin.wieght": lambda k: 0}, ("'lin.wieght'", "names no parameter")),
        ("build", {"lin": lambda k: 0}, ("'lin'", "submodule", "'lin.weight'")),
        ("build", {1: lambda k: 0}, ("tie path 1",)),
        ("build", {"lin..weight": lambda k: 0}, ("'lin..weight'",)),
        ("build", {"": lambda k: 0, "lin.weight": lambda k: 0}, ("'' and 'lin.weight'",)),
        ("build", {"lin.weight": [0, 0]}, ("tie['lin.weight'] has 2 entries",)),
        ("build", {"gain": lambda k: []}, ("not hashable",)),
        ("ctor", {"lin.weight": lambda k: 0}, ("different Parameter objects",)),
    ]
    # one shared bias, declared nowhere (weight declared): undeclared sharing
    bias = nn.Parameter(torch.zeros(W, dtype=DT))

    def undeclared():
        steps = [_make(k) for k in range(a, b)]
        w = steps[0].lin.weight
        for s in steps:
            s.lin.weight, s.lin.bias = w, bias
        return steps
    cases.append(("steps", undeclared, ("share the parameter 'lin.bias'", "tie")))
    if P > 1:
        def other_shape():  # the replicas of a group have another shape on the last rank
            width = 2 if COMM.Get_rank() == P - 1 else 3
            steps = [Shared(W).to(DT) for _ in range(a, b)]
            g = nn.Parameter(torch.ones(width, 1, dtype=DT))
            for s in steps:
                s.extra = g
            return steps
        cases.append(("steps-extra", other_shape, ("different parameters", "extra")))
    msgs = []
    for how, tie, words in cases:
        try:
            if how == "build":
                LayerParallelResNet.build(_make, N, (W,), comm=COMM, tie=tie)
            elif how == "ctor":
                LayerParallelResNet(own, N, (W,), comm=COMM, tie=tie)
            elif how == "steps":
                LayerParallelResNet(tie(), N, (W,), comm=COMM, tie={"lin.weight": lambda k: 0})
            else:
                LayerParallelResNet(tie(), N, (W,), comm=COMM, tie={"extra": lambda k: 0})
        except ValueError as e:
            for w in words:
                assert w in str(e), (w, str(e))
            msgs.append(str(e))
            continue
        if how == "ctor" and b - a < 2:
            continue  # one layer here: nothing to compare on this rank; another rank raises
        raise AssertionError(f"no ValueError for {how} {words}")
    gathered = COMM.allgather(msgs)
    assert all(m == gathered[0] for m in gathered), "ranks raised different messages"
    # a tied parameter replaced on one layer after construction: the next forward is refused
    for levels in (1, 2):
        net, _ = _nets("ode", levels)
        seg = net.segments[0]
        if COMM.Get_rank() == COMM.Get_size() - 1:
            seg.steps[-1].lin.weight = nn.Parameter(seg.steps[-1].lin.weight.detach().clone())
        try:
            net(_rand(B, 3, seed=1))
        except ValueError as e:
            assert "replaced on some of its layers" in str(e), str(e)
        else:
            raise AssertionError("a broken tie accepted")
    # a state dict giving tied parameters different values is refused
    net, _ = _nets("ode", 2)
    state = net.gather_state_dict()
    if state is not None:
        state = dict(state)
        state["3.F.lin.weight"] = state["3.F.lin.weight"] + 1.0
    try:
        net.load_global_state_dict(state)
    except ValueError as e:
        assert "weight-tied" in str(e) and "3.F.lin.weight" in str(e), str(e)
    else:
        raise AssertionError("conflicting tied values accepted")
    return len(msgs)


def check_checkpoint(kind="mixed"):
    """Save on 2 ranks after 2 steps (momentum), load on every rank: the same weights and
    optimizer state; the file holds one copy of each tied parameter, one per owned one."""
    import tempfile
    path = COMM.bcast(os.path.join(tempfile.mkdtemp(prefix="layerpar-ptied-")
                                   if COMM.Get_rank() == 0 else "", "ckpt.pt"), root=0)
    small = COMM.Split(0 if COMM.Get_rank() < 2 else MPI.UNDEFINED, COMM.Get_rank())
    x, y = _rand(B, 3, seed=9), torch.tensor([0, 1, 1, 0, 1])
    state = None
    if small != MPI.COMM_NULL:
        net, _ = _nets(kind, 2, comm=small)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            net.loss(net(x), y).backward()
            opt.step()
        save_checkpoint(path, net, opt, ProcessGrid(small))
        state = net.gather_state_dict()
        mom = {}
        for part in small.allgather({k: opt.state[p]["momentum_buffer"]
                                     for k, p in net.named_global_parameters()}):
            mom.update(part)
        state = (state, mom)
        small.Free()
    state, saved_mom = COMM.bcast(state, root=0)
    net, serial = _nets(kind, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    load_checkpoint(path, net, opt, ProcessGrid(COMM))
    _replicas_equal(net)
    for key, p in net.named_global_parameters():
        assert torch.equal(p.detach(), state[key]), f"{key} differs after loading"
        assert torch.equal(opt.state[p]["momentum_buffer"], saved_mom[key]), f"{key}: momentum"
    if COMM.Get_rank() == 0:
        m = torch.load(path, weights_only=True)["model"]
        sp = dict(serial.named_parameters(remove_duplicate=False))
        # keys of one serial Parameter <-> one stored tensor
        groups = {}
        for key, p in sp.items():
            groups.setdefault(id(p), set()).add(m[key].untyped_storage().data_ptr())
        assert all(len(v) == 1 for v in groups.values()), "tied copies saved"
        stored = {m[key].untyped_storage().data_ptr() for key in sp}
        assert len(stored) == len(groups), (len(stored), len(groups))
        os.remove(path)
        os.rmdir(os.path.dirname(path))
    return "ok"


def check_with_replicas():
    """2 layer ranks x 2 data-parallel replicas in the Trainer: parameters after 3 steps equal
    serial full-batch training; replicas of tied parameters stay bitwise equal."""
    from mgrit.training import Trainer
    grid = ProcessGrid(data_parallel=2)
    net, serial = _nets("ode", 2, comm=grid.layer_comm)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9), grid)
    sopt = torch.optim.SGD(serial.parameters(), lr=0.2, momentum=0.9)
    x, y = _rand(8, 3, seed=4), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
    half = slice(4 * grid.data_rank, 4 * grid.data_rank + 4)
    for _ in range(3):
        trainer.step(x[half], y[half], weight=0.5)
        sopt.zero_grad()
        F.cross_entropy(serial(x), y).backward()
        sopt.step()
    sp = dict(serial.named_parameters(remove_duplicate=False))
    worst = max(_rel(p, sp[k]) for k, p in net.named_global_parameters())
    worst = grid.comm.allreduce(worst, op=MPI.MAX)
    _replicas_equal(net, grid.layer_comm)
    assert worst < 1e-10, worst
    return f"{worst:.1e}"
