"""CIFAR-10 python pickle batches: exact read-back, both root layouts, every pickle flavour
(Python 2 cPickle as in the official files, protocols 2/4/5 of this Python), bad inputs, and
crafted pickles that would run code (a marker file proves nothing ran)."""

import builtins
import os
import pickle
import re
import subprocess

import numpy as np
import pytest

from data import DataFormatError, load_dataset, read_cifar_batch

from .formats import CIFAR_NAMES, make_cifar_arrays, py2_batch_pickle, write_cifar


@pytest.mark.parametrize("layout,protocol", [("parent", 2), ("folder", 2), ("parent", "py2"),
                                             ("parent", 4), ("parent", 5)])
def test_cifar_read_back_exactly(tmp_path, layout, protocol):
    batches = make_cifar_arrays(seed=3)
    folder = write_cifar(tmp_path / "cifar-10-batches-py", batches, protocol=protocol)
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


def test_cifar_meta_label_names_not_a_list(tmp_path):
    folder = write_cifar(tmp_path / "c", make_cifar_arrays())
    for bad in (7, [b"a", 3]):
        (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": bad}))
        with pytest.raises(DataFormatError, match=r"batches\.meta: b'label_names' must be a list of byte strings"):
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


def test_py2_pickle_has_the_official_globals():
    """The hand-written Python 2 pickle names the globals the official files name (an
    independent check of the writer the restricted reader is tested against)."""
    import pickletools
    data, labels = make_cifar_arrays()["data_batch_1"]
    raw = py2_batch_pickle({b"data": data, b"labels": labels})
    globs = {arg for op, arg, _ in pickletools.genops(raw) if op.name == "GLOBAL"}
    assert globs == {"numpy.core.multiarray _reconstruct", "numpy ndarray", "numpy dtype"}
    assert raw.startswith(b"\x80\x02}(U\x04data")  # as the first bytes of data_batch_1


class _Run:
    """Pickles as a call of ``func(*args)`` (what a crafted file does through __reduce__)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _crafted(kind, marker):
    touch = f"touch {marker}"
    return {"os.system": _Run(os.system, touch),
            "eval": _Run(builtins.eval, f"open({str(marker)!r}, 'w').close()"),
            "subprocess": _Run(subprocess.check_call, ["touch", str(marker)]),
            "codec": _Run(__import__("_codecs").encode, "x", "rot13"),
            "numpy.load": _Run(np.load, str(marker))}[kind]


@pytest.mark.parametrize("where", ["data", "labels", "meta"])
@pytest.mark.parametrize("kind,global_name", [("os.system", "posix.system"), ("eval", "builtins.eval"),
                                              ("subprocess", "subprocess.check_call"),
                                              ("numpy.load", "numpy.load")])
@pytest.mark.parametrize("protocol", [2, 5])
def test_crafted_pickle_runs_nothing_and_names_the_file(tmp_path, where, kind, global_name, protocol):
    marker = tmp_path / "pwned"
    folder = write_cifar(tmp_path / "c", make_cifar_arrays())
    evil = _crafted(kind, marker)
    if where == "meta":
        bad, d = folder / "batches.meta", {b"label_names": [evil] + CIFAR_NAMES[1:]}
    else:
        data, labels = make_cifar_arrays()["data_batch_2"]
        bad = folder / "data_batch_2"
        d = {b"data": evil if where == "data" else data,
             b"labels": [labels[0], [evil]] if where == "labels" else labels}
    with open(bad, "wb") as f:
        pickle.dump(d, f, protocol=protocol)
    with pytest.raises(DataFormatError) as e:
        load_dataset("cifar10", root=folder)
    msg = str(e.value)
    # protocol 2 writes Python 2 module names (__builtin__, commands) for some globals
    module, name = global_name.rsplit(".", 1)
    assert re.match(re.escape(f"{bad}: the pickle references the global '") + r"[\w.]+\." + name + "'",
                    msg), msg
    assert protocol == 2 or f"'{global_name}'" in msg, msg
    assert "numpy.ndarray" in msg  # says what is allowed
    assert not marker.exists(), "the crafted pickle ran code"


def test_codecs_encode_only_latin1(tmp_path):
    p = tmp_path / "data_batch_1"
    p.write_bytes(pickle.dumps({b"data": _crafted("codec", None)}, protocol=2))
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + r": not a readable CIFAR pickle .*rot13"):
        read_cifar_batch(p)


def test_crafted_numpy_object_array_is_rejected(tmp_path):
    """An object array (its elements are unpickled by the same restricted reader) is no CIFAR data."""
    p = tmp_path / "data_batch_1"
    p.write_bytes(pickle.dumps({b"data": np.array([[b"x"] * 3072], dtype=object), b"labels": [1]}))
    with pytest.raises(DataFormatError, match=r"b'data' must be uint8 of shape \(n, 3072\), found object"):
        read_cifar_batch(p)


@pytest.mark.parametrize("data,labels,msg", [
    ([[1, 2], [3]], [0, 1], r"b'data'/b'labels' are not arrays"),
    (np.zeros((2, 3072), np.uint8), [0, [1, 2]], r"b'data'/b'labels' are not arrays"),
    (np.zeros((2, 3072), np.uint8), [0.5, 1.0], r"labels must be integers, got dtype float64"),
    (np.zeros((2, 3072), np.float32), [0, 1], r"b'data' must be uint8 of shape \(n, 3072\), found float32"),
    ({b"x": 1}, [0], r"b'data' must be uint8 of shape"),
])
def test_malformed_content_is_a_data_format_error(tmp_path, data, labels, msg):
    p = tmp_path / "data_batch_1"
    p.write_bytes(pickle.dumps({b"data": data, b"labels": labels}, protocol=4))
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + ": " + msg):
        read_cifar_batch(p)
