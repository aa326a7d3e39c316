"""Usage patterns of :class:`LayerParallelResNet` as a PyTorch user writes them, run on k ranks
by tests/nn/test_nn_usage.py (float64, exact mode: forward and adjoint solves to 1e-13).

Each check runs the same scenario twice: on the layer-parallel model and on serial PyTorch
autograd (``serial_resnet``, same seeds, every rank builds it) and compares, on every rank,
the parameter gradients of its own layers and (first rank) the input gradients: <= 1e-12
relative. Autograd patterns (issue 13 item 1): several forwards before one backward,
micro-batch accumulation, ``torch.autograd.grad``, ``retain_graph``, evaluation forwards in
between, ``torch.utils.checkpoint``, and the errors that replace wrong gradients.
"""
import torch
from torch.utils.checkpoint import checkpoint

from mgrit.nn import DenseStep, LayerParallelResNet, serial_resnet
from mgrit.options import MGRITOptions
from tests.mpi_cases.nn.nn_cases import COMM, DT, _global_max, _rand, _rel

W, N, B, T, SEED = 3, 10, 4, 2.0, 3
TOL = 1e-12
EXACT = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=80)


def dense(k):
    return DenseStep(W, "tanh").double()


def build(maker=dense, n=N, **kw):
    """The layer-parallel model on COMM_WORLD and the serial reference with the same weights."""
    kw.setdefault("forward", EXACT)
    kw.setdefault("backward", EXACT)
    model = LayerParallelResNet.build(maker, n, (W,), comm=COMM, seed=SEED, T=T, **kw)
    return model, serial_resnet(maker, n, T, SEED)


class Side:
    """One side of a comparison: the layer-parallel model, or (``ser`` given) the serial
    reference restricted to this rank's layers for the comparison. ``self(x)`` is the forward
    a user writes (``x`` on the first rank, ``batch_size`` elsewhere; ``pass_x``: the tensor
    on every rank), :meth:`loss` the real loss where the output exists, else the placeholder."""

    def __init__(self, model, ser=None, pass_x=False):
        self.m, self.ser, self.pass_x = model, ser, pass_x
        n = len(model.steps)
        self.steps = list(model.steps) if ser is None else [ser[model.first + j].F
                                                            for j in range(n)]
        self.params = [p for s in self.steps for p in s.parameters()]

    @property
    def real(self) -> bool:
        return self.ser is not None or self.m.is_last

    def __call__(self, x):
        if self.ser is not None:
            return self.ser(x)
        x0 = x if (self.m.is_first or self.pass_x) else None
        return self.m(x0, batch_size=x.shape[0])

    def loss(self, out, w, power=1):
        return ((out * w) ** power).sum() if self.real else out.sum()


def inputs(count, seed=40):
    """``count`` pairs (input requiring grad, loss weights), the same on every rank."""
    return [(_rand(B, W, seed=seed + 2 * i).requires_grad_(True),
             _rand(B, W, seed=seed + 2 * i + 1)) for i in range(count)]


def compare(lp, ref, xs_lp=(), xs_ref=(), grads=None, tol=TOL):
    """Parameter ``.grad`` (or the given ``grads`` pairs) and first-rank input gradients of
    the two sides. Returns the worst relative error over all ranks."""
    worst = 0.0
    if grads is None:
        grads = [(p.grad, q.grad) for p, q in zip(lp.params, ref.params)]
    pairs = grads
    for i, (g, r) in enumerate(pairs):
        if r is None:
            assert g is None, f"parameter {i}: gradient {g} where serial autograd has None"
            continue
        assert g is not None, f"parameter {i}: no gradient"
        e = _rel(g, r)
        assert e <= tol, f"parameter {i}: gradient rel err {e}"
        worst = max(worst, e)
    if lp.m.is_first:
        for i, (a, b) in enumerate(zip(xs_lp, xs_ref)):
            if b.grad is None:  # an input only evaluated under no_grad
                assert a.grad is None, f"input {i}: gradient where serial autograd has None"
                continue
            e = _rel(a.grad, b.grad)
            assert e <= tol, f"input {i}: gradient rel err {e}"
            worst = max(worst, e)
    return _global_max(worst)


def run_both(scenario, count, maker=dense, pass_x=False, **kw):
    """Run ``scenario(side, pairs)`` on both sides with fresh inputs; compare ``.grad``."""
    torch.set_default_dtype(DT)
    model, ser = build(maker, **kw)
    lp, ref = Side(model, pass_x=pass_x), Side(model, ser)
    a, b = inputs(count), inputs(count)
    scenario(lp, a)
    scenario(ref, b)
    return compare(lp, ref, [x for x, _ in a], [x for x, _ in b])


# -- several forwards, one or several backwards -------------------------------------------------
def _f1_f2_b12(side, pairs):
    (x1, w1), (x2, w2) = pairs
    o1 = side(x1)
    if side.real:  # the real loss's nodes are created between the forwards ...
        l1 = side.loss(o1, w1)
        o2 = side(x2)
        loss = l1 + side.loss(o2, w2, power=2)
    else:  # ... the placeholders' after both: the graphs differ between ranks
        o2 = side(x2)
        loss = side.loss(o2, w2) + side.loss(o1, w1)
    loss.backward()


def check_several_forwards_one_backward():
    return run_both(_f1_f2_b12, 2)


def _three_forwards_eval_between(side, pairs):
    (x1, w1), (x2, w2), (x3, w3) = pairs
    o1 = side(x1)
    with torch.no_grad():
        side(x3)  # evaluation forward between
    o2 = side(x2)
    o3 = side(x3)
    (side.loss(o3, w3) + side.loss(o1, w1, power=2) + side.loss(o2, w2)).backward()


def check_three_forwards_and_eval():
    return run_both(_three_forwards_eval_between, 3)


def _accumulate(order):
    def scenario(side, pairs):
        (x1, w1), (x2, w2) = pairs
        if order == "F1B1F2B2":
            side.loss(side(x1), w1).backward()
            side.loss(side(x2), w2, power=2).backward()
            return
        l1 = side.loss(side(x1), w1)
        l2 = side.loss(side(x2), w2, power=2)
        for loss in ((l1, l2) if order == "F1F2B1B2" else (l2, l1)):
            loss.backward()
    return scenario


def check_accumulation(order, warm_start=False):
    """Gradient accumulation over two micro-batches in the given order (warm start on: the
    second forward starts from the first one's states; no gradient may depend on that)."""
    return run_both(_accumulate(order), 2, warm_start=warm_start)


def _eval_between(side, pairs):
    (x1, w1), (x2, _) = pairs
    out = side(x1)
    with torch.no_grad():
        side(x2)
    side.loss(out, w1).backward()


def check_eval_between_forward_and_backward():
    return run_both(_eval_between, 2)


def _retain(side, pairs):
    (x1, w1), = pairs
    loss = side.loss(side(x1), w1)
    loss.backward(retain_graph=True)
    loss.backward()


def check_retain_graph():
    return run_both(_retain, 1)


def _checkpointed(reentrant):
    def scenario(side, pairs):
        (x1, w1), (x2, w2) = pairs
        if side.ser is not None:
            out1, out2 = side(x1), side(x2)
        elif reentrant:  # positional batch size; an input requiring grad on every rank
            out1 = checkpoint(side.m, x1, B, use_reentrant=True)
            out2 = checkpoint(side.m, x2, B, use_reentrant=True)
        else:
            x0 = (lambda x: x if side.m.is_first else None)
            out1 = checkpoint(side.m, x0(x1), batch_size=B, use_reentrant=False)
            out2 = checkpoint(side.m, x0(x2), batch_size=B, use_reentrant=False)
        (side.loss(out1, w1) + side.loss(out2, w2, power=2)).backward()
    return scenario


def check_checkpoint(reentrant):
    return run_both(_checkpointed(reentrant), 2)


# -- torch.autograd.grad ------------------------------------------------------------------------
def check_autograd_grad(wrt):
    """``torch.autograd.grad`` w.r.t. the parameters, the input (every rank passes its input;
    ranks other than the first get ``None``), or both; no ``.grad`` is touched."""
    torch.set_default_dtype(DT)
    model, ser = build()
    lp, ref = Side(model, pass_x=True), Side(model, ser)
    out = {}
    for side in (lp, ref):
        (x, w), = inputs(1)
        loss = side.loss(side(x), w)
        targets = {"params": side.params, "input": [x], "both": [x, *side.params]}[wrt]
        g = torch.autograd.grad(loss, targets, allow_unused=True)
        out[side] = (x, list(g))
    (xa, ga), (xb, gb) = out[lp], out[ref]
    assert all(t.grad is None for t in [xa, xb, *lp.params, *ref.params]), \
        "autograd.grad filled .grad"
    if wrt != "params":  # the input gradient: first rank only; None elsewhere
        if model.is_first:
            e = _rel(ga[0], gb[0])
            assert e <= TOL, f"input gradient rel err {e}"
        else:
            assert ga[0] is None, "an input gradient on a rank that does not hold the input"
        ga, gb = ga[1:], gb[1:]
    return compare(lp, ref, grads=list(zip(ga, gb)))


# -- errors instead of wrong gradients ----------------------------------------------------------
def _expect_runtime_error(fn, *words):
    try:
        fn()
    except RuntimeError as exc:
        msg = str(exc)
        for wd in words:
            assert wd in msg, f"RuntimeError {msg!r} does not mention {wd!r}"
        return msg
    raise AssertionError(f"no RuntimeError (expected one mentioning {words})")


def check_inplace_update_between_forward_and_backward():
    """A parameter changed in place (on the last rank only) between a forward and its backward:
    autograd's error on every rank, and no gradient anywhere; the same model then works."""
    torch.set_default_dtype(DT)
    model, ser = build()
    lp = Side(model)
    (x, w), = inputs(1)
    loss = lp.loss(lp(x), w)
    if model.is_last:
        with torch.no_grad():
            lp.params[0].mul_(1.0)  # an in-place update (bumps the version, same values)
    _expect_runtime_error(loss.backward, "modified by an inplace operation",
                          *([f"rank {COMM.size - 1}:"] if COMM.size > 1 else []))
    assert all(p.grad is None for p in lp.params), "a gradient was produced"
    return run_both(_eval_between, 2)  # and gradients are right again afterwards


def check_backward_twice_and_double_backward():
    """A second backward without ``retain_graph`` and ``create_graph=True``: RuntimeError on
    every rank (the placeholder-style loss reaches the resnet's node on every rank)."""
    torch.set_default_dtype(DT)
    model, _ = build()
    lp = Side(model)
    (x, _), = inputs(1)
    loss = lp(x).sum()
    loss.backward()
    _expect_runtime_error(loss.backward, "second time")
    loss = lp(x).sum()
    _expect_runtime_error(lambda: torch.autograd.grad(loss, lp.params, create_graph=True),
                          "create_graph")


def check_mismatched_backwards():
    """Ranks backpropagating different forwards: a RuntimeError on every rank, not a hang or a
    gradient of the wrong forward (P > 1)."""
    torch.set_default_dtype(DT)
    model, _ = build()
    lp = Side(model)
    (x1, w1), (x2, w2) = inputs(2)
    l1, l2 = lp.loss(lp(x1), w1), lp.loss(lp(x2), w2)
    mine = l1 if COMM.rank == 0 else l2
    _expect_runtime_error(mine.backward, "different forwards", "forward #1", "forward #2")
    assert all(p.grad is None for p in lp.params)
