"""GlobalBatchSampler: rank-count independence, coverage, determinism and errors."""

import numpy as np
import pytest

from data import GlobalBatchSampler

# includes last batches smaller than the replica count (25 % 4 = 1, 37 % 8 = 5 < 6), batch
# sizes below it (B = 2, 3) and more replicas than samples (n = 3)
CASES = [(10, 4), (37, 8), (64, 16), (100, 7), (5, 5), (23, 4), (25, 4), (3, 2), (11, 3)]


@pytest.mark.parametrize("n,B", CASES)
@pytest.mark.parametrize("R", [1, 2, 3, 4, 6])
def test_shards_reassemble_global_batches(n, B, R):
    """Every sample is used for every n, B, R: shards (empty where a batch has fewer samples
    than replicas) concatenate to the global batches of the single-replica sampler."""
    samplers = [GlobalBatchSampler(n, B, seed=5, rank=r, num_replicas=R) for r in range(R)]
    for epoch in (0, 3):
        for s in samplers:
            s.set_epoch(epoch)
        gb = samplers[0].global_batches(epoch)
        perm = np.random.default_rng([5, epoch]).permutation(n)
        assert np.array_equal(np.concatenate(gb), perm)
        shards = [list(s) for s in samplers]
        assert all(len(sh) == len(samplers[0]) == len(gb) == -(-n // B) for sh in shards)
        for b, batch in enumerate(gb):
            parts = [shards[r][b] for r in range(R)]
            assert all(p.dtype == np.int64 and p.ndim == 1 for p in parts)
            assert [len(p) for p in parts] == [len(batch) // R + (r < len(batch) % R) for r in range(R)]
            assert np.array_equal(np.concatenate(parts), batch)
            for r in range(R):
                assert np.array_equal(parts[r], np.array_split(batch, R)[r])
                assert samplers[r].weight(batch) == len(parts[r]) / len(batch)
            assert sum(s.weight(batch) for s in samplers) == pytest.approx(1.0, abs=1e-15)
        union = np.concatenate([shards[r][b] for b in range(len(gb)) for r in range(R)])
        assert np.array_equal(np.sort(union), np.arange(n))
        assert np.array_equal(union, perm)
        for s in samplers[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(s.global_batches(epoch), gb))


def test_same_global_batches_for_any_num_replicas():
    ref = GlobalBatchSampler(103, 12, seed=9).global_batches(2)
    for R in (2, 3, 4):
        for r in range(R):
            gb = GlobalBatchSampler(103, 12, seed=9, rank=r, num_replicas=R).global_batches(2)
            assert len(gb) == len(ref) and all(np.array_equal(a, b) for a, b in zip(gb, ref))


def test_epochs_differ_and_reproducible():
    s = GlobalBatchSampler(50, 10, seed=1)
    p0, p1 = s.permutation(0), s.permutation(1)
    assert not np.array_equal(p0, p1)
    assert np.array_equal(p0, GlobalBatchSampler(50, 10, seed=1).permutation(0))
    assert not np.array_equal(p0, GlobalBatchSampler(50, 10, seed=2).permutation(0))
    s.set_epoch(1)
    first = [a.copy() for a in s]
    s.set_epoch(1)
    assert all(np.array_equal(a, b) for a, b in zip(first, s))
    assert np.array_equal(np.concatenate(first), p1)


def test_drop_last():
    s = GlobalBatchSampler(23, 4, seed=0, rank=1, num_replicas=2, drop_last=True)
    assert len(s) == 5 and len(list(s)) == 5
    gb = s.global_batches(0)
    assert all(len(b) == 4 for b in gb)
    assert np.array_equal(np.concatenate(gb), s.permutation(0)[:20])
    # remainder 1 < 2 replicas: kept (rank 1 gets an empty shard) unless drop_last asks otherwise
    keep = [GlobalBatchSampler(25, 4, seed=0, rank=r, num_replicas=2) for r in range(2)]
    assert len(keep[0]) == 7 and [len(i) for i in keep[1]][-1] == 0
    assert list(keep[1])[-1].dtype == np.int64
    assert len(GlobalBatchSampler(25, 4, seed=0, rank=0, num_replicas=2, drop_last=True)) == 6
    with pytest.raises(ValueError, match=r"num_samples=3 < global_batch_size=8"):
        GlobalBatchSampler(3, 8, seed=0, drop_last=True)


def test_errors_name_values():
    with pytest.raises(ValueError, match=r"num_replicas=0 must be >= 1"):
        GlobalBatchSampler(4, 8, seed=0, rank=0, num_replicas=0)
    with pytest.raises(ValueError, match=r"global_batch_size=0 must be >= 1"):
        GlobalBatchSampler(4, 0, seed=0)
    with pytest.raises(ValueError, match=r"rank=2 is invalid for num_replicas=2"):
        GlobalBatchSampler(10, 4, seed=0, rank=2, num_replicas=2)
    with pytest.raises(ValueError, match=r"rank=-1 is invalid"):
        GlobalBatchSampler(10, 4, seed=0, rank=-1, num_replicas=2)
    with pytest.raises(ValueError, match=r"num_samples=0 must be >= 1"):
        GlobalBatchSampler(0, 2, seed=0)
    with pytest.raises(ValueError, match=r"seed=-1 must be >= 0"):
        GlobalBatchSampler(10, 2, seed=-1)
    with pytest.raises(TypeError, match=r"global_batch_size must be an integer"):
        GlobalBatchSampler(10, 2.5, seed=0)
    s = GlobalBatchSampler(10, 2, seed=0)
    with pytest.raises(ValueError, match=r"epoch=-3 must be >= 0"):
        s.set_epoch(-3)


def test_sampler_with_numpy_ints():
    s = GlobalBatchSampler(np.int64(12), np.int32(4), seed=np.uint8(3), rank=np.int64(1), num_replicas=2)
    assert len(s) == 3 and [len(i) for i in s] == [2, 2, 2]
