"""IDX (MNIST / Fashion-MNIST) reading: both folder layouts, gz and raw, and every bad input."""

import gzip
import re
import zlib

import numpy as np
import pytest

from data import DataFormatError, load_dataset, read_idx, write_idx
from data.idx import IMAGES_MAGIC, LABELS_MAGIC

from .formats import MNIST_FILES, idx_bytes, idx_raw, make_mnist_arrays, write_bytes, write_mnist


def _check_exact(train, test, arrays):
    assert train.x.dtype == np.uint8 and train.x.shape == (12, 1, 28, 28)
    assert np.array_equal(train.x[:, 0], arrays["train_images"])
    assert np.array_equal(test.x[:, 0], arrays["test_images"])
    assert train.y.dtype == np.int64 and np.array_equal(train.y, arrays["train_labels"])
    assert np.array_equal(test.y, arrays["test_labels"])


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("layout", ["torchvision", "plain"])
@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashion-mnist", "FashionMNIST")])
def test_mnist_layouts_read_back_exactly(tmp_path, gz, layout, name, folder):
    arrays = make_mnist_arrays(seed=zlib.crc32(f"{gz}{layout}{name}".encode()))
    target = tmp_path / folder / "raw" if layout == "torchvision" else tmp_path / "files"
    write_mnist(target, arrays, gz)
    root = tmp_path if layout == "torchvision" else target
    train, test = load_dataset(name, root=root, normalize=False)
    _check_exact(train, test, arrays)
    assert train.name == name and train.num_classes == 10 and len(train.class_names) == 10
    if name == "fashion-mnist":
        assert train.class_names[9] == "Ankle boot"


def test_mnist_normalized_and_flattened(tmp_path):
    arrays = make_mnist_arrays()
    write_mnist(tmp_path, arrays, gz=True)
    train, test = load_dataset("mnist", root=tmp_path, flatten=True)
    raw = arrays["train_images"].astype(np.float64)
    assert train.x.shape == (12, 784) and train.x.dtype == np.float32
    assert train.input_shape == (784,)
    assert train.normalization["mean"] == pytest.approx([raw.mean()])
    assert train.normalization["std"] == pytest.approx([raw.std()])
    expected = ((arrays["test_images"].reshape(7, -1) - raw.mean()) / raw.std()).astype(np.float32)
    np.testing.assert_allclose(test.x, expected, rtol=1e-5, atol=1e-5)


def test_raw_file_preferred_over_gz_and_root_may_be_mnist_folder(tmp_path):
    a, b = make_mnist_arrays(seed=1), make_mnist_arrays(seed=2)
    write_mnist(tmp_path / "MNIST" / "raw", a, gz=False)
    write_mnist(tmp_path / "MNIST" / "raw", b, gz=True)
    train, test = load_dataset("mnist", root=tmp_path / "MNIST", normalize=False)
    _check_exact(train, test, a)


def test_read_write_idx_roundtrip_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    for dtype in (np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64):
        arr = (rng.standard_normal((3, 4, 5)) * 50).astype(dtype)
        for suffix in ("", ".gz"):
            p = write_idx(tmp_path / f"a_{np.dtype(dtype).name}{suffix}", arr)
            back = read_idx(p)
            assert back.dtype == np.dtype(dtype).newbyteorder("=") and np.array_equal(back, arr)
    # write_idx agrees byte for byte with the independent writer
    arr = rng.integers(0, 256, (4, 2, 3), dtype=np.uint8)
    assert (write_idx(tmp_path / "b", arr)).read_bytes() == idx_bytes(arr)
    assert list(tmp_path.glob("*.tmp")) == []


def test_missing_file_names_file_and_how_to_obtain(tmp_path):
    arrays = make_mnist_arrays()
    paths = write_mnist(tmp_path, arrays, gz=True)
    paths["test_labels"].unlink()
    with pytest.raises(FileNotFoundError, match=r"t10k-labels-idx1-ubyte.*download=True") as e:
        load_dataset("mnist", root=tmp_path)
    assert str(tmp_path) in str(e.value) and "ossci-datasets" in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"FashionMNIST"):
        load_dataset("fashion-mnist", root=tmp_path / "empty")


def test_root_required(tmp_path):
    with pytest.raises(ValueError, match="root="):
        load_dataset("mnist")


def test_wrong_magic_number(tmp_path):
    arrays = make_mnist_arrays()
    paths = write_mnist(tmp_path, arrays, gz=False)
    # swap: a labels file where the images file should be
    paths["train_images"].write_bytes(idx_bytes(arrays["train_labels"]))
    with pytest.raises(DataFormatError, match=re.escape(str(paths["train_images"])) + r".*0x00000801.*expected 0x00000803"):
        load_dataset("mnist", root=tmp_path)
    with pytest.raises(DataFormatError, match=r"0x00000803.*expected 0x00000801"):
        read_idx(paths["test_images"], LABELS_MAGIC)
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(DataFormatError, match=r"bad: invalid IDX magic number 0x01020801"):
        read_idx(bad)


@pytest.mark.parametrize("gz", [False, True])
def test_wrong_size(tmp_path, gz):
    arrays = make_mnist_arrays()
    paths = write_mnist(tmp_path, arrays, gz=gz)
    payload = idx_bytes(arrays["train_images"])[:-5]
    p = write_bytes(tmp_path / MNIST_FILES["train_images"], payload, gz)
    assert p == paths["train_images"]
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + r": IDX size mismatch.*need 9408 data bytes, file has 9403"):
        load_dataset("mnist", root=tmp_path)
    short = write_bytes(tmp_path / "short", b"\x00\x00", gz)
    with pytest.raises(DataFormatError, match="short(.gz)?: 2 bytes is too short"):
        read_idx(short, IMAGES_MAGIC)


def test_truncated_gzip(tmp_path):
    arrays = make_mnist_arrays()
    paths = write_mnist(tmp_path, arrays, gz=True)
    p = paths["test_images"]
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + r": gzip stream is truncated or corrupt"):
        load_dataset("mnist", root=tmp_path)
    # corrupt (not just truncated) stream
    p.write_bytes(data[:20] + bytes(len(data) - 20))
    with pytest.raises(DataFormatError, match=re.escape(str(p))):
        read_idx(p)


def test_labels_out_of_range(tmp_path):
    arrays = make_mnist_arrays()
    arrays["train_labels"][4] = 12
    paths = write_mnist(tmp_path, arrays, gz=True)
    with pytest.raises(DataFormatError, match=re.escape(str(paths["train_labels"])) + r": label 12 at index 4 .*0\.\.9"):
        load_dataset("mnist", root=tmp_path)


def test_image_label_count_mismatch(tmp_path):
    arrays = make_mnist_arrays()
    arrays["test_labels"] = arrays["test_labels"][:-1]
    paths = write_mnist(tmp_path, arrays, gz=False)
    with pytest.raises(DataFormatError, match=r"has 7 images but .*t10k-labels-idx1-ubyte has 6 labels"):
        load_dataset("mnist", root=tmp_path)
    assert paths


def test_gzip_detected_by_content_not_name(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    p = tmp_path / "noext"
    p.write_bytes(gzip.compress(idx_bytes(arr)))
    assert np.array_equal(read_idx(p, IMAGES_MAGIC), arr)


_U8 = 0x08
_CRAFTED = {  # name: (bytes, regex of the message after "<file>: ")
    "huge dims wrap int64": (idx_raw(_U8, (2**31, 2**31, 4)),
                             r"IDX size mismatch: header dims \(2147483648, 2147483648, 4\) of 1-byte items "
                             r"need 18446744073709551616 data bytes, file has 0"),
    "huge dims with payload": (idx_raw(0x0E, (2**32 - 1, 2**32 - 1), b"\x00" * 64),
                               r"IDX size mismatch: .* need \d{20,} data bytes, file has 64"),
    "product wraps to payload": (idx_raw(_U8, (2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1), b"\x01"),
                                 r"IDX size mismatch"),
    "no dimensions": (idx_raw(_U8, ()), r"invalid IDX magic number 0x00000800; .*DD >= 1"),
    "a dimension of size 0": (idx_raw(_U8, (0, 28, 28)),
                              r"IDX header declares a dimension of size 0 \(dims \(0, 28, 28\)\); every size must be >= 1"),
    "wrong magic bytes": (idx_raw(_U8, (2,), b"ab", magic_prefix=b"PK"), r"invalid IDX magic number 0x504B0801"),
    "wrong dtype code": (idx_raw(0x0A, (2,), b"ab"), r"invalid IDX magic number 0x00000A01; expected 0x0000TTDD "
                                                     r"with type code TT in \{0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E\}"),
    "truncated payload": (idx_raw(0x0C, (3, 2), b"\x00" * 23),
                          r"IDX size mismatch: header dims \(3, 2\) of 4-byte items need 24 data bytes, file has 23"),
    "extra bytes": (idx_raw(_U8, (3, 2), b"\x00" * 7),
                    r"IDX size mismatch: header dims \(3, 2\) of 1-byte items need 6 data bytes, file has 7"),
    "header cut in the dims": (idx_raw(_U8, (5, 5, 5))[:10],
                               r"IDX header declares 3 dimensions \(16 header bytes\) but the file has 10 bytes"),
    "255 dims declared": (b"\x00\x00\x08\xff" + b"\x00\x00\x00\x01" * 3,
                          r"IDX header declares 255 dimensions \(1024 header bytes\) but the file has 16 bytes"),
}


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("case", list(_CRAFTED))
def test_crafted_headers_are_data_format_errors_naming_the_file(tmp_path, case, gz):
    """Every malformed header or size is a DataFormatError naming the file, never a bare
    ValueError from numpy or a wrapped-around size check."""
    payload, pattern = _CRAFTED[case]
    p = write_bytes(tmp_path / "crafted-idx", payload, gz)
    with pytest.raises(DataFormatError, match=re.escape(str(p)) + ": " + pattern):
        read_idx(p)


def test_crafted_header_through_load_dataset(tmp_path):
    arrays = make_mnist_arrays()
    paths = write_mnist(tmp_path, arrays, gz=False)
    paths["train_images"].write_bytes(idx_raw(_U8, (2**31, 2**31, 4)))
    with pytest.raises(DataFormatError, match=re.escape(str(paths["train_images"])) + r": IDX size mismatch"):
        load_dataset("mnist", root=tmp_path)


def test_write_idx_refuses_empty_arrays(tmp_path):
    with pytest.raises(ValueError, match=r"shape \(0, 3\) is empty"):
        write_idx(tmp_path / "e", np.zeros((0, 3), np.uint8))
    assert list(tmp_path.iterdir()) == []
