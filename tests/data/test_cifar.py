"""CIFAR-10 python pickle batches: exact read-back, both root layouts, bad inputs."""

import re

import numpy as np
import pytest

from data import DataFormatError, load_dataset, read_cifar_batch

from .formats import CIFAR_NAMES, make_cifar_arrays, write_cifar


@pytest.mark.parametrize("layout", ["parent", "folder"])
def test_cifar_read_back_exactly(tmp_path, layout):
    batches = make_cifar_arrays(seed=3)
    folder = write_cifar(tmp_path / "cifar-10-batches-py", batches)
    root = tmp_path if layout == "parent" else folder
    train, test = load_dataset("cifar10", root=root, normalize=False)
    xtr = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    ytr = np.concatenate([batches[f"data_batch_{i}"][1] for i in range(1, 6)])
    assert train.x.shape == (20, 3, 32, 32) and train.x.dtype == np.uint8
    assert np.array_equal(train.x.reshape(20, 3072), xtr)
    # channel-major rows: first 1024 values are the red plane
    assert np.array_equal(train.x[0, 0].ravel(), xtr[0, :1024])
    assert np.array_equal(train.x[0, 2].ravel(), xtr[0, 2048:])
    assert train.y.dtype == np.int64 and np.array_equal(train.y, ytr)
    assert np.array_equal(test.x.reshape(4, -1), batches["test_batch"][0])
    assert np.array_equal(test.y, batches["test_batch"][1])
    assert train.class_names == [n.decode() for n in CIFAR_NAMES] and train.num_classes == 10


def test_cifar_per_channel_normalization(tmp_path):
    batches = make_cifar_arrays(seed=4)
    write_cifar(tmp_path / "cifar-10-batches-py", batches)
    raw, _ = load_dataset("cifar10", root=tmp_path, normalize=False)
    train, test = load_dataset("cifar10", root=tmp_path)
    xf = raw.x.astype(np.float64)
    assert train.normalization["mean"] == pytest.approx(list(xf.mean(axis=(0, 2, 3))))
    assert train.normalization["std"] == pytest.approx(list(xf.std(axis=(0, 2, 3))))
    assert len(train.normalization["mean"]) == 3
    np.testing.assert_allclose(train.x.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(train.x.std(axis=(0, 2, 3)), 1, atol=1e-4)


def test_cifar_missing_file(tmp_path):
    folder = write_cifar(tmp_path / "cifar-10-batches-py", make_cifar_arrays())
    (folder / "data_batch_4").unlink()
    (folder / "batches.meta").unlink()
    with pytest.raises(FileNotFoundError, match=r"data_batch_4.*batches\.meta.*cifar-10-python\.tar\.gz"):
        load_dataset("cifar10", root=tmp_path)


@pytest.mark.parametrize("key", [b"data", b"labels"])
def test_cifar_missing_key(tmp_path, key):
    write_cifar(tmp_path / "cifar-10-batches-py", make_cifar_arrays(), drop_key=key)
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    with pytest.raises(DataFormatError, match=re.escape(str(bad)) + r": CIFAR pickle is missing required key " + re.escape(repr(key))):
        load_dataset("cifar10", root=tmp_path)


def test_cifar_meta_missing_key(tmp_path):
    import pickle

    folder = write_cifar(tmp_path / "c", make_cifar_arrays())
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"num_vis": 3072}, f)
    with pytest.raises(DataFormatError, match=r"batches\.meta: .*missing required key b'label_names'"):
        load_dataset("cifar10", root=folder)


def test_cifar_labels_out_of_range_and_bad_shape(tmp_path):
    batches = make_cifar_arrays()
    batches["test_batch"][1][2] = 10
    folder = write_cifar(tmp_path / "c", batches)
    with pytest.raises(DataFormatError, match=r"test_batch: label 10 at index 2 is out of range"):
        load_dataset("cifar10", root=folder)
    batches = make_cifar_arrays()
    batches["data_batch_1"] = (batches["data_batch_1"][0][:, :100], batches["data_batch_1"][1])
    folder = write_cifar(tmp_path / "d", batches)
    with pytest.raises(DataFormatError, match=r"data_batch_1: b'data' must be uint8 of shape \(n, 3072\)"):
        load_dataset("cifar10", root=folder)


def test_cifar_not_a_pickle(tmp_path):
    p = tmp_path / "data_batch_1"
    p.write_bytes(b"definitely not a pickle")
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + ": not a readable CIFAR pickle"):
        read_cifar_batch(p)
