"""MPI checks of :mod:`layerwise` (run through tests.mpi_harness.run_mpi)."""
import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from layerwise import (DecoupledModel, DecoupledPipeline, DecoupledTrainer, ResidualStep,
                       SequentialTrainer, global_batches, train_layerwise)
from mgrit.parallel.procgrid import ProcessGrid


def make_layers(net: str, seed: int = 0):
    """float64 test networks: an MLP of 6 blocks, or a small CNN/ResNet of 6 blocks."""
    torch.manual_seed(seed)
    if net == "mlp":
        dims = [12, 16, 16, 16, 16, 16, 16]
        layers = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(dims, dims[1:])]
    elif net == "resnet":
        conv = lambda: nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Tanh())
        layers = [nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU())] + \
                 [ResidualStep(conv(), h=0.5) for _ in range(5)]
    else:
        raise ValueError(net)
    return [l.double() for l in layers]


def make_data(net: str, n: int = 48, classes: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shape = (12,) if net == "mlp" else (1, 6, 6)
    return (torch.randn((n, *shape), generator=g, dtype=torch.float64),
            torch.randint(0, classes, (n,), generator=g))


def check_pipeline_equals_serial(net="mlp", num_stages=2, replicas=1, stages_per_rank=1,
                                 optimizer="sgd", epochs=2, batch_size=8, head="linear"):
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(comm, data_parallel=replicas)
    x, y = make_data(net)
    kw = dict(num_classes=5, in_shape=tuple(x.shape[1:]), num_stages=num_stages, head=head, seed=3)
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
        assert np.allclose(m_ref["stage_train_acc"], m_pipe["stage_train_acc"], atol=1e-12)
    diff = 0.0
    for k in pipe.owned:
        for a, b in zip(model.stage_parameters(k), ref.stage_parameters(k)):
            diff = max(diff, float((a - b).abs().max()))
    assert diff <= 1e-12, f"rank {comm.Get_rank()} stages {pipe.owned}: max diff {diff}"
    # every stage actually moved
    fresh = DecoupledModel(make_layers(net), **kw)
    for k in pipe.owned:
        moved = max(float((a - b).abs().max()) for a, b in
                    zip(model.stage_parameters(k), fresh.stage_parameters(k)))
        assert moved > 1e-4, f"stage {k} did not train"
    ev = pipe.evaluate(x if grid.layer_rank == 0 else None, y if grid.layer_rank == 0 else None,
                       batch_size=7, ensemble=True)
    ev_ref = ref.evaluate(x, y, batch_size=7, ensemble=True)
    assert abs(ev["loss"] - ev_ref["loss"]) <= 1e-12, (ev, ev_ref)
    for key in ("acc", "ensemble_acc"):
        assert ev[key] == ev_ref[key], (key, ev, ev_ref)
    assert ev["stage_acc"] == ev_ref["stage_acc"]
    sd = pipe.state_dict()
    if comm.Get_rank() == 0:
        ref_sd = ref.state_dict()
        assert list(sd) == list(ref_sd)
        worst = max(float((sd[k] - ref_sd[k]).abs().max()) for k in sd)
        assert worst <= 1e-12, worst
        fresh.load_state_dict(sd)
        assert abs(fresh.evaluate(x, y)["loss"] - ref.evaluate(x, y)["loss"]) <= 1e-12
    return diff


def check_bad_config_identical(kind):
    comm = MPI.COMM_WORLD
    x, y = make_data("mlp")
    kwargs = {"ranks": dict(num_stages=comm.Get_size() + 1),
              "stages": dict(num_stages=7),
              "head": dict(head="pool"),
              "spr": dict(num_stages=3, stages_per_rank=2)}[kind]
    grid = ProcessGrid(comm)
    try:
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


def check_sequential_data_parallel(replicas=2, grow="top"):
    grid = ProcessGrid(MPI.COMM_WORLD, data_parallel=replicas)
    x, y = make_data("mlp", n=40)
    kw = dict(grow=grow, epochs_per_layer=2, head_epochs=1, finetune_epochs=1, batch_size=8,
              lr=0.05, seed=5)
    ref = SequentialTrainer(make_layers("mlp")[:3], 5, (12,), **kw)
    ref.fit(x, y)
    tr = SequentialTrainer(make_layers("mlp")[:3], 5, (12,), data_comm=grid.data_comm, **kw)
    tr.fit(x, y)
    sd, ref_sd = tr.state_dict(), ref.state_dict()
    diff = max(float((sd[k] - ref_sd[k]).abs().max()) for k in sd)
    assert [h["loss"] for h in tr.history] == pytest_approx([h["loss"] for h in ref.history])
    assert diff <= 1e-12, diff
    return diff


def check_many(checks):
    """Run several checks in one launch (saves interpreter start-ups): ``[[name, kwargs], ...]``."""
    out = []
    for name, kw in checks:
        out.append(globals()[name](**kw))
    return out
