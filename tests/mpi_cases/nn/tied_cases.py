"""Weight-tied layers across ranks (``LayerParallelResNet(tie=...)``), run on k ranks by
tests/nn/test_tied_mpi.py (float64, exact mode: solves to 1e-13).

Reference: an independently built serial ``nn.Sequential`` with the same tied module(s) (one
module object per group, as a PyTorch user writes it) and the same opening/closing weights,
trained with the same optimizer by plain serial autograd. Each rank compares its parts by
global key: loss and output (last layer rank), every gradient it holds (a tied parameter's
gradient must be the full serial one on every holder), the parameters after several optimizer
steps, and the replicas of each tie group bit for bit across ranks.
"""
import copy
import hashlib
import os

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, ResidualStep, TransformerStep
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid
from mgrit.training.checkpoint import load_checkpoint, save_checkpoint

COMM = MPI.COMM_WORLD
DT = torch.float64
W, N, B, T = 4, 7, 5, 1.3


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _opts(levels, batched=True):
    return MGRITOptions(max_levels=levels, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80,
                        batched=batched)


def _case(kind):
    """``(make_step, tie, serial layers, state shape, input)``: the serial layers are built
    independently (one module object per group)."""
    if kind == "one":  # every layer uses one module made outside make_step (a neural ODE)
        torch.manual_seed(3)
        shared = DenseStep(W, "tanh").to(DT)
        ref = copy.deepcopy(shared)
        return (lambda k: shared), (lambda k: 0), [ref] * N, (W,), _rand(B, 3, seed=1)
    if kind == "groups":  # groups of 3 layers (one spans two ranks), the last layer untied
        mods = {}

        def make(k):
            return DenseStep(W, "smoothrelu").to(DT)
        # serial: the group's module is made by make_step(k0) seeded layer_seed(0, k0)
        from mgrit.nn import layer_seed
        ref = []
        for k in range(N):
            k0 = (k // 3) * 3 if k < 6 else k
            if k0 not in mods:
                torch.manual_seed(layer_seed(0, k0))
                mods[k0] = make(k0)
            ref.append(mods[k0])
        ref = copy.deepcopy(ref)  # one memo: ties kept
        return make, [0, 0, 0, 1, 1, 1, None], ref, (W,), _rand(B, 3, seed=2)
    if kind == "albert":  # one shared pre-LN transformer block for the whole stack
        torch.manual_seed(4)
        block = TransformerStep(8, 2, 16).to(DT)
        ref = copy.deepcopy(block)
        return (lambda k: block), (lambda k: "block"), [ref] * N, (3, 8), _rand(B, 3, 3, seed=3)
    raise ValueError(kind)


def _nets(kind, levels, batched):
    make, tie, ref_layers, shape, x = _case(kind)
    d = shape[-1]
    torch.manual_seed(11)
    opening, closing = nn.Linear(3, d).to(DT), nn.Sequential(nn.Flatten(), nn.Linear(
        int(torch.Size(shape).numel()), 2)).to(DT)
    serial = nn.Sequential(copy.deepcopy(opening), *[ResidualStep(s, T / N) for s in ref_layers],
                           copy.deepcopy(closing))
    seg = LayerParallelResNet.build(make, N, shape, comm=COMM, T=T, tie=tie,
                                    forward=_opts(levels, batched),
                                    backward=_opts(levels, batched))
    net = LayerParallelNet(opening, seg, closing)
    return net, serial, x


def _replica_digests(net) -> dict:
    out = {}
    for key, p in net.named_global_parameters():
        out[key] = hashlib.sha1(p.detach().numpy().tobytes()).hexdigest()
    return out


def check_tied(kind, levels, batched=True, steps=3):
    """Loss, output, gradients and parameters after ``steps`` SGD-momentum steps vs serial;
    tied replicas bitwise equal; ``.grad`` right after ``backward()`` (no extra call)."""
    net, serial, x = _nets(kind, levels, batched)
    y = torch.tensor([0, 1, 1, 0, 1])
    assert len(list(serial.parameters())) < sum(1 for _ in serial.named_parameters(
        remove_duplicate=False)), "the reference is not tied"
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    sopt = torch.optim.SGD(serial.parameters(), lr=0.2, momentum=0.9)
    sparams = dict(serial.named_parameters(remove_duplicate=False))
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
        if net.is_last:
            worst = max(worst, _rel(out, sout), abs(loss.item() - sloss.item()) / sloss.item())
        for key, p in net.named_global_parameters():
            assert p.grad is not None, f"{key}: no gradient"
            e = _rel(p.grad, sparams[key].grad)
            assert e < 1e-9, f"step {step} {kind} L{levels}: gradient of {key} off by {e:.2e}"
            worst = max(worst, e)
        opt.step()
        sopt.step()
    for key, p in net.named_global_parameters():
        e = _rel(p, sparams[key])
        assert e < 1e-9, f"{kind}: parameter {key} after {steps} steps off by {e:.2e}"
        worst = max(worst, e)
    # replicas: every key held on several ranks is bitwise the same everywhere
    seen = {}
    for r, d in enumerate(COMM.allgather(_replica_digests(net))):
        for key, h in d.items():
            r0, h0 = seen.setdefault(key, (r, h))
            assert h == h0, f"{key}: replicas on ranks {r0} and {r} differ"
    net.segments[0].check_tied_replicas()
    worst = COMM.allreduce(worst, op=MPI.MAX)
    assert worst < 1e-9, worst
    return f"{worst:.1e}"


def check_replica_drift_detected():
    """Changing one rank's replica is caught by check_tied_replicas on every rank."""
    net, _, _ = _nets("one", 2, True)
    if COMM.Get_size() == 1:
        net.segments[0].check_tied_replicas()  # one replica: nothing to compare
        return "one rank"
    seg = net.segments[0]
    if COMM.Get_rank() == COMM.Get_size() - 1:
        with torch.no_grad():
            next(seg.steps[0].parameters())[0, 0] += 1e-12
    try:
        seg.check_tied_replicas()
    except ValueError as e:
        assert "replicas" in str(e), e
        return "raised"
    raise AssertionError("drifted replica not detected")


def check_errors():
    """Undeclared sharing, a group whose layers differ, bad tie values: one ValueError on
    every rank."""
    shared, g1 = DenseStep(W).to(DT), DenseStep(W).to(DT)
    msgs = []
    for make, tie, words in [
            (lambda k: shared, None, ("tie",)),                       # undeclared, P > 1
            (lambda k: DenseStep(W).to(DT), [0] * (N - 1), ("entries",)),
            (lambda k: shared, lambda k: {}, ("hashable",)),
            (lambda k: shared if k < 3 else DenseStep(W).to(DT), lambda k: k // 3,
             ("same parameters",)),
            (lambda k: shared if k <= 2 else g1, [0, None, 0, None, None, None, None],
             ("share", "tie"))]:
        if make is not None and tie is None and COMM.Get_size() == 1:
            continue  # sharing without tie is allowed on one rank
        try:
            LayerParallelResNet(
                [make(k) for k in range(*_block())], N, (W,), comm=COMM, tie=tie)
        except ValueError as e:
            for w in words:
                assert w in str(e), (w, str(e))
            msgs.append(str(e)[:60])
            continue
        raise AssertionError(f"no ValueError for {words}")
    # a state dict giving tied layers different values (an untied network's) is refused
    net, _, _ = _nets("groups", 2, True)
    state = net.gather_state_dict()
    if state is not None:
        state = dict(state)
        state["2.F.linear.weight"] = state["2.F.linear.weight"] + 1.0
    try:
        net.load_global_state_dict(state)
    except ValueError as e:
        assert "weight-tied" in str(e) and "2.F.linear.weight" in str(e), str(e)
        msgs.append(str(e)[:60])
    else:
        raise AssertionError("conflicting tied values accepted")
    # a group whose layers use different modules (constructor, not build)
    if COMM.Get_size() >= 1:
        try:
            LayerParallelResNet([DenseStep(W).to(DT) for _ in range(*_block())], N, (W,),
                                comm=COMM, tie=lambda k: 0)
        except ValueError as e:
            assert "same parameters" in str(e) or "same module" in str(e), str(e)
        else:
            a, b = _block()
            if b - a > 1:
                raise AssertionError("distinct modules in one group accepted")
    return len(msgs)


def _block():
    from mgrit.grid import Partition
    a, b = Partition.even(N, COMM.Get_size()).block(COMM.Get_rank())
    return a, min(b, N)


def check_checkpoint():
    """Save on 2 ranks (after 2 steps, momentum state), load on all ranks: same weights and
    optimizer state; the file holds one copy of each tied tensor."""
    import tempfile
    path = COMM.bcast(os.path.join(tempfile.mkdtemp(prefix="layerpar-tied-")
                                   if COMM.Get_rank() == 0 else "", "ckpt.pt"), root=0)
    small = COMM.Split(0 if COMM.Get_rank() < 2 else MPI.UNDEFINED, COMM.Get_rank())
    x, y = _rand(B, 3, seed=9), torch.tensor([0, 1, 1, 0, 1])

    def build(comm):
        torch.manual_seed(21)
        op, cl = nn.Linear(3, W).to(DT), nn.Linear(W, 2).to(DT)
        seg = LayerParallelResNet.build(lambda k: DenseStep(W).to(DT), N, (W,), comm=comm, T=T,
                                        tie=lambda k: k // 3, forward=_opts(2),
                                        backward=_opts(2))
        net = LayerParallelNet(op, seg, cl)
        return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    state = None
    if small != MPI.COMM_NULL:
        net, opt = build(small)
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
    net, opt = build(COMM)
    load_checkpoint(path, net, opt, ProcessGrid(COMM))
    net.segments[0].check_tied_replicas()
    for key, p in net.named_global_parameters():
        assert torch.equal(p.detach(), state[key]), f"{key} differs after loading"
        assert "momentum_buffer" in opt.state[p], f"{key}: no momentum restored"
        assert torch.equal(opt.state[p]["momentum_buffer"], saved_mom[key]), f"{key}: momentum"
    if COMM.Get_rank() == 0:
        ck = torch.load(path, weights_only=True)
        m = ck["model"]
        keys = [k for k in m if k.endswith("weight") and ".F." in k]
        ptr = {k: m[k].untyped_storage().data_ptr() for k in keys}
        groups = {}
        for k in keys:
            layer = int(k.split(".")[0]) - 1
            g = layer // 3
            groups.setdefault(g, set()).add(ptr[k])
        assert all(len(v) == 1 for v in groups.values()), f"tied copies saved: {groups}"
        assert len(groups) == 3, groups
        os.remove(path)
        os.rmdir(os.path.dirname(path))
    return "ok"


def check_job_tied_resnet():
    """The main job's --tied ResNet (mgrit.models, moved to float64 with .to()):
    layer-parallel gradients equal its serial twin's, one step module for all layers."""
    from layerpar.jobconfig import JobConfig
    from mgrit.models import build_model
    cfg = JobConfig(tied=True, layers=5, width=4, tol=1e-13, levels=2, cfactor=2, seed=2)
    net = build_model("resnet", cfg, (1, 8, 8), 3, comm=COMM).to(DT)
    ser = build_model("resnet", cfg, (1, 8, 8), 3).to(DT)
    assert len({id(m) for m in ser[1:-1]}) == cfg.layers  # ResidualSteps...
    assert len({id(m.F) for m in ser[1:-1]}) == 1  # ... of one step module
    x, y = _rand(6, 1, 8, 8, seed=5), torch.tensor([0, 1, 2, 0, 1, 2])
    net.loss(net(x), y).backward()
    F.cross_entropy(ser(x), y).backward()
    sp = dict(ser.named_parameters(remove_duplicate=False))
    worst = 0.0
    for key, p in net.named_global_parameters():
        worst = max(worst, _rel(p, sp[key]), _rel(p.grad, sp[key].grad))
    worst = COMM.allreduce(worst, op=MPI.MAX)
    assert worst < 1e-9, worst
    return f"{worst:.1e}"


def check_tied_with_replicas():
    """Weight-tied layers on 2 layer ranks x 2 data-parallel replicas, trained by the Trainer
    (tied sum over the layer ranks in the backward, then the replicas' average): parameters
    after 3 steps equal serial full-batch training."""
    from mgrit.training import Trainer
    grid = ProcessGrid(data_parallel=2)
    make, tie, ref_layers, shape, _ = _case("groups")
    torch.manual_seed(11)
    opening, closing = nn.Linear(3, W).to(DT), nn.Linear(W, 2).to(DT)
    serial = nn.Sequential(copy.deepcopy(opening), *[ResidualStep(s, T / N) for s in ref_layers],
                           copy.deepcopy(closing))
    seg = LayerParallelResNet.build(make, N, shape, comm=grid.layer_comm, T=T, tie=tie,
                                    forward=_opts(2), backward=_opts(2))
    net = LayerParallelNet(opening, seg, closing)
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
    seg.check_tied_replicas()
    assert worst < 1e-9, worst
    return f"{worst:.1e}"
