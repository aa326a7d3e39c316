"""ParallelGRU checks run on k ranks by tests/nn/test_gru_mpi.py (float64, tiny sizes).

Every rank builds the same serial reference (``nn.GRUCell`` unrolled, same weights: the
parallel model broadcasts rank 0's and the reference copies them) and asserts on its own part:
the final state on the last time rank, its slice of the sequence output and of the input
gradient, the initial-state gradient on rank 0, and the full parameter gradients everywhere.
"""
import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_sequence

from mgrit.nn.gru import ParallelGRU
from mgrit.nn.gru.classifier import GRUSequenceClassifier
from mgrit.options import MGRITOptions

COMM = MPI.COMM_WORLD
DT = torch.float64
BATCH, INPUT, HIDDEN = 3, 2, 4
EXACT = dict(tol=1e-13, max_iter=80)


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _global_max(v):
    return COMM.allreduce(float(v), op=MPI.MAX)


def _model(levels=2, cfactor=2, coarse="power", relax="FCF", fwd=None, bwd=None, seed=0, **kw):
    torch.set_default_dtype(DT)
    torch.manual_seed(seed + COMM.rank)  # different RNG per rank: the broadcast must unify
    fwd = fwd or MGRITOptions(max_levels=levels, cfactor=cfactor, relax=relax, **EXACT)
    bwd = bwd or MGRITOptions(max_levels=levels, cfactor=cfactor, relax=relax, **EXACT)
    return ParallelGRU(INPUT, HIDDEN, comm=COMM, forward=fwd, backward=bwd, coarse=coarse, **kw)


def _cell(model):
    cell = nn.GRUCell(INPUT, HIDDEN, bias=model.bias).to(DT)
    with torch.no_grad():
        for p, q in zip(cell.parameters(), model.parameters()):
            p.copy_(q)
    return cell


def _data(n, seed):
    return (_rand(BATCH, n, INPUT, seed=seed), _rand(BATCH, HIDDEN, seed=seed + 1),
            _rand(BATCH, HIDDEN, seed=seed + 2), _rand(BATCH, n, HIDDEN, seed=seed + 3))


def _serial(cell, x, h0, w, ws, seq_out):
    """Unrolled nn.GRUCell: (h_N, outputs (batch, n, H), x.grad, h0.grad); cell gets .grad."""
    xs, hs = x.clone().requires_grad_(True), h0.clone().requires_grad_(True)
    h, outs = hs, []
    for t in range(x.shape[1]):
        h = cell(xs[:, t], h)
        outs.append(h)
    seq = torch.stack(outs, 1)
    loss = (h * w).sum() + ((seq * ws).sum() if seq_out else 0.0)
    loss.backward()
    return h.detach(), seq.detach(), xs.grad, hs.grad


def _parallel(model, x, h0, w, ws, seq_out):
    """Every rank: forward, its part of the loss, backward. Returns (h_N, seq, x.grad, h0.grad)."""
    a, e = model.time_slice(x.shape[1])
    xp, hp = x.clone().requires_grad_(True), h0.clone().requires_grad_(True)
    if seq_out:
        h, seq = model(xp, hp, return_sequence=True)
        loss = (seq * ws[:, a:e]).sum()
    else:
        h, seq = model(xp, hp), None
        loss = 0.0
    loss = loss + ((h * w).sum() if model.is_last else h.sum())
    loss.backward()
    return h.detach(), seq, xp.grad, hp.grad


def check_exact(n, levels, cfactor, coarse="power", seq_out=True, relax="FCF", tol=1e-10):
    model = _model(levels, cfactor, coarse, relax)
    cell = _cell(model)
    x, h0, w, ws = _data(n, seed=100 + n)
    h_ref, seq_ref, gx_ref, gh_ref = _serial(cell, x, h0, w, ws, seq_out)
    h, seq, gx, gh = _parallel(model, x, h0, w, ws, seq_out)
    a, e = model.time_slice(n)
    errs = {}
    if model.is_last:
        errs["h_N"] = _rel(h, h_ref)
    else:
        assert h.numel() == 0
    if seq_out:
        assert seq.shape == (BATCH, e - a, HIDDEN), seq.shape
        errs["seq"] = _rel(seq, seq_ref[:, a:e])
    errs["x.grad (own rows)"] = _rel(gx[:, a:e], gx_ref[:, a:e])
    outside = torch.cat((gx[:, :a], gx[:, e:]), 1)
    assert not bool(outside.any()), "x.grad outside this rank's rows must be zero"
    if a == 0:
        errs["h0.grad"] = _rel(gh, gh_ref)
    else:
        assert float(gh.abs().max()) == 0.0
    for (name, p), q in zip(model.named_parameters(), cell.parameters()):
        errs[name] = _rel(p.grad, q.grad)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (fwd {model.last_forward.iterations} " \
                    f"cycles, bwd {model.last_backward.iterations})"
    assert model.last_forward.converged and model.last_backward.converged
    return _global_max(max(errs.values()))


def check_one_level_bitwise(n):
    """One level (sequential stepping, pipelined across ranks): outputs equal nn.GRU bit for
    bit; gradients to round-off (closed-form VJPs summed in another order than autograd)."""
    one = MGRITOptions(max_levels=1)
    model = _model(fwd=one, bwd=one)
    gru = model.to_gru()
    x, h0, w, ws = _data(n, seed=200 + n)
    xs = x.clone().requires_grad_(True)
    out_ref, hn_ref = gru(xs, h0.unsqueeze(0))
    ((hn_ref[0] * w).sum() + (out_ref * ws).sum()).backward()
    h, seq, gx, _ = _parallel(model, x, h0, w, ws, True)
    a, e = model.time_slice(n)
    # round-off (float64): bitwise only where torch's GRU kernel orders operations alike
    assert (seq - out_ref[:, a:e].detach()).abs().max() <= 1e-14, \
        "sequence output differs from nn.GRU"
    if model.is_last:
        assert (h - hn_ref[0].detach()).abs().max() <= 1e-14, "final state differs from nn.GRU"
    worst = _rel(gx[:, a:e], xs.grad[:, a:e])
    for p, q in zip(model.parameters(), gru.parameters()):
        worst = max(worst, _rel(p.grad, q.grad))
    assert worst <= 1e-13, worst
    return _global_max(worst)


def check_inexact_converges(n=48, levels=2, cfactor=4):
    """Fixed iteration counts, no warm start: the gradient error vs serial falls with them."""
    model0 = _model(levels, cfactor)
    cell = _cell(model0)
    x, h0, w, ws = _data(n, seed=300)
    _, _, _, _ = _serial(cell, x, h0, w, ws, False)
    errors = []
    for it in (1, 2, 4, 8):
        o = MGRITOptions(max_levels=levels, cfactor=cfactor, relax="F", tol=0.0, max_iter=it)
        model = _model(fwd=o, bwd=o, warm_start=False)
        _parallel(model, x, h0, w, ws, False)
        errors.append(_global_max(max(_rel(p.grad, q.grad)
                                      for p, q in zip(model.parameters(), cell.parameters()))))
    assert errors[0] > 1e-6, f"1 iteration is already exact ({errors}): nothing is tested"
    assert errors[-1] < 1e-3 * errors[0], f"errors do not fall: {errors}"
    for u, v in zip(errors, errors[1:]):
        assert v <= 1.5 * u, f"error grew with more iterations: {errors}"
    return errors


def check_warm_start(n=48):
    o = MGRITOptions(max_levels=2, cfactor=4, relax="F", tol=0.0, max_iter=1)
    model = _model(fwd=o, bwd=o)
    assert model.warm_start, "inexact mode should warm-start by default"
    x = _data(n, seed=400)[0]
    model(x)
    cold = model.last_forward.residuals[-1]
    with torch.no_grad():  # evaluation neither uses up nor replaces the warm state
        model(x.flip(0))
    model(x)
    warm = model.last_forward.residuals[-1]
    assert warm < 0.5 * cold, f"warm residual {warm} not below cold {cold}"
    return cold, warm


def check_several_forwards(n=13):
    """Two forwards, then their backwards in reverse order: each uses its own solve's data."""
    model = _model(2, 2)
    cell = _cell(model)
    (x1, h0, w, _), x2 = _data(n, seed=500), _rand(BATCH, n, INPUT, seed=510)
    for x in (x1, x2):
        h = h0
        for t in range(n):
            h = cell(x[:, t], h)
        (h * w).sum().backward()  # cell.grad accumulates both
    outs = [model(x, h0) for x in (x1, x2)]
    for h in reversed(outs):
        ((h * w).sum() if model.is_last else h.sum()).backward()
    worst = max(_rel(p.grad, q.grad) for p, q in zip(model.parameters(), cell.parameters()))
    assert worst <= 1e-10, worst
    return _global_max(worst)


def _expect(fn, *words):
    try:
        fn()
    except ValueError as e:
        for wd in words:
            assert wd in str(e), f"message {str(e)!r} does not mention {wd!r}"
        return str(e)
    raise AssertionError(f"no ValueError raised (expected one mentioning {words})")


def check_bad_inputs():
    """Each bad call raises the same ValueError on every rank, and the job goes on (no hang)."""
    P = COMM.size
    model = _model(2, 2)
    n = max(P, 5)
    x, h0 = _data(n, seed=600)[:2]
    msgs = [
        _expect(lambda: model(_rand(BATCH, n, INPUT + 1, seed=1)), "input size 3", "input_size=2"),
        _expect(lambda: model(x, _rand(BATCH, HIDDEN + 1, seed=2)), "h0", "(3, 4)"),
        _expect(lambda: model(x.float()), "torch.float32", "torch.float64"),
        _expect(lambda: model([x[0], x[1, :-1]]), "unequal lengths"),
        _expect(lambda: model(pack_sequence([x[0], x[1, :-1]])), "PackedSequence"),
        _expect(lambda: model(_rand(BATCH, n, seed=3)), "input size"),
        _expect(lambda: ParallelGRU(INPUT, 0, comm=COMM), "hidden_size=0"),
        _expect(lambda: ParallelGRU(INPUT, HIDDEN, comm=COMM, coarse="explicit"), "explicit"),
    ]
    if P > 1:
        msgs.append(_expect(lambda: model(x[:1] if COMM.rank == 0 else x), "disagree"))
        msgs.append(_expect(lambda: model(_rand(BATCH, P - 1, INPUT, seed=4)),
                            f"sequence length {P - 1}", f"{P} time ranks"))
    gathered = COMM.allgather(msgs)
    assert all(g == gathered[0] for g in gathered), "ranks raised different messages"
    # the model still works after the errors
    model(x, h0).sum().backward()
    return len(msgs)


def check_classifier_sgd(n=11, steps=3, tol=1e-10):
    """GRUSequenceClassifier (exact mode) and its serial copy take the same SGD steps."""
    torch.set_default_dtype(DT)
    torch.manual_seed(7)
    o = MGRITOptions(max_levels=2, cfactor=2, **EXACT)
    model = GRUSequenceClassifier(INPUT, HIDDEN, 5, comm=COMM, forward=o, backward=o)
    ser = model.to_serial()
    initial = [p.detach().clone() for p in ser["gru"].parameters()]
    x = _rand(6, n, INPUT, seed=700)
    y = torch.randint(0, 5, (6,), generator=torch.Generator().manual_seed(701))
    opt_p = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt_s = torch.optim.SGD(ser.parameters(), lr=0.5, momentum=0.9)
    for _ in range(steps):
        opt_p.zero_grad()
        out = model(x)
        model.loss(out, y).backward()
        opt_p.step()
        opt_s.zero_grad()
        F.cross_entropy(ser["head"](ser["gru"](x)[1][0]), y).backward()
        opt_s.step()
    worst = max(_rel(p, q) for p, q in zip(model.gru.parameters(), ser["gru"].parameters()))
    if model.is_last:
        worst = max([worst] + [_rel(p, q) for p, q in zip(model.head.parameters(),
                                                          ser["head"].parameters())])
    assert worst <= tol, worst
    moved = max(_rel(p, q) for p, q in zip(ser["gru"].parameters(), initial))
    assert moved > 1e-3, "SGD did not move the parameters"
    replicas = COMM.allgather([p.detach() for p in model.gru.parameters()])
    assert all(torch.equal(p, q) for r in replicas for p, q in zip(r, replicas[0])), \
        "GRU replicas differ across ranks after training"
    return _global_max(worst)
