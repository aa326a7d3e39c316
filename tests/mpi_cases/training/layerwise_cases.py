"""MPI checks of :mod:`layerwise` (run through tests.mpi_harness.run_mpi)."""
import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from layerwise import (DecoupledModel, DecoupledPipeline, DecoupledTrainer, ResidualStep,
                       SequentialTrainer, global_batches, train_layerwise)
from mgrit.parallel.procgrid import ProcessGrid
from tests.mpi_cases.training.layerwise_loop_cases import (  # noqa: F401 (run by name in check_many)
    check_layerwise_loop_equals_plain_loop, check_layerwise_resume,
    check_trainer_batchnorm_replicas)


class StepCounter(nn.Module):
    """Identity that counts its training forwards in a buffer (a module whose buffer changes in
    forward and that no replica synchronization knows)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        if self.training:
            self.steps += 1
        return x


def _bn1d(k, width):
    """BatchNorm1d variants by block index: default, cumulative average, no affine."""
    return [nn.BatchNorm1d(width), nn.BatchNorm1d(width, momentum=None),
            nn.BatchNorm1d(width, affine=False)][k % 3]


def make_layers(net: str, seed: int = 0):
    """float64 test networks of 6 blocks: an MLP, a small CNN/ResNet, the same with BatchNorm
    (``mlp_bn``, ``resnet_bn``), or with a buffer-changing module no replica sync knows
    (``mlp_counter``: a step counter; ``mlp_instancenorm``: InstanceNorm1d with running stats)."""
    torch.manual_seed(seed)
    dims = [12, 16, 16, 16, 16, 16, 16]
    if net == "mlp":
        layers = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(dims, dims[1:])]
    elif net == "mlp_bn":
        layers = [nn.Sequential(nn.Linear(a, b), _bn1d(k, b), nn.Tanh())
                  for k, (a, b) in enumerate(zip(dims, dims[1:]))]
    elif net == "mlp_counter":
        layers = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(dims, dims[1:])]
        layers[3].append(StepCounter())
    elif net == "mlp_instancenorm":
        layers = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(dims, dims[1:])]
        layers[4] = nn.Sequential(nn.Linear(16, 16), nn.Unflatten(1, (4, 4)),
                                  nn.InstanceNorm1d(4, track_running_stats=True), nn.Flatten())
    elif net in ("resnet", "resnet_bn"):
        bn = net == "resnet_bn"
        conv = lambda k: nn.Sequential(nn.Conv2d(4, 4, 3, padding=1),
                                       *([nn.BatchNorm2d(4, momentum=[0.1, None][k % 2])] if bn else []),
                                       nn.Tanh())
        layers = [nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), *([nn.BatchNorm2d(4)] if bn else []),
                                nn.ReLU())] + [ResidualStep(conv(k), h=0.5) for k in range(5)]
    else:
        raise ValueError(net)
    return [l.double() for l in layers]


def make_data(net: str, n: int = 48, classes: int = 5, seed: int = 1, loss="cross_entropy"):
    """float64 inputs and int64 labels in ``0..classes-1`` (``loss="mse"``: float64 targets
    ``(n, classes)``, a smooth function of the inputs)."""
    g = torch.Generator().manual_seed(seed)
    shape = (12,) if net.startswith("mlp") else (1, 6, 6)
    x = torch.randn((n, *shape), generator=g, dtype=torch.float64)
    if loss == "mse":
        w = torch.randn(int(np.prod(shape)), classes, generator=g, dtype=torch.float64)
        return x, torch.sin(x.reshape(n, -1) @ w / 3)
    return x, torch.randint(0, classes, (n,), generator=g)


def _state(modules):
    """Parameters and buffers of ``modules`` in a fixed order (float64 for the comparison)."""
    return [t.detach().double() for m in modules for t in (*m.parameters(), *m.buffers())]


def _replicas_identical(tensors, data_comm):
    """Every replica holds bitwise the same ``tensors`` (parameters and buffers)."""
    flat = np.concatenate([t.numpy().reshape(-1) for t in tensors]) if tensors else np.zeros(0)
    everyone = data_comm.allgather(flat)
    assert all(np.array_equal(e, everyone[0]) for e in everyone), "replicas differ"


def check_pipeline_equals_serial(net="mlp", num_stages=2, replicas=1, stages_per_rank=1,
                                 optimizer="sgd", epochs=2, batch_size=8, head="linear", n=48,
                                 loss="cross_entropy"):
    """The pipeline (stages x replicas) equals the single-process DGL loop: losses, accuracies,
    parameters and buffers (BatchNorm running statistics) <= 1e-12, float64; replicas hold
    bitwise identical parameters and buffers; evaluation (every head, the ensemble) equal.
    ``loss="mse"``: regression targets (n, 5), accuracies None. Returns the largest
    difference."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm, data_parallel=replicas)
    x, y = make_data(net, n=n, loss=loss)
    kw = dict(num_classes=5, in_shape=tuple(x.shape[1:]), num_stages=num_stages, head=head, seed=3,
              loss=loss)
    opt = dict(optimizer=optimizer, lr=0.05, momentum=0.9, weight_decay=1e-4)
    ref = DecoupledModel(make_layers(net), **kw)
    ref_trainer = DecoupledTrainer(ref, **opt)
    model = DecoupledModel(make_layers(net), **kw)
    pipe = DecoupledPipeline(model, grid, stages_per_rank=stages_per_rank, **opt)
    for e in range(epochs):
        batches = global_batches(len(y), batch_size, 11, e, replicas)
        m_ref = ref_trainer.train_epoch(x, y, batches)
        m_pipe = pipe.train_epoch(x if grid.layer_rank == 0 else None,
                                  y if grid.layer_rank == 0 else None, batches)
        assert abs(m_ref["loss"] - m_pipe["loss"]) <= 1e-12, (m_ref, m_pipe)
        assert m_pipe["stage_loss"] == pytest_approx(m_ref["stage_loss"]), (m_ref, m_pipe)
        if loss == "mse":
            assert m_ref["stage_train_acc"] == m_pipe["stage_train_acc"] == [None] * num_stages
        else:
            assert np.allclose(m_ref["stage_train_acc"], m_pipe["stage_train_acc"], atol=1e-12)
    diff = 0.0
    mine = _state([mod for k in pipe.owned for mod in (model.bodies[k], model.heads[k])])
    theirs = _state([mod for k in pipe.owned for mod in (ref.bodies[k], ref.heads[k])])
    assert len(mine) == len(theirs) and all(p.grad is None for p in model.parameters())
    for a, b in zip(mine, theirs):
        diff = max(diff, float((a - b).abs().max()))
    assert diff <= 1e-12, f"rank {comm.Get_rank()} stages {pipe.owned}: max diff {diff}"
    if replicas > 1:
        _replicas_identical(mine, grid.data_comm)
    # every stage actually moved
    fresh = DecoupledModel(make_layers(net), **kw)
    for k in pipe.owned:
        moved = max(float((a - b).abs().max().detach()) for a, b in
                    zip(model.stage_parameters(k), fresh.stage_parameters(k)))
        assert moved > 1e-4, f"stage {k} did not train"
    ev = pipe.evaluate(x if grid.layer_rank == 0 else None, y if grid.layer_rank == 0 else None,
                       batch_size=7, ensemble=True)
    ev_ref = ref.evaluate(x, y, batch_size=7, ensemble=True)
    assert abs(ev["loss"] - ev_ref["loss"]) <= 1e-12, (ev, ev_ref)
    for key in ("acc", "ensemble_acc"):
        assert ev[key] == ev_ref[key], (key, ev, ev_ref)
    assert ev["stage_acc"] == ev_ref["stage_acc"]
    assert ev["stage_loss"] == pytest_approx(ev_ref["stage_loss"]), (ev, ev_ref)
    if loss == "mse":
        assert ev["acc"] is None and abs(ev["ensemble_loss"] - ev_ref["ensemble_loss"]) <= 1e-12
        # the MSE of the output head, computed here from the full model
        with torch.no_grad():
            ref.eval()
            direct = float(torch.nn.functional.mse_loss(ref(x), y))
        assert abs(ev["loss"] - direct) <= 1e-12, (ev["loss"], direct)
    sd = pipe.full_state_dict()
    if comm.Get_rank() == 0:
        ref_sd = ref.state_dict()
        assert list(sd) == list(ref_sd)
        worst = max(float((sd[k] - ref_sd[k]).abs().max()) for k in sd)
        assert worst <= 1e-12, worst
        fresh.load_state_dict(sd)
        assert abs(fresh.evaluate(x, y)["loss"] - ref.evaluate(x, y)["loss"]) <= 1e-12
    return diff


def check_bad_config_identical(kind):
    """A bad configuration raises the same ValueError on every rank (before any message).
    ``targets_pipeline``: targets given on layer rank 0 only (``train_epoch``), agreed."""
    comm = MPI.COMM_WORLD
    x, y = make_data("mlp")
    kwargs = {"ranks": dict(num_stages=comm.Get_size() + 1),
              "stages": dict(num_stages=7),
              "head": dict(head="pool"),
              "spr": dict(num_stages=3, stages_per_rank=2),
              "loss": dict(loss="mae"),
              "targets": dict(loss="mse"),  # int64 labels with loss="mse"
              "targets_pipeline": {}}[kind]
    grid = ProcessGrid(comm)
    try:
        if kind == "targets_pipeline":  # regression targets of the wrong width, rank 0 only
            model = DecoupledModel(make_layers("mlp"), 5, (12,), num_stages=grid.layer_size,
                                   loss="mse")
            pipe = DecoupledPipeline(model, grid)
            bad = make_data("mlp", classes=4, loss="mse")[1] if grid.layer_rank == 0 else None
            pipe.train_epoch(x, bad, global_batches(len(x), 8, 0, 0))
        train_layerwise("decoupled", make_layers("mlp"), 5, x, y, grid=grid, epochs=1,
                        progress=False, **kwargs)
    except ValueError as exc:
        msg = str(exc)
    else:
        raise AssertionError(f"{kind}: no ValueError")
    msgs = comm.allgather(msg)
    assert all(m == msgs[0] for m in msgs), msgs
    return msg


def check_error_aborts():
    """Rank 0 fails before sending; rank 1 would wait forever without abort-on-error."""
    grid = ProcessGrid(MPI.COMM_WORLD)
    x, y = make_data("mlp")
    model = DecoupledModel(make_layers("mlp"), 5, (12,), num_stages=2)
    pipe = DecoupledPipeline(model, grid)
    batches = global_batches(len(y), 8, 0, 0)
    if grid.layer_rank == 0:
        raise RuntimeError("deliberate failure on rank 0 before the first send")
    pipe.train_epoch(None, None, batches)


def _digits():
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    p = np.random.default_rng(0).permutation(len(y))
    return X[p[:1400]], y[p[:1400]], X[p[1400:]], y[p[1400:]]


def check_train_layerwise_digits(method="decoupled", replicas=1, asynchronous=False,
                                 stages_per_rank=1, epochs=4, min_acc=0.85):
    grid = ProcessGrid(MPI.COMM_WORLD, data_parallel=replicas)
    torch.manual_seed(0)
    layers, d = [], 64
    for _ in range(4):
        layers.append(nn.Sequential(nn.Linear(d, 48), nn.ReLU()))
        d = 48
    Xtr, ytr, Xte, yte = _digits()
    res = train_layerwise(method, layers, 10, Xtr, ytr, Xte, yte, grid=grid, epochs=epochs,
                          batch_size=32, lr=0.05, asynchronous=asynchronous, buffer_size=4,
                          stages_per_rank=stages_per_rank, ensemble=method == "decoupled",
                          progress=False)
    acc = res["final"]["acc"]
    if asynchronous:  # stale inputs make the path timing-dependent: require that it learned
        # (chance is 0.10; probes of 4 epochs reached 0.80-0.94 at the best epoch)
        assert max(res["test_acc"]) > 0.6 and acc > 0.4, res["test_acc"]
    else:
        assert acc > min_acc, res["test_acc"]
    accs = MPI.COMM_WORLD.allgather(acc)
    assert all(a == accs[0] for a in accs), accs
    if asynchronous:
        pipe = res["trainer"]
        assert pipe.comm_stats["messages"] > 0 or grid.layer_rank == grid.layer_size - 1
        return max(res["test_acc"])  # the best epoch: the final one depends on timing
    return acc


def pytest_approx(values, tol=1e-12):
    class _Approx(list):
        def __eq__(self, other):
            return len(other) == len(self) and all(abs(a - b) <= tol for a, b in zip(other, self))
    return _Approx(values)


def check_sequential_data_parallel(replicas=2, grow="top", net="mlp", n=40, batch_size=8,
                                   loss="cross_entropy"):
    """Sequential training with replicas equals one process: history losses (and test losses),
    parameters and buffers <= 1e-12 (float64); replicas bitwise identical. ``loss="mse"``:
    regression targets (n, 5), accuracies None. Returns the largest difference."""
    grid = ProcessGrid(MPI.COMM_WORLD, data_parallel=replicas)
    x, y = make_data(net, n=n, loss=loss)
    kw = dict(grow=grow, epochs_per_layer=2, head_epochs=1, finetune_epochs=1,
              batch_size=batch_size, lr=0.05, seed=5, loss=loss)
    in_shape = tuple(x.shape[1:])
    ref = SequentialTrainer(make_layers(net)[:3], 5, in_shape, **kw)
    ref.fit(x, y, x[:9], y[:9])
    tr = SequentialTrainer(make_layers(net)[:3], 5, in_shape, data_comm=grid.data_comm, **kw)
    tr.fit(x, y, x[:9], y[:9])
    sd, ref_sd = tr.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    diff = max(float((sd[k].double() - ref_sd[k].double()).abs().max()) for k in sd)
    assert [h["loss"] for h in tr.history] == pytest_approx([h["loss"] for h in ref.history])
    assert [h["test_loss"] for h in tr.history] == pytest_approx([h["test_loss"] for h in ref.history])
    if loss == "mse":
        assert all(h["train_acc"] is None and h["test_acc"] is None for h in tr.history)
    else:
        assert [h["train_acc"] for h in tr.history] == \
            pytest_approx([h["train_acc"] for h in ref.history])
    assert diff <= 1e-12, diff
    _replicas_identical([v.double() for v in sd.values()], grid.data_comm)
    return diff


def check_buffer_guard(net="mlp_counter", method="decoupled", replicas=2):
    """A module whose buffer changes in forward and that is not synchronized: the same
    ValueError on every rank, raised before any optimizer step (no parameter moved)."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm, data_parallel=replicas)
    x, y = make_data("mlp")
    layers = make_layers(net)
    before = [p.detach().clone() for l in layers for p in l.parameters()]
    try:
        if method == "decoupled":
            train_layerwise("decoupled", layers, 5, x, y, grid=grid, epochs=1, batch_size=8,
                            num_stages=2 * grid.layer_size, stages_per_rank=2, progress=False)
        else:
            SequentialTrainer(layers, 5, (12,), epochs_per_layer=1, batch_size=8,
                              data_comm=grid.data_comm).fit(x, y)
    except ValueError as exc:
        msg = str(exc)
    else:
        raise AssertionError(f"{net}/{method}: no ValueError")
    msgs = comm.allgather(msg)
    assert all(m == msgs[0] for m in msgs), msgs
    # nothing was stepped: the parameters of every layer are the initial ones
    after = [p.detach() for l in layers for p in l.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    return msg


def check_many(checks):
    """Run several checks in one launch (saves interpreter start-ups): ``[[name, kwargs], ...]``."""
    out = []
    for name, kw in checks:
        out.append(globals()[name](**kw))
    return out
