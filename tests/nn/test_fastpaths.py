"""Fast paths equal the general paths they replace (no timing here).

* The one-level exact path of ``LayerParallelResNet`` (``mgrit.nn.resnet.pipelined``: the rank's
  layers recorded in autograd, two messages per rank boundary) under every usage pattern of
  tests/nn/test_nn_usage.py, on 1, 2 and 3 ranks, and in ``LayerParallelNet`` segments (those of
  tests/nn/test_segments_mpi.py), against serial PyTorch autograd in float64: the usage scenarios
  at their 1e-12 / 1e-10 tolerances, training steps and gradients bit for bit.
* Serial checks of the solver's hot paths: batched steps written in place into the state
  array, single steps from the stacked snapshot, closed-form adjoint steps on reversed slices,
  the finest level allocated without clearing what F-relaxation writes, the autograd node with
  stacked parameter inputs -- each against the general path it replaces (bit for bit where the
  operations are the same, else 1e-14 / 1e-13 relative).
"""
import pytest
import torch
from torch import nn

from mgrit.nn import ConvStep, DenseStep, LayerParallelResNet, serial_resnet
from mgrit.nn.resnet.bridge import MGRITFunction
from mgrit.nn.chains import AdjointChain, ForwardChain
from mgrit.options import MGRITOptions
from mgrit.problems import Dahlquist
from mgrit.propagator import Propagator
from mgrit.solver import MGRIT
from tests.mpi_harness import MPIBatch

F = "tests.mpi_cases.nn.fastpath_cases"
BATCH = MPIBatch()
USAGE = [("check_several_forwards_one_backward", {}), ("check_three_forwards_and_eval", {}),
         ("check_accumulation", {"order": "F1F2B2B1"}),
         ("check_accumulation", {"order": "F1B1F2B2", "warm_start": True}),
         ("check_eval_between_forward_and_backward", {}), ("check_retain_graph", {}),
         ("check_checkpoint", {"reentrant": False}), ("check_checkpoint", {"reentrant": True}),
         ("check_autograd_grad", {"wrt": "params"}), ("check_autograd_grad", {"wrt": "input"}),
         ("check_autograd_grad", {"wrt": "both"}),
         ("check_inplace_update_between_forward_and_backward", {}),
         ("check_backward_twice_and_double_backward", {}),
         ("check_frozen_resnet_before_head", {"input_grad": False}),
         ("check_frozen_resnet_before_head", {"input_grad": True}),
         ("check_shared_parameters", {"pattern": "all"})]
for k in (1, 2, 3):
    for name, kw in USAGE:
        tag = "-".join([name[6:], *map(str, kw.values())])
        BATCH.add(k, f"one_level-{tag}", f"{F}:check_usage", check=name, **kw)
    BATCH.add(k, "one_level-bitwise_training", f"{F}:check_bitwise_training")
    BATCH.add(k, "one_level-diagnostics", f"{F}:check_diagnostics")
    BATCH.add(k, "one_level-no_grad_and_mixed", f"{F}:check_no_grad_and_mixed")
    for kind in ("spare", "hook"):
        BATCH.add(k, f"one_level-unused_frozen_hooked-{kind}", f"{F}:check_unused_frozen_hooked",
                  kind=kind)
for k in (2, 3):
    BATCH.add(k, "one_level-mismatched_backwards", f"{F}:check_usage",
              check="check_mismatched_backwards")
    for arch in ("staged_conv", "buffered"):  # LayerParallelNet: one-level segments in a net
        BATCH.add(k, f"one_level-net-{arch}", "tests.mpi_cases.nn.segments_cases:check_exact",
                  arch=arch, levels=1)
    BATCH.add(k, "one_level-net-several_forwards",
              "tests.mpi_cases.nn.segments_cases:check_several_forwards", levels=1)


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_one_level_path(k, name):
    results = BATCH.run(k, name)
    assert len(set(results)) == 1, f"ranks disagree: {results}"


# -- serial checks of the solver's fast paths (float64, no mpiexec) -----------------------------
DT = torch.float64


@pytest.fixture
def f64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(DT)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(old)


def _rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


class _Mlp(nn.Module):  # no forward_batched: batched by vmap
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.sin(self.lin(x))


MAKERS = {"dense-tanh": lambda: DenseStep(4, "tanh"), "dense-relu": lambda: DenseStep(4, "relu"),
          "dense-smoothrelu": lambda: DenseStep(4, "smoothrelu"),
          "conv": lambda: ConvStep(2, 3, "tanh"), "vmap": _Mlp}


def _chain(kind, n=12, h=0.1):
    steps = [MAKERS[kind]().double() for _ in range(n)]
    chain = ForwardChain(steps, 0, h)
    chain.refresh()
    assert chain.batched
    shape = (5, 2, 4, 4) if kind == "conv" else (5, 4)
    return chain, steps, shape


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_step_batch_into_equals_step_batch(f64, kind):
    """Written into a strided view of a state array: bit for bit what step_batch returns."""
    chain, _, shape = _chain(kind)
    u = torch.randn(13, *shape)
    starts, stops = range(1, 12, 4), range(2, 13, 4)
    ref = chain.step_batch(u[1:12:4], starts, stops, 0)
    chain.step_batch_into(u[1:12:4], starts, stops, 0, u[2:13:4])
    assert torch.equal(u[2:13:4], ref)


@pytest.mark.parametrize("kind", ["dense-tanh", "dense-relu", "dense-smoothrelu"])
def test_single_step_from_snapshot_equals_module(f64, kind):
    """DenseStep.forward_layer (one addmm on the stacked snapshot, no module call) equals the
    layer's module to round-off, and a batched step of one interval."""
    chain, steps, shape = _chain(kind)
    u = torch.randn(*shape)
    for j in (0, 5, 11):
        module = u + 0.1 * steps[j](u)
        batch = chain.step_batch(u.unsqueeze(0), range(j, j + 1), range(j + 1, j + 2), 0)[0]
        steps[j].forward = None  # the fast path makes no module call
        fast = chain.step(u, j, j + 1, 0)
        assert _rel(fast, module) <= 1e-14 and _rel(fast, batch) <= 1e-14


@pytest.mark.parametrize("kind", ["dense-tanh", "dense-smoothrelu"])
def test_adjoint_closed_form_steps_equal_autograd(f64, kind):
    """Closed-form single adjoint steps and batched steps on reversed slices (one reversed copy
    per solve, no gather) equal the autograd single steps and the gathered batched steps."""
    chain, _, shape = _chain(kind)
    N = 12
    states = torch.randn(N + 1, *shape)
    fast = AdjointChain(chain, N, states, chain._stack.tensors, closed_single=True)
    ref = AdjointChain(chain, N, states, chain._stack.tensors)
    mu = torch.randn(N + 1, *shape)
    for i, span in ((0, 1), (4, 1), (11, 1), (3, 3)):  # span 3: a coarse step of layer 8
        assert _rel(fast.step(mu[i], i, i + span, 0), ref.step(mu[i], i, i + span, 0)) <= 1e-14
    assert not fast._vjp and ref._vjp  # closed form: no per-layer autograd graph
    starts, stops = range(1, 12, 3), range(2, 13, 3)
    gathered = ref.step_batch(mu[1:12:3], list(starts), list(stops), 0)  # index path
    sliced = fast.step_batch(mu[1:12:3], starts, stops, 0)
    assert _rel(sliced, gathered) <= 1e-14
    out = torch.empty_like(mu)
    fast.step_batch_into(mu[1:12:3], starts, stops, 0, out[2:13:3])
    assert torch.equal(out[2:13:3], sliced)


class _Hidden(Propagator):
    """Delegates to a propagator without exposing its ``step_batch_into``."""

    def __init__(self, prop):
        self.p = prop

    def step(self, u, start, stop, level):
        return self.p.step(u, start, stop, level)

    def step_batch(self, u, starts, stops, level):
        return self.p.step_batch(u, starts, stops, level)


class _Zeroed(MGRIT):
    """The solver with every finest-level state cleared before the solve (the reference of
    its partial initialization)."""

    def _initialize(self, st, initial_guess):
        st.u.zero_()
        super()._initialize(st, initial_guess)


class _Poisoned(MGRIT):
    """The solver with NaN in every finest-level state before its partial initialization: a
    state read before it is written spoils the result."""

    def _initialize(self, st, initial_guess):
        st.u.fill_(float("nan"))
        super()._initialize(st, initial_guess)


OPTS = [dict(relax="F"), dict(relax="FCF"), dict(relax="FCF", cycle="F", max_levels=3),
        dict(relax="F", skip_first_relaxation=True), dict(relax="FCF", nested_iteration=True),
        dict(relax="F", max_levels=1)]


@pytest.mark.parametrize("kw", OPTS, ids=[str(k) for k in OPTS])
def test_in_place_relaxation_and_partial_initialization_are_exact(f64, kw):
    """F-relaxation writing batched steps in place and the finest level allocated without
    clearing the F-points give bit for bit the states and residual histories of the copying,
    fully cleared solver (a ResNet chain, cold and warm starts)."""
    chain, _, shape = _chain("dense-tanh", n=24, h=0.05)
    kw = dict(dict(max_levels=2, cfactor=3, tol=0.0, max_iter=3), **kw)
    opts = MGRITOptions(**kw)
    u0 = torch.randn(*shape)
    fast = _Poisoned(chain, 24, shape, options=opts)
    slow = _Zeroed(_Hidden(chain), 24, shape, options=opts)
    for guess in (None, torch.randn(25, *shape)):
        if guess is not None and kw.get("nested_iteration"):
            continue
        a, b = fast.solve(u0, initial_guess=guess), slow.solve(u0, initial_guess=guess)
        assert torch.equal(a.states, b.states) and a.residuals == b.residuals
    assert fast.stats.steps_batched_calls == slow.stats.steps_batched_calls


def test_partial_initialization_dahlquist_histories(f64):
    """The same on a problem of the PyMGRIT cross-check (Dahlquist, 3 levels, FCF, F-cycle)."""
    prop = Dahlquist(n_intervals=64)
    opts = MGRITOptions(max_levels=3, cfactor=2, relax="FCF", cycle="F", tol=1e-12, max_iter=20)
    a = _Poisoned(prop, 64, (), options=opts).solve(prop.initial_value())
    b = _Zeroed(prop, 64, (), options=opts).solve(prop.initial_value())
    assert a.residuals == b.residuals and torch.equal(a.states, b.states)


@pytest.mark.parametrize("kind", ["dense-tanh", "vmap"])
def test_stacked_bridge_equals_per_parameter_bridge(f64, kind):
    """The autograd node with stacked parameter inputs (torch.stack's node fans the gradient
    out) and with one input per parameter give the same gradients (1e-13, float64) -- also with
    a frozen layer (no gradient) and in ``torch.autograd.grad``."""
    opts = MGRITOptions(max_levels=2, cfactor=3, tol=1e-14, max_iter=60)
    lp = LayerParallelResNet.build(lambda k: MAKERS[kind]().double(), 12, (4,), forward=opts,
                                   backward=opts)
    list(lp.steps[4].parameters())[0].requires_grad_(False)
    x = torch.randn(5, 4)
    w = torch.randn(5, 4)

    def run(stacked):
        xr = x.clone().requires_grad_(True)
        if stacked:
            snap = lp._chain.refresh(grad=True)
            ins = [snap[n] for n in lp._chain._stack.names]
            out = MGRITFunction.apply(lp, 5, lp._token, xr, snap, *ins)
        else:
            out = MGRITFunction.apply(lp, 5, lp._token, xr, None, *lp._params)
        return torch.autograd.grad((out * w).sum(), [xr] + [p for p in lp._params
                                                             if p.requires_grad])

    a, b = run(True), run(False)
    assert len(a) == len(b) == 1 + 2 * 12 - 1
    assert max(_rel(p, q) for p, q in zip(a, b)) <= 1e-13
    ref = serial_resnet(lambda k: MAKERS[kind]().double(), 12)
    ref.load_state_dict(lp.to_serial().state_dict())
    xr = x.clone().requires_grad_(True)
    (ref(xr) * w).sum().backward()
    assert _rel(a[0], xr.grad) <= 1e-12
