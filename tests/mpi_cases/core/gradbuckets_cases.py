"""GradientBuckets checks run on k ranks by tests/parallel/test_dataparallel.py: bit-for-bit equality
with average_gradients and the errors found in review (each rank asserts on its own part)."""
import torch
from mpi4py import MPI

from mgrit.parallel.dataparallel import GradientBuckets, average_gradients
from tests.mpi_cases.core.dp_cases import _params

COMM = MPI.COMM_WORLD


def check_buckets_match_average_gradients():
    """GradientBuckets == average_gradients bit for bit (mixed dtypes, small buckets, a
    parameter without grad anywhere, one with grad on rank 0 only, frozen ones)."""
    size, rank = COMM.Get_size(), COMM.Get_rank()
    sizes = [5, 7, 3, 64, 2, 2, 9]
    dts = [torch.float64, torch.float32, torch.float64, torch.float32, torch.float64,
           torch.float64, torch.float32]
    for bucket_bytes in (96, 1 << 20):
        ref = _params(sizes, dts, rank)
        ps = _params(sizes, dts, rank)
        frozen = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64), requires_grad=False)
        buckets = GradientBuckets(ps + [frozen], COMM, bucket_bytes=bucket_bytes)
        for q in (ref, ps):  # as after optimizer.zero_grad() (set_to_none) and backward:
            q[4].grad = None                                     # none anywhere
            if rank != 0:
                q[5].grad = None                                 # rank 0 only
        n_ref = average_gradients(ref, COMM, bucket_bytes=bucket_bytes)
        assert buckets.num_buckets == n_ref, (buckets.num_buckets, n_ref)
        assert ps[0].grad.data_ptr() != 0 and frozen.grad is None
        assert buckets.average() == n_ref
        for i, (p, q) in enumerate(zip(ps, ref)):
            if q.grad is None:
                assert p.grad is None, i
            else:
                assert p.grad.dtype == dts[i] and torch.equal(p.grad, q.grad), (i, p.grad, q.grad)
        # a second round after zero_grad(set_to_none=False): views re-attached, no stale values
        buckets.zero_grad()
        assert all(p.grad is None for p in ps)
        buckets.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in ps)
        for i, p in enumerate(ps):
            p.grad.add_(float(rank + i))
        buckets.average(weight=0.5)
        for i, p in enumerate(ps):
            want = 0.5 * sum(r + i for r in range(size))
            assert torch.equal(p.grad, torch.full_like(p.grad, want)), (i, p.grad, want)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    buckets = GradientBuckets([p], COMM)
    p.data = p.data.float()  # a dtype change lays the buffers out again (issue 22 item 4)
    p.grad = torch.full((3,), float(rank + 1))
    assert buckets.average() == 1 and p.grad.dtype == torch.float32, p.grad
    assert torch.equal(p.grad, torch.full((3,), (size + 1) / 2)), p.grad
    for bad in (0, -1, 2.5):
        _raises(ValueError, lambda: GradientBuckets([p], COMM, bucket_bytes=bad), "bucket_bytes")


def _raises(exc_type, fn, *words):
    try:
        fn()
    except exc_type as exc:
        for w in words:
            assert w in str(exc), (w, str(exc))
        return str(exc)
    raise AssertionError(f"{exc_type.__name__} not raised")


def check_buckets_errors():
    """Review findings: a model converted after construction (grads attached) is averaged in
    its new dtype (issue 22 item 4: the buffers are laid out again); a bad weight on one rank raises on every rank; a tensor/module instead of a
    parameter list is a TypeError; a parameter listed twice is averaged once; None grads stay
    None at construction."""
    size, rank = COMM.Get_size(), COMM.Get_rank()
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    gb = GradientBuckets(m.parameters(), COMM)
    assert m.weight.grad is None, "construction must keep None gradients None"
    m(torch.ones(4, 3)).sum().backward()
    gb.average()
    m.double()  # converts the attached .grad views in place
    gb.zero_grad()
    m(torch.full((4, 3), float(rank + 1), dtype=torch.float64)).sum().backward()
    want = COMM.allreduce(m.weight.grad.numpy().copy()) / size
    gb.average()
    assert m.weight.grad.dtype == torch.float64 and torch.allclose(
        m.weight.grad, torch.from_numpy(want), rtol=1e-15, atol=0), (m.weight.grad, want)
    gb.zero_grad(set_to_none=False)
    assert m.weight.grad.dtype == torch.float64 and not m.weight.grad.any()
    # a bad weight on the last rank only: every rank raises the same message, no hang
    q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    q.grad = torch.ones(2, dtype=torch.float64)
    gq = GradientBuckets([q], COMM)
    for bad in (float("nan"), "0.5", True, float("inf")):
        w = bad if rank == size - 1 else 0.5
        msgs = COMM.allgather(_raises(ValueError, lambda: gq.average(weight=w), "weight="))
        assert len(set(msgs)) == 1 and f"rank {size - 1}" in msgs[0], msgs
        msgs = COMM.allgather(_raises(ValueError, lambda: average_gradients([q], COMM, weight=w),
                                      "weight="))
        assert len(set(msgs)) == 1, msgs
    assert torch.equal(q.grad, torch.ones(2, dtype=torch.float64)), "touched before the error"
    assert gq.average(weight=0.0) == 1 and not q.grad.any()  # 0 is allowed (an empty shard)
    _raises(TypeError, lambda: GradientBuckets(m.weight, COMM), "iterable of tensors", "Parameter")
    _raises(TypeError, lambda: average_gradients(m, COMM), "Linear")
    _raises(TypeError, lambda: GradientBuckets([q], None), "communicator")
    # tied parameter listed twice, small buckets, weights summing to more than 1
    t = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    for fn in (lambda: GradientBuckets([t, t], COMM, bucket_bytes=8).average(weight=1.0),
               lambda: average_gradients([t, t], COMM, bucket_bytes=8, weight=1.0)):
        t.grad = torch.full((3,), float(rank + 1), dtype=torch.float64)
        assert fn() == 1, "a duplicate must not get its own bucket"
        want = float(sum(range(1, size + 1)))
        assert torch.equal(t.grad, torch.full((3,), want, dtype=torch.float64)), t.grad
