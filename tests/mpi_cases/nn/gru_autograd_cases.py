"""ParallelGRU under every autograd pattern a PyTorch user may write, on k ranks (run by
tests/nn/test_gru_mpi.py; float64 exact mode, tiny sizes).

Reference: an unrolled ``nn.GRUCell`` with the same weights and the same pattern (several
forwards, then backwards in the same order, the same in-place changes) under serial autograd.
Each rank compares the full parameter gradients, its own rows of ``x.grad`` (zeros elsewhere)
and, on rank 0, ``h0.grad``, at 1e-10 relative. Patterns serial autograd refuses (a second
backward without ``retain_graph``, a saved tensor changed in place) and those a collective
backward cannot support (ranks backpropagating different forwards, ``create_graph``) must raise
the same RuntimeError on every rank, never hang or give a gradient.
"""
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.checkpoint import checkpoint

from mgrit.nn.gru import ParallelGRU
from mgrit.options import MGRITOptions

COMM = MPI.COMM_WORLD
DT = torch.float64
BATCH, INPUT, HIDDEN, N = 3, 2, 4, 9
TOL = 1e-10
NAMES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _setup(seed=0):
    """An exact-mode model (rank 0's weights on every rank) and its serial nn.GRUCell copy."""
    torch.set_default_dtype(DT)
    torch.manual_seed(seed + COMM.rank)  # different RNG per rank: the broadcast must unify
    o = MGRITOptions(max_levels=2, cfactor=2, relax="FCF", tol=1e-13, max_iter=80)
    model = ParallelGRU(INPUT, HIDDEN, comm=COMM, forward=o, backward=o)
    cell = nn.GRUCell(INPUT, HIDDEN).to(DT)
    with torch.no_grad():
        for p, q in zip(cell.parameters(), model.parameters()):
            p.copy_(q)
    return model, cell


def _unroll(cell, x, h0):
    """Serial GRU: ``(h_N, outputs (batch, n, H))``."""
    h, outs = h0, []
    for t in range(x.shape[1]):
        h = cell(x[:, t], h)
        outs.append(h)
    return h, torch.stack(outs, 1)


def _leaf(t, grad=True):
    return t.clone().requires_grad_(grad)


def _loss(model, h, w, seq=None, ws=None):
    """This rank's part of ``(h_N * w).sum() + (outputs * ws).sum()``."""
    a, e = model.time_slice(N)
    part = (h * w).sum() if model.is_last else h.sum()
    return part if seq is None else part + (seq * ws[:, a:e]).sum()


def _ref_loss(h, w, seq=None, ws=None):
    return (h * w).sum() + (0.0 if seq is None else (seq * ws).sum())


def _check_grads(model, cell, pairs=(), h0_pair=None, grads=None, ref_grads=None):
    """Parameter gradients (``.grad``, or the given lists) and ``x``/``h0`` gradients
    (``(parallel, serial)`` pairs) against the serial ones. Returns the worst error."""
    a, e = model.time_slice(N)
    errs = {}
    mine = grads if grads is not None else [p.grad for p in model.parameters()]
    ref = ref_grads if ref_grads is not None else [q.grad for q in cell.parameters()]
    for name, g, r in zip(NAMES, mine, ref):
        assert (g is None) == (r is None), f"{name}: gradient {g} where serial gives {r}"
        if r is not None:
            errs[name] = _rel(g, r)
    for i, (gp, gs) in enumerate(pairs):
        errs[f"x{i}.grad"] = _rel(gp[:, a:e], gs[:, a:e])
        assert not bool(torch.cat((gp[:, :a], gp[:, e:]), 1).any()), \
            "x.grad outside this rank's rows must be zero"
    if h0_pair is not None:
        gp, gs = h0_pair
        if a == 0:
            errs["h0.grad"] = _rel(gp, gs)
        else:
            assert not bool(gp.any()), "h0.grad off rank 0 must be zero"
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"
    return COMM.allreduce(max(errs.values(), default=0.0), op=MPI.MAX)


def _raises_everywhere(fn, *words):
    """``fn()`` raises RuntimeError mentioning ``words``, the same message on every rank."""
    try:
        fn()
    except RuntimeError as exc:
        msg = str(exc)
    else:
        raise AssertionError(f"no RuntimeError raised (expected one mentioning {words})")
    for wd in words:
        assert wd in msg, f"message {msg!r} does not mention {wd!r}"
    msgs = COMM.allgather(msg)
    assert all(m == msgs[0] for m in msgs), f"ranks raised different messages: {msgs}"
    return msg


def _works_after(model, cell, x, w):
    """After a refused backward the model still gives serial gradients."""
    sx = _leaf(x)
    _ref_loss(_unroll(cell, sx, torch.zeros(BATCH, HIDDEN))[0], w).backward()
    px = _leaf(x)
    _loss(model, model(px), w).backward()
    return _check_grads(model, cell, [(px.grad, sx.grad)])


def check_forwards_then_one_backward():
    """Two forwards (one with the sequence output), then one backward of their sum."""
    model, cell = _setup()
    x1, x2, h0 = _rand(BATCH, N, INPUT, seed=1), _rand(BATCH, N, INPUT, seed=2), _rand(
        BATCH, HIDDEN, seed=3)
    w1, w2, ws = _rand(BATCH, HIDDEN, seed=4), _rand(BATCH, HIDDEN, seed=5), _rand(
        BATCH, N, HIDDEN, seed=6)
    s1, s2, sh = _leaf(x1), _leaf(x2), _leaf(h0)
    hs1, seq1 = _unroll(cell, s1, sh)
    hs2, _ = _unroll(cell, s2, sh)
    (_ref_loss(hs1, w1, seq1, ws) + _ref_loss(hs2, w2)).backward()
    p1, p2, ph = _leaf(x1), _leaf(x2), _leaf(h0)
    h1, q1 = model(p1, ph, return_sequence=True)
    h2 = model(p2, ph)
    (_loss(model, h1, w1, q1, ws) + _loss(model, h2, w2)).backward()
    return _check_grads(model, cell, [(p1.grad, s1.grad), (p2.grad, s2.grad)],
                        (ph.grad, sh.grad))


def check_interleaved_backwards():
    """F1 F2 B1 B2 (gradient accumulation over micro-batches, backwards in forward order)."""
    model, cell = _setup()
    xs = [_rand(BATCH, N, INPUT, seed=10 + i) for i in range(2)]
    w = _rand(BATCH, HIDDEN, seed=12)
    refs = [_leaf(x) for x in xs]
    outs = [_unroll(cell, r, torch.zeros(BATCH, HIDDEN))[0] for r in refs]
    for h in outs:
        _ref_loss(h, w).backward()
    leaves = [_leaf(x) for x in xs]
    hs = [model(p) for p in leaves]
    for h in hs:
        _loss(model, h, w).backward()
    return _check_grads(model, cell, [(p.grad, r.grad) for p, r in zip(leaves, refs)])


def check_retain_graph():
    """Two backwards of one forward with retain_graph: twice the gradient (as serial); a third
    without the graph: autograd's RuntimeError on every rank."""
    model, cell = _setup()
    x, h0, w = _rand(BATCH, N, INPUT, seed=20), _rand(BATCH, HIDDEN, seed=21), _rand(
        BATCH, HIDDEN, seed=22)
    sx, sh = _leaf(x), _leaf(h0)
    loss = _ref_loss(_unroll(cell, sx, sh)[0], w)
    loss.backward(retain_graph=True)
    loss.backward()
    px, ph = _leaf(x), _leaf(h0)
    h = model(px, ph)
    loss = _loss(model, h, w)
    loss.backward(retain_graph=True)
    loss.backward()
    worst = _check_grads(model, cell, [(px.grad, sx.grad)], (ph.grad, sh.grad))
    h = model(px, ph)
    h.sum().backward()  # no saved tensor outside the node: the freed graph is found inside it
    _raises_everywhere(lambda: h.sum().backward(), "ParallelGRU", "second time")
    return worst


def check_autograd_grad():
    """torch.autograd.grad w.r.t. the parameters, x and h0 (no .grad filled)."""
    model, cell = _setup()
    x, h0, w, ws = (_rand(BATCH, N, INPUT, seed=30), _rand(BATCH, HIDDEN, seed=31),
                    _rand(BATCH, HIDDEN, seed=32), _rand(BATCH, N, HIDDEN, seed=33))
    sx, sh = _leaf(x), _leaf(h0)
    hs, seq = _unroll(cell, sx, sh)
    ref = torch.autograd.grad(_ref_loss(hs, w, seq, ws), [sx, sh, *cell.parameters()])
    px, ph = _leaf(x), _leaf(h0)
    h, q = model(px, ph, return_sequence=True)
    got = torch.autograd.grad(_loss(model, h, w, q, ws), [px, ph, *model.parameters()])
    assert all(p.grad is None for p in model.parameters()) and px.grad is None
    return _check_grads(model, cell, [(got[0], ref[0])], (got[1], ref[1]),
                        grads=list(got[2:]), ref_grads=list(ref[2:]))


def check_eval_forward_between():
    """F (grad), an evaluation forward under no_grad on other data, then B of the first."""
    model, cell = _setup()
    x, other, w = _rand(BATCH, N, INPUT, seed=40), _rand(BATCH, N, INPUT, seed=41), _rand(
        BATCH, HIDDEN, seed=42)
    sx = _leaf(x)
    _ref_loss(_unroll(cell, sx, torch.zeros(BATCH, HIDDEN))[0], w).backward()
    px = _leaf(x)
    h = model(px)
    with torch.no_grad():
        ev = model(other, return_sequence=True)[0]
    assert not ev.requires_grad
    _loss(model, h, w).backward()
    return _check_grads(model, cell, [(px.grad, sx.grad)])


def check_checkpoint():
    """torch.utils.checkpoint (non-reentrant) around the model: the solve is recomputed in
    the backward on every rank; gradients equal serial."""
    model, cell = _setup()
    x, h0, w, ws = (_rand(BATCH, N, INPUT, seed=50), _rand(BATCH, HIDDEN, seed=51),
                    _rand(BATCH, HIDDEN, seed=52), _rand(BATCH, N, HIDDEN, seed=53))
    sx, sh = _leaf(x), _leaf(h0)
    hs, seq = _unroll(cell, sx, sh)
    _ref_loss(hs, w, seq, ws).backward()
    px, ph = _leaf(x), _leaf(h0)
    h, q = checkpoint(lambda a, b: model(a, b, return_sequence=True), px, ph,
                      use_reentrant=False)
    first = model.last_forward
    _loss(model, h, w, q, ws).backward()
    assert model.last_forward is not first, "the checkpointed solve was not recomputed"
    return _check_grads(model, cell, [(px.grad, sx.grad)], (ph.grad, sh.grad))


def check_frozen():
    """Frozen parameters on every rank get no gradient and the rest serial's; a frozen GRU
    still gives h0.grad when h0 (given on rank 0 only) is all that requires grad; with nothing
    requiring grad every rank's backward runs and no adjoint solve does; replicas frozen
    differently are a ValueError on every rank at the forward."""
    model, cell = _setup()
    for m in (model, cell):
        m.weight_ih.requires_grad_(False)
        m.bias_hh.requires_grad_(False)
    x, h0, w = _rand(BATCH, N, INPUT, seed=60), _rand(BATCH, HIDDEN, seed=61), _rand(
        BATCH, HIDDEN, seed=62)
    sx = _leaf(x)
    _ref_loss(_unroll(cell, sx, h0)[0], w).backward()
    px = _leaf(x)
    _loss(model, model(px, h0), w).backward()
    worst = _check_grads(model, cell, [(px.grad, sx.grad)])
    for m in (model, cell):
        m.zero_grad(set_to_none=True)
        m.requires_grad_(False)
    sh = _leaf(h0)
    _ref_loss(_unroll(cell, x, sh)[0], w).backward()
    ph = _leaf(h0) if COMM.rank == 0 else None
    h = model(x, ph)
    assert h.requires_grad, "every rank's output must require grad in grad mode"
    _loss(model, h, w).backward()
    if COMM.rank == 0:
        worst = max(worst, _check_grads(model, cell, h0_pair=(ph.grad, sh.grad)))
    else:
        worst = max(worst, _check_grads(model, cell))
    model.last_backward = None
    h = model(x)
    assert h.requires_grad
    _loss(model, h, w).backward()
    assert model.last_backward is None, "an adjoint solve ran though nothing requires grad"
    assert all(p.grad is None for p in model.parameters())
    if COMM.size > 1:  # replicas frozen differently: refused at the forward, on every rank
        model.weight_hh.requires_grad_(COMM.rank == 0)
        try:
            model(x)
        except ValueError as exc:
            assert "which parameters require grad" in str(exc), str(exc)
            msgs = COMM.allgather(str(exc))
            assert all(m == msgs[0] for m in msgs), msgs
        else:
            raise AssertionError("replicas frozen differently were not refused")
    return COMM.allreduce(worst, op=MPI.MAX)


def check_inplace_like_serial():
    """In-place changes between forward and backward that serial nn.GRUCell autograd allows
    (bias_hh; weight_ih while x needs no grad): the forward's gradient, as serial."""
    model, cell = _setup()
    x, w = _rand(BATCH, N, INPUT, seed=70), _rand(BATCH, HIDDEN, seed=71)
    ref_loss = _ref_loss(_unroll(cell, x, torch.zeros(BATCH, HIDDEN))[0], w)
    loss = _loss(model, model(x), w)
    for m in (model, cell):
        with torch.no_grad():
            m.bias_hh.add_(0.25)
            m.weight_ih.mul_(0.5)
    ref_loss.backward()
    loss.backward()
    return _check_grads(model, cell)


def check_inplace_raises():
    """weight_hh changed in place between forward and backward (serial autograd raises):
    autograd's RuntimeError on every rank, also when changed on rank 0 only."""
    model, cell = _setup()
    x, w = _rand(BATCH, N, INPUT, seed=72), _rand(BATCH, HIDDEN, seed=73)
    kept = model.weight_hh.detach().clone()
    for ranks in (range(COMM.size), [0]):
        h = model(x)
        with torch.no_grad():
            if COMM.rank in ranks:
                model.weight_hh.add_(0.1)
        _raises_everywhere(lambda: _loss(model, h, w).backward(), "ParallelGRU",
                           "modified by an inplace operation",
                           *(["rank 0"] if COMM.size > 1 else []))
        with torch.no_grad():
            model.weight_hh.copy_(kept)
    assert all(p.grad is None for p in model.parameters())
    return _works_after(model, cell, x, w)


def check_create_graph_refused():
    """create_graph=True (double backward): the same RuntimeError on every rank."""
    model, cell = _setup()
    x, w = _rand(BATCH, N, INPUT, seed=80), _rand(BATCH, HIDDEN, seed=81)
    h = model(x)
    _raises_everywhere(lambda: torch.autograd.grad(_loss(model, h, w), list(model.parameters()),
                                                   create_graph=True), "create_graph")
    assert all(p.grad is None for p in model.parameters())
    return _works_after(model, cell, x, w)


def check_mismatched_backwards():
    """Rank 0 backpropagates the first of two forwards, the others the second: the same
    RuntimeError on every rank before any solve (k > 1)."""
    model, cell = _setup()
    x, w = _rand(BATCH, N, INPUT, seed=82), _rand(BATCH, HIDDEN, seed=83)
    h1, h2 = model(x), model(x.flip(0))
    mine = h1 if COMM.rank == 0 else h2
    _raises_everywhere(lambda: _loss(model, mine, w).backward(), "different forwards",
                       "rank 0: forward #1", "rank 1: forward #2")
    assert all(p.grad is None for p in model.parameters())
    return _works_after(model, cell, x, w)
