"""The generated 3-D voxel set (data.voxels): determinism, class balance, shapes, the shapes'
definitions and the registry entry."""
import numpy as np
import pytest

from data import load_dataset
from data.voxels import CLASSES, _inside, _rotation, make_voxels


def test_deterministic_per_seed_and_stream():
    a = make_voxels(12, 15, seed=3, stream=0)
    b = make_voxels(12, 15, seed=3, stream=0)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    for other in (make_voxels(12, 15, seed=4, stream=0), make_voxels(12, 15, seed=3, stream=1)):
        assert not np.array_equal(a[0], other[0])


@pytest.mark.parametrize("n", [8, 13])
def test_shapes_dtypes_and_balance(n):
    x, y = make_voxels(n, 15, seed=0)
    assert x.shape == (n, 1, 15, 15, 15) and x.dtype == np.uint8 and y.dtype == np.int64
    counts = np.bincount(y, minlength=len(CLASSES))
    assert counts.max() - counts.min() <= 1 and counts.sum() == n
    assert y.min() >= 0 and y.max() < len(CLASSES)
    # every sample holds a solid: interior voxels full, the shape inside the grid
    assert all(((xi == 255).sum() > 0 and xi[0, 0, 0, 0] == 0) for xi in x)


def test_shape_definitions_and_equal_volumes():
    """Each class's solid against its formula at chosen points; volumes (Monte Carlo) within
    10 % of the unit sphere's, so the occupied volume does not tell the class."""
    o = np.zeros(3)
    assert _inside(0, o) and _inside(1, o) and not _inside(2, o) and _inside(3, o)
    assert _inside(2, np.array([0.8, 0.0, 0.0])) and not _inside(2, np.array([0.0, 0.0, 0.6]))
    assert _inside(1, np.array([0.8, 0.8, 0.8])) and not _inside(0, np.array([0.8, 0.8, 0.8]))
    assert _inside(3, np.array([0.0, 0.0, 1.0])) and not _inside(3, np.array([0.0, 0.85, 0.0]))
    R = _rotation(np.array([0.3, -1.2, 0.5, 2.0]))
    assert np.allclose(R @ R.T, np.eye(3), atol=1e-14) and np.isclose(np.linalg.det(R), 1.0)
    p = np.random.default_rng(0).uniform(-1.5, 1.5, (200_000, 3))
    vol = [27.0 * _inside(k, p).mean() for k in range(len(CLASSES))]
    assert np.allclose(vol, 4 * np.pi / 3, rtol=0.1), vol


def test_registry_entry_and_normalization():
    train, test = load_dataset("voxels", seed=1, normalize=True)
    assert train.x.shape == (1600, 1, 15, 15, 15) and test.x.shape == (400, 1, 15, 15, 15)
    assert train.x.dtype == np.float32 and train.num_classes == 4
    assert train.class_names == list(CLASSES)
    assert abs(float(train.x.mean())) < 1e-3 and abs(float(train.x.std()) - 1) < 1e-3
    assert np.array_equal(np.bincount(test.y), [100] * 4)
    with pytest.raises(ValueError, match="size=16"):
        make_voxels(4, 16)
