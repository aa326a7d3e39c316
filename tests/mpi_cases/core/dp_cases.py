"""Data-parallel checks run on k ranks by tests/parallel/test_dataparallel.py (each rank asserts on its
own part; every rank must raise the same error in the error checks)."""
import torch
from mpi4py import MPI

from data import GlobalBatchSampler, load_dataset
from mgrit.parallel.dataparallel import (GradientBuckets, average_gradients, broadcast_parameters,
                                check_replicas_consistent)
from mgrit.parallel.procgrid import ProcessGrid, device_for_rank

COMM = MPI.COMM_WORLD
_DATA = {}


def _digits():
    if "train" not in _DATA:
        _DATA["train"] = load_dataset("digits")[0]
    return _DATA["train"]


def _net(seed=0, extra=False, width=32):
    torch.manual_seed(seed)
    layers = [torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Tanh(), torch.nn.Flatten(),
              torch.nn.Linear(4 * 64, width), torch.nn.Tanh()]
    if extra:
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    layers += [torch.nn.Linear(width, 10)]
    return torch.nn.Sequential(*layers).double()


def _train(net, sampler, train, steps, comm=None, bucket_bytes=None, weighted=False,
           persistent=None):
    """``steps`` SGD-with-momentum steps on the sampler's shards; returns Allreduce calls.
    ``persistent``: average with :class:`GradientBuckets`, cleared by its ``zero_grad()``
    (``"buckets"``), by ``zero_grad(set_to_none=False)`` (``"views"``: backward accumulates
    into the buffers) or by ``optimizer.zero_grad()`` (``"set_to_none"``)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    buckets = None if persistent is None else GradientBuckets(net.parameters(), comm, **kw)
    calls = []
    batches = sampler.global_batches(0)
    for b in batches[:steps]:
        idx = sampler.shard(b)
        x, y = train.get_batch(idx)
        x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y)
        if persistent == "views":
            buckets.zero_grad(set_to_none=False)
            views = [p.grad for p in net.parameters()]
        elif persistent == "buckets":
            buckets.zero_grad()
            assert all(p.grad is None for p in net.parameters())
        else:
            opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        if comm is not None:
            w = {"weight": len(idx) / len(b)} if weighted else {}
            if buckets is None:
                calls.append(average_gradients(net.parameters(), comm, **kw, **w))
            else:
                calls.append(buckets.average(**w))
        if persistent == "views":  # backward accumulated into the buffers, no new tensors
            assert all(p.grad is v for p, v in zip(net.parameters(), views))
        opt.step()
    return calls


def check_dp_equals_serial(global_batch=64, steps=3, bucket_bytes=None, weighted=False,
                           persistent=None):
    """P_D = size replicas vs 1 rank (computed here, serially, on the full global batches)."""
    train = _digits()
    grid = ProcessGrid(COMM, data_parallel=COMM.Get_size())
    ref = _net()
    _train(ref, GlobalBatchSampler(len(train), global_batch, seed=3), train, steps)

    net = _net()
    check_replicas_consistent(net.parameters(), grid.data_comm, check_values=True)
    sampler = GlobalBatchSampler(len(train), global_batch, seed=3, rank=grid.data_rank,
                                 num_replicas=grid.data_size)
    calls = _train(net, sampler, train, steps, grid.data_comm, bucket_bytes, weighted,
                   persistent)
    assert len(calls) == steps
    if bucket_bytes is None:
        assert calls == [1] * steps, f"default bucket should be one Allreduce per step: {calls}"
    else:
        assert min(calls) > 1, f"small buckets should give several calls: {calls}"
    err = max(((p - q).abs().max() / q.abs().max()).item()
              for p, q in zip(net.parameters(), ref.parameters()))
    assert err <= 1e-12, f"rank {COMM.rank}: data-parallel parameters differ from serial: {err:.3e}"
    moved = max((p - q).abs().max().item() for p, q in zip(net.parameters(), _net().parameters()))
    assert moved > 1e-3, "training did not move the parameters: the test would not discriminate"
    # replicas stay bit-identical
    check_replicas_consistent(net.parameters(), grid.data_comm, check_values=True)
    return {"rel_err": err, "calls": calls}


def check_grid_layout(data_parallel):
    size, rank = COMM.Get_size(), COMM.Get_rank()
    g = ProcessGrid(COMM, data_parallel=data_parallel)
    PL = size // data_parallel
    assert (g.layer_size, g.data_size) == (PL, data_parallel)
    assert (g.layer_rank, g.data_rank) == (rank % PL, rank // PL)
    assert g.world_rank(g.layer_rank, g.data_rank) == rank
    assert g.layer_comm.Get_size() == PL and g.layer_comm.Get_rank() == g.layer_rank
    assert g.data_comm.Get_size() == data_parallel and g.data_comm.Get_rank() == g.data_rank
    # layer groups are consecutive world ranks; data groups hold the same layer rank
    assert g.layer_comm.allgather(rank) == list(range(g.data_rank * PL, (g.data_rank + 1) * PL))
    assert g.data_comm.allgather(rank) == [g.layer_rank + d * PL for d in range(data_parallel)]
    assert 0 <= g.local_rank < g.local_size <= size
    dev = device_for_rank(COMM)
    assert dev == g.device
    if not torch.cuda.is_available():
        assert dev.type == "cpu"
    g.free()
    return repr(g)


def check_bad_grid(value):
    try:
        ProcessGrid(COMM, data_parallel=value)
    except ValueError as exc:
        msg = str(exc)
        assert "P_D" in msg and str(COMM.Get_size()) in msg, f"unclear message: {msg}"
        return msg
    raise AssertionError(f"data_parallel={value!r} on {COMM.Get_size()} ranks was accepted")


def check_grid_disagree():
    try:
        ProcessGrid(COMM, data_parallel=1 if COMM.Get_rank() == 0 else 2)
    except ValueError as exc:
        assert "disagree" in str(exc), str(exc)
        return str(exc)
    raise AssertionError("ranks passing different P_D were accepted")


def check_mismatched_replicas(kind):
    rank = COMM.Get_rank()
    odd = rank == COMM.Get_size() - 1
    if kind == "count":
        net = _net(extra=odd)
    elif kind == "shape":
        net = _net(width=33 if odd else 32)
    else:  # values
        net = _net(seed=1 if odd else 0)
    try:
        check_replicas_consistent(net.parameters(), COMM, what="toy model",
                                  check_values=kind == "values")
    except ValueError as exc:
        msg = str(exc)
        assert "toy model replicas differ" in msg and f"rank {COMM.Get_size() - 1}" in msg, msg
        if kind == "count":
            assert "has 6 parameter tensors" in msg and "has 8" in msg, msg
        if kind == "shape":
            assert "first difference at parameter 2" in msg, msg
        return msg
    raise AssertionError(f"mismatched replicas ({kind}) were accepted")


def check_broadcast_fixes_values():
    net = _net(seed=COMM.Get_rank())
    calls = broadcast_parameters(net.parameters(), COMM, root=0)
    assert calls == 1
    check_replicas_consistent(net.parameters(), COMM, check_values=True)
    ref = _net(seed=0)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), ref.parameters()))


def _params(sizes, dtypes, rank):
    ps = []
    for i, (n, dt) in enumerate(zip(sizes, dtypes)):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dt))
        p.grad = torch.arange(n, dtype=dt) + 10.0 * rank + i
        ps.append(p)
    return ps


def _expected(n, dt, i, size):
    return torch.arange(n, dtype=dt) + i + 10.0 * (size - 1) / 2


def check_bucket_counts():
    size, rank = COMM.Get_size(), COMM.Get_rank()
    sizes = [5, 7, 3, 64, 2, 2, 9]
    f64 = [torch.float64] * len(sizes)
    # default: one call
    ps = _params(sizes, f64, rank)
    assert average_gradients(ps, COMM) == 1
    for i, p in enumerate(ps):
        assert torch.equal(p.grad, _expected(sizes[i], torch.float64, i, size)), (i, p.grad)
    # 96 bytes = 12 doubles: [5,7] [3] [64] [2,2] [9] -> 5 calls
    ps = _params(sizes, f64, rank)
    assert average_gradients(ps, COMM, bucket_bytes=96) == 5
    for i, p in enumerate(ps):
        assert torch.equal(p.grad, _expected(sizes[i], torch.float64, i, size))
    # one call per parameter
    ps = _params(sizes, f64, rank)
    assert average_gradients(ps, COMM, bucket_bytes=1) == len(sizes)
    for i, p in enumerate(ps):
        assert torch.equal(p.grad, _expected(sizes[i], torch.float64, i, size))


def check_mixed_dtypes():
    size, rank = COMM.Get_size(), COMM.Get_rank()
    sizes = [4, 3, 5, 6, 2]
    dts = [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32]
    ps = _params(sizes, dts, rank)
    assert average_gradients(ps, COMM) == 2, "one bucket per dtype expected"
    for i, p in enumerate(ps):
        assert p.grad.dtype == dts[i]
        assert torch.equal(p.grad, _expected(sizes[i], dts[i], i, size)), (i, p.grad)
    # float64 precision is kept (a float32 round trip would lose the 1e-12 part)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = torch.full((3,), 1.0 + 1e-12 * (rank + 1), dtype=torch.float64)
    average_gradients([p], COMM)
    want = 1.0 + 1e-12 * (size + 1) / 2
    assert abs(p.grad[0].item() - want) < 1e-15, p.grad
    # 4 float32 + 4 float64 of 8 bytes of space: float32 [4] (16 B > 8, own bucket) ...
    ps = _params(sizes, dts, rank)
    assert average_gradients(ps, COMM, bucket_bytes=8) == len(sizes)


def check_none_grads():
    size, rank = COMM.Get_size(), COMM.Get_rank()
    a = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))   # no grad anywhere
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))   # grad on rank 0 only
    c = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))   # grad everywhere
    d = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64), requires_grad=False)
    if rank == 0:
        b.grad = torch.full((4,), float(size), dtype=torch.float64)
    c.grad = torch.full((2,), float(rank), dtype=torch.float64)
    assert average_gradients([a, b, c, d], COMM) == 1
    assert a.grad is None, "a parameter without grad on every replica must keep grad None"
    assert d.grad is None
    assert torch.equal(b.grad, torch.ones(4, dtype=torch.float64)), b.grad
    assert torch.equal(c.grad, torch.full((2,), (size - 1) / 2, dtype=torch.float64)), c.grad


def check_weight():
    rank = COMM.Get_rank()
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = torch.full((2,), float(rank + 1), dtype=torch.float64)
    w = (rank + 1) / sum(range(1, COMM.Get_size() + 1))
    average_gradients([p], COMM, weight=w)
    want = sum((r + 1) * (r + 1) for r in range(COMM.Get_size())) / sum(range(1, COMM.Get_size() + 1))
    assert abs(p.grad[0].item() - want) < 1e-14, (p.grad, want)


def check_bad_arguments():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = torch.ones(2, dtype=torch.float64)
    for bad in (0, -5, 1.5, True):
        try:
            average_gradients([p], COMM, bucket_bytes=bad)
        except ValueError as exc:
            assert "bucket_bytes" in str(exc)
        else:
            raise AssertionError(f"bucket_bytes={bad!r} accepted")
    h = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    h.grad = torch.ones(2, dtype=torch.float16)
    try:
        average_gradients([p, h], COMM)
    except ValueError as exc:
        assert "float16" in str(exc) and "float32" in str(exc), str(exc)
    else:
        raise AssertionError("float16 accepted")
    assert torch.equal(p.grad, torch.ones(2, dtype=torch.float64)), "grads touched before the error"


def _lp_parts(seed=5, width=8, classes=10, in_features=64):
    """Opening / closing layers built identically on every rank (seeded)."""
    torch.manual_seed(seed)
    opening = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_features, width)).double()
    torch.manual_seed(seed + 1)
    closing = torch.nn.Linear(width, classes).double()
    return opening, closing


def check_layer_parallel_dp_equals_serial(data_parallel=2, n_layers=8, width=8, global_batch=32,
                                          steps=3):
    """P_L x P_D grid, exact MGRIT forward/adjoint solves, gradients averaged over data_comm
    (open/close layers on the ranks that hold them) == serial training on the global batch."""
    import copy

    from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, serial_resnet
    from mgrit.options import MGRITOptions

    train = _digits()
    grid = ProcessGrid(COMM, data_parallel=data_parallel)

    def make(k):
        return DenseStep(width, "tanh").double()

    opening, closing = _lp_parts(width=width)
    ref = torch.nn.Sequential(copy.deepcopy(opening), *serial_resnet(make, n_layers, T=1.0, seed=2),
                              copy.deepcopy(closing))

    exact = MGRITOptions(max_levels=2, cfactor=2, tol=1e-13, max_iter=50)
    resnet = LayerParallelResNet.build(make, n_layers, (width,), comm=grid.layer_comm, seed=2,
                                       T=1.0, forward=exact, backward=exact)
    net = LayerParallelNet(opening, resnet, closing)
    params = list(net.parameters())
    check_replicas_consistent(params, grid.data_comm, what=f"layer rank {grid.layer_rank}",
                              check_values=True)
    sampler = GlobalBatchSampler(len(train), global_batch, seed=4, rank=grid.data_rank,
                                 num_replicas=grid.data_size)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    calls = []
    for b in sampler.global_batches(0)[:steps]:
        x, y = train.get_batch(b)
        x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()

        xs, ys = train.get_batch(sampler.shard(b))
        xs, ys = torch.as_tensor(xs, dtype=torch.float64), torch.as_tensor(ys)
        opt.zero_grad()
        net.loss(net(xs), ys).backward()
        calls.append(average_gradients(params, grid.data_comm))
        opt.step()
    assert calls == [1] * steps, calls
    got = net.to_serial()
    ref_p, got_p = list(ref.parameters()), list(got.parameters())
    assert len(ref_p) == len(got_p)
    err = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(got_p, ref_p))
    assert err <= 1e-10, f"rank {COMM.rank}: layer x data parallel differs from serial: {err:.3e}"
    moved = max((p - q).abs().max().item() for p, q in zip(ref_p, _lp_parts(width=width)[0].parameters()))
    assert moved > 1e-3, "training did not move the opening layer"
    check_replicas_consistent(params, grid.data_comm, check_values=True)
    return {"rel_err": err, "P_L": grid.layer_size, "P_D": grid.data_size}
