"""Command line: ``python -m data {list,prepare,verify}``.

* ``python -m data list`` -- every data set name ``load_dataset`` (and ``train.py --dataset``)
  accepts, and whether it needs files.
* ``python -m data prepare NAME [--data-root PATH] [--out DIR] [--seed S] [--test-fraction F]``
  -- write ``DIR/NAME-train.h5`` and ``DIR/NAME-test.h5`` (see :mod:`data.h5cache`);
  ``--out`` defaults to ``$LAYERPAR_DATA_CACHE`` or ``./data_cache``. ``--data-root`` is the
  flag's name in ``experiments/train.py`` too; the old spelling ``--root`` is still accepted
  (hidden, deprecated: it prints a warning).
* ``python -m data verify PATH [PATH ...]`` -- validate cache files (a folder: every ``*.h5`` in
  it): attributes, shapes, labels, HDF5's Fletcher-32 checksum of every chunk and the SHA-256
  of the content. One line per file (``PATH: ok ...`` on stdout or ``error: PATH: ...`` on
  stderr); every file is checked even after a failure.

Exit status 0 on success, 2 on a usage error, missing or malformed file
(the message, printed to stderr as ``error: ...``, names the file or value).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .datasets import HDF5, available_datasets, dataset_info
from .errors import DataFormatError
from .h5cache import prepare
from .h5reader import open_h5_split


def _default_out() -> str:
    return os.environ.get("LAYERPAR_DATA_CACHE", "data_cache")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data",
                                description="layerpar data sets: list, prepare HDF5 caches, verify caches.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{list,prepare,verify}")
    sub.add_parser("list", help="list the data set names (everything --dataset accepts)")
    pp = sub.add_parser("prepare", help="write NAME-train.h5 / NAME-test.h5 HDF5 caches",
                        description="Load data set NAME and write OUT/NAME-train.h5 and OUT/NAME-test.h5 "
                                    "(raw x, int64 y, attributes format_version, source, checksum, "
                                    "normalization, class_names, num_classes, name). Files are written to "
                                    "temporary files and renamed at the end.")
    pp.add_argument("name", help="data set name (see `python -m data list`; not hdf5, which is a cache)")
    pp.add_argument("--data-root", dest="data_root", default=None,
                    help="folder with the source files (mnist, fashion-mnist, cifar10)")
    pp.add_argument("--root", dest="old_root", default=None, help=argparse.SUPPRESS)
    pp.add_argument("--out", default=None, help="output folder (default: $LAYERPAR_DATA_CACHE or ./data_cache)")
    pp.add_argument("--seed", type=int, default=0, help="seed of the stratified split / peaks generation (default 0)")
    pp.add_argument("--test-fraction", type=float, default=0.2,
                    help="test share for sets without a shipped split (default 0.2)")
    pv = sub.add_parser("verify", help="validate HDF5 cache files (or every *.h5 in a folder) and their checksums")
    pv.add_argument("files", nargs="+", metavar="PATH",
                    help="cache files written by `prepare`, or folders holding them")
    return p


def _cache_files(paths) -> list:
    """``paths`` with every folder replaced by its ``*.h5`` files (sorted); a folder without any
    raises FileNotFoundError."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.glob("*.h5") if q.is_file())
            if not found:
                raise FileNotFoundError(f"folder {p} holds no *.h5 cache files; "
                                        f"create them with `python -m data prepare NAME --out {p}`")
            out += found
        else:
            out.append(p)
    return out


def _verify(paths) -> int:
    """Verify every cache file; one line per file; 0 if all are intact, else 2."""
    files = _cache_files(paths)
    bad = 0
    for f in files:
        try:
            with open_h5_split(f, normalize=False, verify=True) as s:
                print(f"{f}: ok name={s.name} split={s.split} n={len(s)} x{s.x.shape} {s.x.dtype} "
                      f"classes={s.num_classes} fletcher32=yes sha256={s.checksum[:16]}...", flush=True)
        except (FileNotFoundError, DataFormatError) as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            bad += 1
    if bad and len(files) > 1:
        print(f"error: {bad} of {len(files)} cache files failed verification", file=sys.stderr)
    return 2 if bad else 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for name in available_datasets():
                if name == HDF5:
                    print(f"{name:14s} needs --data-root  cache pair written by `python -m data prepare` "
                          f"(lazy reads)")
                    continue
                info = dataset_info(name)
                need = "needs --data-root" if info.needs_root else "offline          "
                print(f"{name:14s} {need}  {info.description}")
        elif args.command == "prepare":
            root = args.data_root
            if args.old_root is not None:
                if root is not None:
                    parser.error("give the source folder once: --data-root (--root is its old name)")
                print("warning: --root is deprecated; use --data-root", file=sys.stderr)
                root = args.old_root
            out = args.out if args.out is not None else _default_out()
            paths = prepare(args.name, out, root=root, seed=args.seed, test_fraction=args.test_fraction)
            for path in paths:
                print(path)
        elif args.command == "verify":
            return _verify(args.files)
    except (FileNotFoundError, DataFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
