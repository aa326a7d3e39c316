"""PyTorch's transforms around a :class:`LayerParallelNet` (issue 36 items 1, 7, 8, 9, 11, 13),
run on k ranks by tests/nn/test_transforms_mpi.py, float64, exact solves (1e-13).

Reference: serial PyTorch autograd of ``net.to_serial()`` (a plain ``nn.Sequential`` with the
same weights, taken before anything runs). Checks: ``torch.compile`` of the whole network
(backends eager and aot_eager) trains as serial; gradients with respect to the input
(``autograd.grad``, ``allow_unused``, ``backward(inputs=)``, ``autograd.functional.vjp``) equal
serial on the first rank and are zeros elsewhere, with every adjoint solve run on every rank;
``torch.func.functional_call`` with fast weights equals serial; functorch transforms and
forward-mode AD are one ValueError on every rank naming them, and the network works after it;
a check that one rank never reaches ends in a CollectiveTimeout (no hang).
"""
import torch
from torch import nn
from torch.func import functional_call

from mgrit.collective import CollectiveTimeout, collective_timeout, set_collective_timeout
from mgrit.comm import raise_agreed
from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, ParallelGRU
from mgrit.options import MGRITOptions
from tests.mpi_cases.nn.nn_cases import COMM, DT, _rand, _rel

W, N, B = 3, 6, 4
TOL = 1e-10


def build(levels, seed=5):
    """``(net, serial reference)``: Linear opening, an N-layer segment, Linear closing."""
    opts = MGRITOptions(max_levels=levels, cfactor=2, tol=1e-13, max_iter=80)
    seg = LayerParallelResNet.build(lambda k: DenseStep(W, "tanh").double(), N, (W,), comm=COMM,
                                    seed=seed, T=1.0, forward=opts, backward=opts)
    torch.manual_seed(seed)
    net = LayerParallelNet(nn.Linear(2, W).double(), seg, nn.Linear(W, 2).double())
    return net, net.to_serial()


def data(seed=11):
    return _rand(B, 2, seed=seed), _rand(B, 2, seed=seed + 1)


def mse(out, y):
    return ((out - y) ** 2).sum()


def _params_error(net, ser, attr="grad"):
    """Largest relative error of this rank's parameters (``attr``: "grad" or "data") against
    the serial network's, by global key."""
    ref = dict(ser.named_parameters())
    worst = 0.0
    for key, p in net.named_global_parameters():
        a, b = getattr(p, attr), getattr(ref[key], attr)
        assert (a is None) == (b is None), f"{key}: {attr} {a is None} vs serial {b is None}"
        if a is not None:
            worst = max(worst, _rel(a, b))
    return worst


# -- item 1: torch.compile of the whole network -------------------------------------------------
def check_compiled_net(levels, backend):
    """Three SGD steps of ``torch.compile(net, backend=...)`` equal serial; then an evaluation."""
    net, ser = build(levels)
    cnet = torch.compile(net, backend=backend)
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    opt_s = torch.optim.SGD(ser.parameters(), lr=0.3)
    for step in range(3):
        x, y = data(20 + step)
        opt.zero_grad()
        net.loss(cnet(x), y, mse).backward()
        opt_s.zero_grad()
        mse(ser(x), y).backward()
        e = _params_error(net, ser)
        assert e <= TOL, f"step {step}: gradient rel err {e}"
        opt.step()
        opt_s.step()
    e = _params_error(net, ser, "data")
    assert e <= TOL, f"weights after 3 steps: rel err {e}"
    x, _ = data(30)
    with torch.no_grad():
        out, ref = cnet(x), ser(x)
    if net.is_last:
        assert _rel(out, ref) <= TOL, f"evaluation output rel err {_rel(out, ref)}"
    return e


# -- item 8: gradients with respect to the input ------------------------------------------------
def check_input_gradient(levels, how):
    """``how``: "grad", "unused" (allow_unused=True), "inputs" (backward(inputs=[x])), "vjp"
    (autograd.functional.vjp), "both" (the input and the parameters in one autograd.grad)."""
    net, ser = build(levels)
    x, y = data()
    xs = x.clone().requires_grad_(True)
    loss_s = mse(ser(xs), y)
    (g_ref,) = torch.autograd.grad(loss_s, xs)
    xl = x.clone().requires_grad_(True)
    if how == "vjp":
        v = torch.ones((), dtype=DT)
        _, g = torch.autograd.functional.vjp(lambda t: net.loss(net(t), y, mse), xl, v)
    else:
        loss = net.loss(net(xl), y, mse)
        if how == "inputs":
            loss.backward(inputs=[xl])
            g = xl.grad
        elif how == "both":
            named = list(net.named_global_parameters())
            g, *pg = torch.autograd.grad(loss, [xl, *[p for _, p in named]])
            loss_s = mse(ser(xs), y)
            ref = dict(zip([id(p) for p in ser.parameters()],
                           torch.autograd.grad(loss_s, list(ser.parameters()))))
            sp = dict(ser.named_parameters())
            for (key, p), gp in zip(named, pg):
                e = _rel(gp, ref[id(sp[key])])
                assert e <= TOL, f"{key}: gradient rel err {e}"
        else:
            (g,) = torch.autograd.grad(loss, xl, allow_unused=how == "unused")
    assert all(p.grad is None for p in net.parameters()) or how == "inputs", \
        "autograd.grad filled .grad"
    if how == "inputs":
        assert all(p.grad is None for p in net.parameters()), "backward(inputs=[x]) filled .grad"
    assert g is not None and g.shape == x.shape
    if net.is_first:
        e = _rel(g, g_ref)
        assert e <= TOL, f"input gradient rel err {e}"
        return e
    assert float(g.abs().max()) == 0.0, "an input gradient off the first layer rank"
    return 0.0


# -- item 11: torch.func.functional_call ----------------------------------------------------------
def check_functional_call(levels):
    """Fast weights ``p - 0.1 * g`` (a differentiable function of the parameters, MAML's inner
    step with a detached gradient): outputs and the parameters' ``.grad`` equal serial
    ``functional_call`` of the serial network; a plain forward afterwards equals serial."""
    net, ser = build(levels)
    x, y = data()
    sp = dict(ser.named_parameters())
    inner = {key: _rand(*p.shape, seed=100 + i) for i, (key, p) in
             enumerate(net.to_serial().named_parameters())}  # the same "gradients" everywhere
    keys = dict(net.named_global_parameters())
    local = {id(p): key for key, p in keys.items()}
    fast = {n: p - 0.1 * inner[local[id(p)]] for n, p in net.named_parameters()}
    fast_s = {n: p - 0.1 * inner[n] for n, p in sp.items()}
    out = functional_call(net, fast, (x,))
    net.loss(out, y, mse).backward()
    out_s = functional_call(ser, fast_s, (x,))
    mse(out_s, y).backward()
    worst = _params_error(net, ser)
    assert worst <= TOL, f"functional_call: gradient rel err {worst}"
    if net.is_last:
        assert _rel(out, out_s) <= TOL, f"functional_call: output rel err {_rel(out, out_s)}"
    for p in (*net.parameters(), *ser.parameters()):
        p.grad = None
    out = net(x)  # the module's own parameters again (the fast paths rebuilt)
    net.loss(out, y, mse).backward()
    mse(ser(x), y).backward()
    e = _params_error(net, ser)
    assert e <= TOL, f"plain forward after functional_call: gradient rel err {e}"
    return max(worst, e)


def check_functional_call_between(levels):
    """A forward, then a ``functional_call`` forward and backward (the fast paths rebuilt for
    the fast weights and back), then the first forward's backward: gradients equal serial
    (the backward is not refused as "modules changed": they are the forward's again)."""
    net, ser = build(levels)
    x, y = data()
    x2, _ = data(40)
    out = net(x)
    fast = {n: p * 1.1 for n, p in net.named_parameters()}
    net.loss(functional_call(net, fast, (x2,)), y, mse).backward()
    net.loss(out, y, mse).backward()
    mse(functional_call(ser, {n: p * 1.1 for n, p in ser.named_parameters()}, (x2,)),
        y).backward()
    mse(ser(x), y).backward()
    e = _params_error(net, ser)
    assert e <= TOL, f"gradient rel err {e}"
    return e


# -- items 7, 9, 13: refusals --------------------------------------------------------------------
def _expect_refusal(fn, words):
    try:
        fn()
    except ValueError as exc:
        msg = str(exc)
        assert all(w in msg for w in words), f"message lacks {words}: {msg}"
        return msg
    raise AssertionError(f"no ValueError (expected one naming {words})")


def check_refusals(levels, module):
    """Each transform is one ValueError on every rank naming it; afterwards a plain training
    step equals serial (no message was left behind). ``module``: "net" or "segment"."""
    net, ser = build(levels)
    x, y = data()
    if module == "net":
        f = net
    else:
        seg = net.segments[0]

        def f(t):
            return seg(t if seg.is_first else None, batch_size=B)
        x = _rand(B, W, seed=3)
    from torch.autograd import forward_ad as fwAD

    def dual():
        with fwAD.dual_level():
            f(fwAD.make_dual(x, torch.ones_like(x)))

    cases = {"vmap": (lambda: torch.func.vmap(f)(x.unsqueeze(1)), ["torch.func.vmap"]),
             "jvp": (lambda: torch.func.jvp(f, (x,), (torch.ones_like(x),)), ["torch.func.jvp"]),
             "jacrev": (lambda: torch.func.jacrev(lambda t: f(t).sum())(x), ["torch.func.grad"]),
             "forward_ad": (dual, ["forward-mode AD"])}
    if module == "net":
        params = dict(net.named_parameters())
        cases["func.grad(functional_call)"] = (
            lambda: torch.func.grad(lambda p: net.loss(functional_call(net, p, (x,)), y, mse))(
                params), ["torch.func.grad"])
    for name, (fn, words) in cases.items():
        _expect_refusal(fn, words)
    if module == "net":
        x, y = data()
        net.loss(net(x), y, mse).backward()
        mse(ser(x), y).backward()
        e = _params_error(net, ser)
        assert e <= TOL, f"after the refusals: gradient rel err {e}"
    return sorted(cases)


def check_gru_and_tied_refusals(levels):
    """ParallelGRU: vmap and forward-mode AD are one ValueError on every rank naming them;
    a segment with weight-tied layers refuses functional_call's fast weights alike."""
    opts = MGRITOptions(max_levels=levels, cfactor=2, tol=1e-13, max_iter=80)
    gru = ParallelGRU(2, W, comm=COMM, forward=opts, backward=opts).double()
    x = _rand(B, 4, 2, seed=7)
    from torch.autograd import forward_ad as fwAD

    def dual():
        with fwAD.dual_level():
            gru(fwAD.make_dual(x, torch.ones_like(x)))
    _expect_refusal(lambda: torch.func.vmap(gru)(x.unsqueeze(1)), ["torch.func.vmap"])
    _expect_refusal(dual, ["forward-mode AD", "ParallelGRU"])
    gru(x).sum().backward()  # still works
    seg = LayerParallelResNet.build(lambda k: DenseStep(W, "tanh").double(), N, (W,), comm=COMM,
                                    seed=1, T=1.0, forward=opts, backward=opts, tie=lambda k: 0)
    fast = {n: p * 1.0 for n, p in seg.named_parameters()}
    x0 = _rand(B, W, seed=8)
    assert COMM.size == 1 or seg._tied.size, "the tie group spans the ranks"
    if seg._tied is not None and seg._tied.size:
        _expect_refusal(lambda: functional_call(seg, fast, (x0 if seg.is_first else None,),
                                                {"batch_size": B}),
                        ["functional_call", "tie"])
    return True


# -- item 9: every agreement has a deadline -------------------------------------------------------
def check_agreement_deadline():
    """Rank 0 meets a validation agreement that rank 1 reaches only later: rank 0's ends in a
    CollectiveTimeout naming rank 1 (no hang); the late message is then drained."""
    before = collective_timeout()
    set_collective_timeout(1.0)
    try:
        if COMM.rank == 0:
            try:
                raise_agreed(COMM, None, what="deadline test")
            except CollectiveTimeout as exc:
                assert "rank(s) [1] never arrived" in str(exc), str(exc)
            else:
                raise AssertionError("no CollectiveTimeout")
        COMM.Barrier()
        if COMM.rank == 1:
            raise_agreed(COMM, None, what="deadline test")  # gets rank 0's early message
        elif COMM.rank == 0:
            COMM.recv(source=1, tag=4_321)  # rank 1's answer, never awaited by rank 0
        COMM.Barrier()
    finally:
        set_collective_timeout(before)
    return True
