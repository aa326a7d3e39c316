"""HDF5 cache: prepare via the CLI, exact read-back, lazy reads, bad files, interrupted writes."""

import pickle
import re

import h5py
import numpy as np
import pytest

import data.h5cache as h5cache
from data import (DataFormatError, FORMAT_VERSION, GlobalBatchSampler, available_datasets, load_dataset,
                  open_h5_pair, open_h5_split, prepare)
from data.__main__ import main

from .formats import make_mnist_arrays, write_mnist


@pytest.fixture(scope="module")
def digits_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    assert main(["prepare", "digits", "--out", str(out), "--seed", "3"]) == 0
    return out


def _copy(src, dst):
    dst.write_bytes(src.read_bytes())
    return dst


def test_prepare_writes_files_with_attributes(digits_cache, capsys):
    files = sorted(p.name for p in digits_cache.iterdir())
    assert files == ["digits-test.h5", "digits-train.h5"]
    raw_train, raw_test = load_dataset("digits", seed=3, normalize=False)
    for path, ref in ((digits_cache / "digits-train.h5", raw_train), (digits_cache / "digits-test.h5", raw_test)):
        with h5py.File(path, "r") as f:
            assert f["x"].dtype == np.uint8 and f["y"].dtype == np.dtype("<i8")
            assert np.array_equal(f["x"][()], ref.x) and np.array_equal(f["y"][()], ref.y)
            a = f.attrs
            assert int(a["format_version"]) == FORMAT_VERSION == 1
            assert a["name"] == "digits" and "load_digits" in a["source"]
            assert a["checksum"] == h5cache.checksum(ref.x, ref.y)
            assert int(a["num_classes"]) == 10
            import json
            assert json.loads(a["class_names"]) == [str(i) for i in range(10)]
            norm = json.loads(a["normalization"])
            assert norm["mean"] == pytest.approx(raw_train.normalization["mean"])


def test_h5_read_back_exactly_and_normalized(digits_cache):
    raw_train, raw_test = load_dataset("digits", seed=3, normalize=False)
    tr, te = load_dataset("hdf5", root=digits_cache, normalize=False)
    assert np.array_equal(tr.x[:], raw_train.x) and np.array_equal(tr.y, raw_train.y)
    assert np.array_equal(te.x[:], raw_test.x) and np.array_equal(te.y, raw_test.y)
    assert tr.x.dtype == np.uint8 and tr.input_shape == (1, 8, 8) and len(tr) == 1437
    assert tr.class_names == raw_train.class_names and tr.num_classes == 10
    ntr, _ = load_dataset("digits", seed=3, flatten=True)
    htr, _ = load_dataset("hdf5", root=digits_cache / "digits-test.h5", flatten=True)
    assert htr.x.shape == (1437, 64) and htr.x.dtype == np.float32
    assert np.array_equal(htr.x[:], ntr.x)
    assert htr.normalization == ntr.normalization
    assert np.array_equal(htr.load().x, ntr.x)


@pytest.mark.parametrize("reader", ["auto", "h5py"])
def test_lazy_reads_any_index_order(digits_cache, reader):
    s = open_h5_split(digits_cache / "digits-train.h5", normalize=False, verify=True, reader=reader)
    full = s.x[:]
    with h5py.File(digits_cache / "digits-train.h5", "r") as f:
        assert np.array_equal(full, f["x"][()])
    rng = np.random.default_rng(0)
    for idx in (rng.permutation(len(s))[:37], np.array([5, 5, 0, -1, 3]), np.arange(100, 160)[::-1],
                np.array([], dtype=np.int64), np.array([1436, 0])):
        assert np.array_equal(s.x[idx], full[idx])
    mask = rng.random(len(s)) < 0.3
    assert np.array_equal(s.x[mask], full[mask])
    assert np.array_equal(s.x[7], full[7]) and np.array_equal(s.x[-2], full[-2])
    assert np.array_equal(s.x[10:3:-2], full[10:3:-2]) and np.array_equal(s.x[3:50:4], full[3:50:4])
    xb, yb = s.get_batch([9, 2])
    assert np.array_equal(xb, full[[9, 2]]) and np.array_equal(yb, s.y[[9, 2]])
    with pytest.raises(IndexError, match=r"index 1437 is out of range for 1437 rows"):
        s.x[np.array([0, 1437])]
    out = s.x[np.array([3, 3])]
    out[0] = 0  # results are copies, never read-only views of the file
    assert np.array_equal(s.x[3], full[3])
    s.close()
    s2 = pickle.loads(pickle.dumps(s))  # picklable (handles reopened lazily in the new process)
    assert np.array_equal(s2.x[[4, 1]], full[[4, 1]])


def test_h5py_reader_reads_only_requested_rows(digits_cache):
    s = open_h5_split(digits_cache / "digits-train.h5", normalize=False, reader="h5py")
    reads = []
    ds = s._dataset()
    orig = type(ds).__getitem__
    try:
        type(ds).__getitem__ = lambda self, k: (reads.append(k), orig(self, k))[1]
        s.x[np.array([1000, 3])]
    finally:
        type(ds).__getitem__ = orig
    assert len(reads) == 1 and np.array_equal(np.asarray(reads[0]), [3, 1000])
    s.close()


def test_other_chunking_and_compression_read_the_same(digits_cache, tmp_path):
    def rechunk(f):
        x = f["x"][()]
        del f["x"]
        f.create_dataset("x", data=x, chunks=(16, 1, 8, 8), compression="gzip", fletcher32=True)
    p = _mutate(digits_cache, tmp_path, rechunk)
    ref = open_h5_split(digits_cache / "digits-train.h5", normalize=False)
    s = open_h5_split(p, normalize=False, verify=True)
    idx = np.random.default_rng(1).permutation(len(s))[:50]
    assert np.array_equal(s.x[idx], ref.x[idx])
    with pytest.raises(ValueError, match=r"reader='memmap' is no longer offered: .*Fletcher-32"):
        open_h5_split(p, reader="memmap")


@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_rank_shards_over_epoch_read_from_h5(digits_cache, R):
    s = open_h5_split(digits_cache / "digits-test.h5", normalize=False)
    full = s.x[:]
    collected = []
    samplers = [GlobalBatchSampler(len(s), 32, seed=7, rank=r, num_replicas=R) for r in range(R)]
    for sm in samplers:
        sm.set_epoch(2)
    for shards in zip(*samplers):
        for idx in shards:
            xb, yb = s.get_batch(idx)
            assert np.array_equal(xb, full[idx]) and np.array_equal(yb, s.y[idx])
            collected.append(idx)
    assert np.array_equal(np.concatenate(collected), samplers[0].permutation(2))


def test_prepare_mnist_from_idx_and_peaks(tmp_path):
    arrays = make_mnist_arrays(seed=11)
    write_mnist(tmp_path / "src" / "MNIST" / "raw", arrays, gz=True)
    out = tmp_path / "out"
    assert main(["prepare", "mnist", "--data-root", str(tmp_path / "src"), "--out", str(out)]) == 0
    tr, te = load_dataset("hdf5", root=out / "mnist-train.h5", normalize=False)
    assert np.array_equal(tr.x[:][:, 0], arrays["train_images"]) and np.array_equal(tr.y, arrays["train_labels"])
    assert np.array_equal(te.x[:][:, 0], arrays["test_images"]) and np.array_equal(te.y, arrays["test_labels"])
    paths = prepare("peaks", out, seed=2)
    ptr = open_h5_split(paths[0], normalize=False, verify=True)
    ref, _ = load_dataset("peaks", seed=2, normalize=False)
    assert ptr.x.dtype == np.float32 and np.array_equal(ptr.x[:], ref.x) and np.array_equal(ptr.y, ref.y)
    with pytest.raises(ValueError, match=r"holds 2 '\*-train.h5' files"):
        load_dataset("hdf5", root=out)


def _mutate(src_dir, tmp_path, fn):
    p = _copy(src_dir / "digits-train.h5", tmp_path / "digits-train.h5")
    with h5py.File(p, "a") as f:
        fn(f)
    return p


def test_wrong_format_version(digits_cache, tmp_path):
    p = _mutate(digits_cache, tmp_path, lambda f: f.attrs.__setitem__("format_version", 2))
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + r": HDF5 cache has format_version=2, expected 1"):
        open_h5_split(p)


@pytest.mark.parametrize("attr", ["checksum", "normalization", "format_version"])
def test_missing_attribute(digits_cache, tmp_path, attr):
    p = _mutate(digits_cache, tmp_path, lambda f: f.attrs.__delitem__(attr))
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + rf": missing required HDF5 attribute.*'{attr}'"):
        open_h5_split(p)


def test_missing_dataset(digits_cache, tmp_path):
    p = _mutate(digits_cache, tmp_path, lambda f: f.__delitem__("y"))
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + r": missing required HDF5 dataset 'y'"):
        open_h5_split(p)


def test_h5_labels_out_of_range(digits_cache, tmp_path):
    def bad(f):
        f["y"][17] = 10
    p = _mutate(digits_cache, tmp_path, bad)
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + r": label 10 at index 17 is out of range; allowed labels are 0..9"):
        open_h5_split(p)


def test_checksum_mismatch(digits_cache, tmp_path):
    def bad(f):
        f["x"][3, 0, 0, 0] = 99
    p = _mutate(digits_cache, tmp_path, bad)
    s = open_h5_split(p)  # structure is valid ...
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + r": checksum mismatch"):
        s.verify_checksum()
    assert main(["verify", str(p)]) == 2


def test_missing_and_non_hdf5_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope-train.h5.*python -m data prepare"):
        open_h5_split(tmp_path / "nope-train.h5")
    p = tmp_path / "x-train.h5"
    p.write_bytes(b"not hdf5 at all")
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + ": not a readable HDF5 file"):
        open_h5_split(p)


def _listing(d):
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_write = h5cache._write_file
    calls = []

    def fail_on_second(path, split, extra):
        calls.append(path)
        if len(calls) == 2:  # train file fully written, test file half-written
            import h5py as _h5
            with _h5.File(path, "w") as f:
                f.create_dataset("x", data=split.x[:10])
            raise KeyboardInterrupt("simulated interrupt")
        real_write(path, split, extra)

    monkeypatch.setattr(h5cache, "_write_file", fail_on_second)
    with pytest.raises(KeyboardInterrupt):
        main(["prepare", "peaks", "--out", str(out)])
    assert len(calls) == 2 and all(p.parent == out for p in calls)
    assert _listing(out) == []


def test_interrupted_mid_dataset_write(tmp_path, monkeypatch):
    out = tmp_path / "out"
    orig = h5py.Group.create_dataset

    def boom(self, name, *a, **k):
        if name == "y":
            raise OSError("disk full (simulated)")
        return orig(self, name, *a, **k)

    monkeypatch.setattr(h5py.Group, "create_dataset", boom)
    with pytest.raises(OSError, match="disk full"):
        prepare("digits", out)
    assert _listing(out) == []


def test_existing_cache_survives_failed_prepare(digits_cache, tmp_path, monkeypatch):
    out = tmp_path / "c"
    out.mkdir()
    _copy(digits_cache / "digits-train.h5", out / "digits-train.h5")
    _copy(digits_cache / "digits-test.h5", out / "digits-test.h5")
    before = (out / "digits-train.h5").read_bytes()
    monkeypatch.setattr(h5cache, "checksum", lambda x, y: (_ for _ in ()).throw(RuntimeError("fail")))
    with pytest.raises(RuntimeError):
        prepare("digits", out, seed=9)
    assert _listing(out) == ["digits-test.h5", "digits-train.h5"]
    assert (out / "digits-train.h5").read_bytes() == before


def test_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "prepare" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    helptext = capsys.readouterr().out
    # one name for the flag, as in experiments/train.py; the old --root is a hidden alias
    assert "--data-root" in helptext and "--root" not in helptext.replace("--data-root", "")
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert [line.split()[0] for line in listing.splitlines()] == available_datasets()
    assert "--root" not in listing.replace("--data-root", "")
    assert main(["prepare", "mnist", "--data-root", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: mnist: file 'train-images-idx3-ubyte'") and "download=True" in err
    assert main(["prepare", "mnist", "--root", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("warning: --root is deprecated; use --data-root\nerror: mnist: file"), err
    with pytest.raises(SystemExit):
        main(["prepare", "mnist", "--root", "a", "--data-root", "b"])
    assert "give the source folder once" in capsys.readouterr().err
    assert main(["prepare", "hdf5", "--out", str(tmp_path / "o")]) == 2
    assert "'hdf5' names an existing cache pair" in capsys.readouterr().err
    assert main(["prepare", "nosuch", "--out", str(tmp_path / "o")]) == 2
    assert "unknown data set 'nosuch'" in capsys.readouterr().err
    assert _listing(tmp_path / "o") == []


def test_cli_subprocess_does_not_import_torch(tmp_path):
    import subprocess
    import sys

    code = ("import sys, runpy; sys.argv=['data','list']; "
            "runpy.run_module('data', run_name='__main__'); "
            "assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules, 'heavy import'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "digits" in r.stdout


def _flip(path, dataset, chunk, nbytes=64):
    """Invert ``nbytes`` bytes inside chunk ``chunk`` of ``dataset`` (located by HDF5 itself);
    returns the chunk's rows ``(first, stop)``."""
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        info = ds.id.get_chunk_info(chunk)
        rows = ds.chunks[0]
    assert info.size >= nbytes + 16 and info.filter_mask == 0
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + 8)
        raw = bytearray(fh.read(nbytes))
        fh.seek(info.byte_offset + 8)
        fh.write(bytes(b ^ 0xFF for b in raw))
    first = info.chunk_offset[0]
    return first, first + rows


def test_corrupted_cache_is_an_error_naming_the_file(digits_cache, tmp_path, capsys):
    """64 flipped bytes inside x's data: every read of that chunk (lazy rows, a training job's
    data loading, verify) fails naming the file; intact chunks still read exactly."""
    import torch

    from layerpar.job import JobConfig, _load

    for key in ("x", "y"):
        with h5py.File(digits_cache / "digits-train.h5", "r") as f:
            assert f[key].fletcher32 and f[key].chunks is not None
    d = tmp_path / "c"
    d.mkdir()
    p = _copy(digits_cache / "digits-train.h5", d / "digits-train.h5")
    _copy(digits_cache / "digits-test.h5", d / "digits-test.h5")
    first, stop = _flip(p, "x", chunk=2)
    ref = open_h5_split(digits_cache / "digits-train.h5", normalize=False).x[:]
    msg = re.escape(str(p)) + r": cannot read HDF5 dataset 'x' .*Fletcher-32 checksum mismatch.*python -m data prepare digits"
    for reader in ("auto", "h5py"):
        s = open_h5_split(p, normalize=False, reader=reader)  # attributes and y are intact
        ok = np.array([0, 5, stop + 1, len(s) - 1])
        assert np.array_equal(s.x[ok], ref[ok]) and np.array_equal(s.x[first - 3:first], ref[first - 3:first])
        for bad in (lambda: s.x[first + 1], lambda: s.x[np.array([3, first + 7, len(s) - 2])], lambda: s.x[:],
                    lambda: s.verify_checksum()):
            with pytest.raises(DataFormatError, match=msg):
                bad()
    with pytest.raises(DataFormatError, match=msg):  # the training path reads it whole at open
        load_dataset("hdf5", root=d)
    tr, _ = open_h5_pair(d, verify=False)  # lazily: the first read of the chunk fails
    sampler = GlobalBatchSampler(len(tr), 64, seed=0, rank=0, num_replicas=1)
    with pytest.raises(DataFormatError, match=msg):
        for idx in sampler:
            tr.get_batch(idx)
    with pytest.raises(DataFormatError, match=msg):  # the main job's data loading
        _load(JobConfig(dataset="hdf5", data_root=str(d)), torch.float64)
    assert main(["verify", str(d)]) == 2
    out, err = capsys.readouterr()
    assert out.startswith(f"{d / 'digits-test.h5'}: ok name=digits split=test") and "fletcher32=yes" in out
    assert err.startswith(f"error: {p}: cannot read HDF5 dataset 'x'")
    q = _copy(digits_cache / "digits-test.h5", tmp_path / "digits-test.h5")
    _flip(q, "y", chunk=0)
    with pytest.raises(DataFormatError, match=re.escape(str(q)) + r": cannot read HDF5 dataset 'y' .*Fletcher-32"):
        open_h5_split(q)


def test_cache_without_checksums_is_refused_with_the_rebuild_command(digits_cache, tmp_path):
    def old_layout(f):  # what layerpar wrote before the checksums: contiguous, no filter
        for key in ("x", "y"):
            v = f[key][()]
            del f[key]
            f.create_dataset(key, data=v)
    p = _mutate(digits_cache, tmp_path, old_layout)
    _copy(digits_cache / "digits-test.h5", tmp_path / "digits-test.h5")
    msg = (re.escape(str(p)) + r": dataset\(s\) 'x', 'y' carry no HDF5 Fletcher-32 checksum; .*older layerpar .*"
           + re.escape(f"rebuild it with `python -m data prepare digits --out {tmp_path}`"))
    with pytest.raises(DataFormatError, match=msg):
        open_h5_split(p)
    with pytest.raises(DataFormatError, match=msg):
        load_dataset("hdf5", root=tmp_path)
    assert main(["verify", str(tmp_path)]) == 2


def test_verify_a_folder_reports_every_file(digits_cache, tmp_path, capsys):
    assert main(["verify", str(digits_cache)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ok ")[0] for line in lines] == [str(digits_cache / f"digits-{s}.h5") for s in ("test", "train")]
    assert main(["verify", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: folder {tmp_path} holds no *.h5 cache files; create them with "
                                       f"`python -m data prepare NAME --out {tmp_path}`\n")


def _zero_words_to_ff(path, dataset="x", chunk=1, words=8):
    """Set ``words`` aligned 16-bit words of zero pixels inside chunk ``chunk`` to 0xFFFF (``2 *
    words`` bytes): Fletcher-32 sums words modulo 65535, so 0x0000 and 0xFFFF look the same to it.
    Returns the flat byte offsets inside the chunk (data starts at the chunk's byte 0)."""
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(chunk)
    assert info.filter_mask == 0
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset)
        raw = np.frombuffer(fh.read(info.size - 4), np.uint8)  # the last 4 bytes: the checksum
        offs = [i for i in range(0, raw.size - 1, 2) if raw[i] == 0 and raw[i + 1] == 0][:words]
        assert len(offs) == words
        for o in offs:
            fh.seek(info.byte_offset + o)
            fh.write(b"\xff\xff")
    return offs


def test_corruption_fletcher32_misses_is_an_error_when_training(digits_cache, tmp_path):
    """16 bytes of zero pixels set to 0xFF pass HDF5's Fletcher-32 check; the training path
    (load_dataset -> open_h5_pair, the main job's data loading) compares the stored SHA-256 and
    refuses the file by name, once per file and process; the intact cache still loads."""
    import torch

    import data.h5reader as h5reader
    from layerpar.job import JobConfig, _load

    d = tmp_path / "c"
    d.mkdir()
    p = _copy(digits_cache / "digits-train.h5", d / "digits-train.h5")
    _copy(digits_cache / "digits-test.h5", d / "digits-test.h5")
    _zero_words_to_ff(p)
    ref = open_h5_split(digits_cache / "digits-train.h5", normalize=False).x[:]
    got = open_h5_split(p, normalize=False).x[:]  # the premise: Fletcher-32 does not notice
    assert (got != ref).sum() == 16 and (got[got != ref] == 255).all()
    msg = re.escape(str(p)) + r": checksum mismatch \(SHA-256\).*corrupted.*python -m data prepare digits"
    with pytest.raises(DataFormatError, match=msg):
        load_dataset("hdf5", root=d)
    with pytest.raises(DataFormatError, match=msg):  # the main job's data loading
        _load(JobConfig(dataset="hdf5", data_root=str(d)), torch.float64)
    with pytest.raises(DataFormatError, match=msg):
        open_h5_split(p, verify="once")
    assert main(["verify", str(p)]) == 2
    # the verdict is cached per file identity: an intact file is read once per process, and a
    # rewritten file (new mtime/inode) is checked again
    calls = []
    orig = h5reader.H5Split.verify_checksum
    h5reader.H5Split.verify_checksum = lambda s: calls.append(s.path) or orig(s)
    try:
        e = tmp_path / "e"
        e.mkdir()
        for s in ("train", "test"):
            _copy(digits_cache / f"digits-{s}.h5", e / f"digits-{s}.h5")
        for _ in range(2):
            tr, te = load_dataset("hdf5", root=e, normalize=False)
            assert np.array_equal(tr.x[:], ref)
        assert calls == [e / "digits-train.h5", e / "digits-test.h5"]
        q = e / "digits-train.h5"
        q.unlink()
        _copy(p, q)  # the corrupted content under the verified name
        with pytest.raises(DataFormatError, match=re.escape(str(q)) + r": checksum mismatch"):
            load_dataset("hdf5", root=e)
    finally:
        h5reader.H5Split.verify_checksum = orig
    with pytest.raises(ValueError, match="verify='yes'; allowed"):
        open_h5_split(p, verify="yes")
