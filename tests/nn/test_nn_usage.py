"""The layer-parallel ResNet used as PyTorch users use modules (issue 13 items 1-3 and the RNG
bullet of item 8), against serial PyTorch autograd on the same weights, float64 exact mode,
<= 1e-12 relative, on 1, 2 and 3 ranks (one MPI job per rank count: the checks are in
tests/mpi_cases/nn/nn_usage_cases.py and nn_module_cases.py).

Serial (no mpiexec) unit tests of the batching proof (:mod:`mgrit.nn.chains.stacking`) are below the
MPI checks.
"""
import pytest
import torch
from torch import nn

from mgrit.nn import DenseStep, LayerParallelResNet, make_step, serial_resnet
from mgrit.nn.chains.stacking import batching_obstacle
from mgrit.options import MGRITOptions
from tests.mpi_harness import MPIBatch

U = "tests.mpi_cases.nn.nn_usage_cases"
M = "tests.mpi_cases.nn.nn_module_cases"
BATCH = MPIBatch()
for k in (1, 2, 3):
    BATCH.add(k, "several_forwards_one_backward", f"{U}:check_several_forwards_one_backward")
    BATCH.add(k, "three_forwards_and_eval", f"{U}:check_three_forwards_and_eval")
    for order in ("F1B1F2B2", "F1F2B1B2", "F1F2B2B1"):
        BATCH.add(k, f"accumulation-{order}", f"{U}:check_accumulation", order=order)
    BATCH.add(k, "accumulation-F1F2B1B2-warm", f"{U}:check_accumulation", order="F1F2B1B2",
              warm_start=True)
    BATCH.add(k, "eval_between", f"{U}:check_eval_between_forward_and_backward")
    BATCH.add(k, "retain_graph", f"{U}:check_retain_graph")
    for reentrant in (False, True):
        BATCH.add(k, f"checkpoint-reentrant={reentrant}", f"{U}:check_checkpoint",
                  reentrant=reentrant)
    for wrt in ("params", "input", "both"):
        BATCH.add(k, f"autograd_grad-{wrt}", f"{U}:check_autograd_grad", wrt=wrt)
    BATCH.add(k, "inplace_update_error", f"{U}:check_inplace_update_between_forward_and_backward")
    BATCH.add(k, "backward_twice_double_backward", f"{U}:check_backward_twice_and_double_backward")
    for kind, batched in [("private", False), ("tensor", False), ("closure", False),
                          ("time", False), ("hook", False), ("buffer", True), ("same", True),
                          ("dense", True)]:
        BATCH.add(k, f"per_layer_state-{kind}", f"{M}:check_per_layer_state", kind=kind,
                  batched_expected=batched)
    for kind in ("spare", "dense"):
        for batched in (True, False):
            BATCH.add(k, f"unused_and_frozen-{kind}-batched={batched}",
                      f"{M}:check_unused_and_frozen", kind=kind, batched=batched)
    for input_grad in (False, True):
        BATCH.add(k, f"frozen_resnet_head-input_grad={input_grad}",
                  f"{M}:check_frozen_resnet_before_head", input_grad=input_grad)
    for pattern in ("all", "some"):
        BATCH.add(k, f"shared_parameters-{pattern}", f"{M}:check_shared_parameters",
                  pattern=pattern)
    BATCH.add(k, "build_keeps_rng", f"{M}:check_build_keeps_rng")
for k in (2, 3):
    BATCH.add(k, "mismatched_backwards", f"{U}:check_mismatched_backwards")


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_nn_usage(k, name):
    results = BATCH.run(k, name)
    assert len(set(results)) == 1, f"ranks disagree: {results}"


# -- the batching proof (no MPI) -----------------------------------------------------------------
class Step(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _pair(setup=None):
    a, b = Step(), Step()
    if setup is not None:
        setup(a, 0)
        setup(b, 1)
    return [a, b]


@pytest.mark.parametrize("what,setup,word", [
    ("private number", lambda m, k: setattr(m, "_scale", 1.0 + k), "'_scale'"),
    ("public number", lambda m, k: setattr(m, "scale", 1.0 + k), "'scale'"),
    ("tensor attribute", lambda m, k: setattr(m, "t", torch.full((3,), float(k))), "'t'"),
    ("tensor dtype",
     lambda m, k: setattr(m, "t", torch.zeros(3, dtype=[torch.float32, torch.float64][k])), "'t'"),
    ("lambda", lambda m, k: setattr(m, "f", lambda z: z), "'f'"),
    ("closure on a submodule", lambda m, k: setattr(m.lin, "_g", (lambda z: z * k)), "'_g'"),
    ("list of numbers", lambda m, k: setattr(m, "_taus", [0.1, 0.2 * k]), "'_taus'"),
    ("object", lambda m, k: setattr(m, "_cfg", object()), "'_cfg'"),
    ("forward hook", lambda m, k: k and m.register_forward_hook(lambda *a: None), "forward_hooks"),
    ("pre hook", lambda m, k: k and m.lin.register_forward_pre_hook(lambda *a: None),
     "forward_pre_hooks"),
    ("mode", lambda m, k: m.train(k == 0), "training mode"),
    ("activation type", lambda m, k: setattr(m, "act", [nn.Tanh(), nn.ReLU()][k]), "ReLU"),
    ("missing attribute", lambda m, k: k and setattr(m, "_extra", 1), "attributes"),
    ("opt-out", lambda m, k: setattr(m, "batchable", False), "batchable"),
])
def test_batching_obstacle_finds_per_layer_state(what, setup, word):
    obstacle = batching_obstacle(_pair(setup))
    assert obstacle is not None and word in obstacle, f"{what}: {obstacle}"


@pytest.mark.parametrize("what,setup", [
    ("nothing", None),
    ("equal private number", lambda m, k: setattr(m, "_scale", 2.0)),
    ("equal tensor", lambda m, k: setattr(m, "_t", torch.arange(3.0))),
    ("same function", lambda m, k: setattr(m, "_f", torch.tanh)),
    ("equal nested containers", lambda m, k: setattr(m, "_cfg", {"a": (1, 2.5), "b": ["x"]})),
    ("per-layer buffer", lambda m, k: m.register_buffer("t", torch.tensor(float(k)))),
    ("different parameter values", lambda m, k: nn.init.constant_(m.lin.weight, float(k))),
])
def test_batching_allowed_when_only_tensors_differ(what, setup):
    assert batching_obstacle(_pair(setup)) is None, what


@pytest.mark.parametrize("kind", ["dense", "conv", "twoconv"])
@pytest.mark.parametrize("act", ["tanh", "relu", "smoothrelu"])
def test_builtin_steps_still_batch(kind, act):
    """The proof must not cost the built-in steps their batched kernels."""
    assert batching_obstacle([make_step(kind, 4, act) for _ in range(3)]) is None


def test_global_hooks_stop_batching_and_results_stay_exact():
    """A global forward hook registered after build: the chain stops batching at the next
    forward (the hook then runs per layer, as in serial); removing it batches again."""
    torch.set_default_dtype(torch.float64)
    try:
        mk = lambda k: DenseStep(3, "tanh")  # noqa: E731
        opts = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=80)
        lp = LayerParallelResNet.build(mk, 8, (3,), forward=opts, backward=opts)
        ser = serial_resnet(mk, 8)
        x = torch.randn(4, 3)
        calls = []
        handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: calls.append(1))
        try:
            assert batching_obstacle(list(lp.steps)) == "global module hooks are registered"
            with torch.no_grad():
                y = lp(x)
            assert lp.last_forward.stats.steps_batched_calls == 0 and calls
            assert lp.batching_obstacle == "global module hooks are registered"
        finally:
            handle.remove()
        with torch.no_grad():
            assert torch.allclose(y, ser(x), rtol=0, atol=1e-12)
            lp(x)
        assert lp.last_forward.stats.steps_batched_calls > 0 and lp.batching_obstacle is None
    finally:
        torch.set_default_dtype(torch.float32)


def test_refresh_structure_after_changing_a_private_attribute():
    """State changed after build (a private per-layer attribute) is picked up by
    refresh_structure(): the layers are then evaluated one by one and equal serial."""
    torch.set_default_dtype(torch.float64)
    try:
        class S(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin, self._c = nn.Linear(3, 3), 1.0

            def forward(self, x):
                return self._c * torch.tanh(self.lin(x))

        opts = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=80)
        lp = LayerParallelResNet.build(lambda k: S(), 8, (3,), forward=opts, backward=opts)
        ser = serial_resnet(lambda k: S(), 8)
        assert lp.batching_obstacle is None
        for k in range(8):
            lp.steps[k]._c = ser[k].F._c = 1.0 + 0.25 * k
        lp.refresh_structure()
        assert "'_c'" in lp.batching_obstacle
        x = torch.randn(4, 3)
        with torch.no_grad():
            assert torch.allclose(lp(x), ser(x), rtol=0, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_to_dtype_restacks_buffers():
    """``.double()`` replaces buffers: the batched chain must stack the new ones (found while
    writing the batching proof: the stacked lists kept the float32 buffers)."""
    class B(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("t", torch.tensor(0.1 * k))

        def forward(self, x):
            return torch.tanh(self.lin(x) + self.t)

    opts = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=80)
    lp = LayerParallelResNet.build(B, 8, (3,), forward=opts, backward=opts).double()
    ser = serial_resnet(B, 8).double()
    with torch.no_grad():  # new values in place, in the new dtype (allowed at any time)
        for k in range(8):
            lp.steps[k].t.fill_(0.3 * k + 0.1)
            ser[k].F.t.fill_(0.3 * k + 0.1)
    assert lp.batching_obstacle is None
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        y, ref = lp(x), ser(x)
    assert y.dtype == torch.float64 and lp.last_forward.stats.steps_batched_calls > 0
    assert torch.allclose(y, ref, rtol=0, atol=1e-12)
