"""Command line: ``python -m data {list,prepare,verify}``.

* ``python -m data list`` -- registered data sets and whether they need files.
* ``python -m data prepare NAME [--root PATH] [--out DIR] [--seed S] [--test-fraction F]``
  -- write ``DIR/NAME-train.h5`` and ``DIR/NAME-test.h5`` (see :mod:`data.h5cache`);
  ``--out`` defaults to ``$LAYERPAR_DATA_CACHE`` or ``./data_cache``.
* ``python -m data verify FILE [FILE ...]`` -- validate cache files and their checksums.

Exit status 0 on success, 2 on a usage error, missing or malformed file
(the message, printed to stderr as ``error: ...``, names the file or value).
"""

from __future__ import annotations

import argparse
import os
import sys


def _default_out() -> str:
    return os.environ.get("LAYERPAR_DATA_CACHE", "data_cache")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data",
                                description="layerpar data sets: list, prepare HDF5 caches, verify caches.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{list,prepare,verify}")
    sub.add_parser("list", help="list the registered data sets")
    pp = sub.add_parser("prepare", help="write NAME-train.h5 / NAME-test.h5 HDF5 caches",
                        description="Load data set NAME and write OUT/NAME-train.h5 and OUT/NAME-test.h5 "
                                    "(raw x, int64 y, attributes format_version, source, checksum, "
                                    "normalization, class_names, num_classes, name). Files are written to "
                                    "temporary files and renamed at the end.")
    pp.add_argument("name", help="data set name (see `python -m data list`)")
    pp.add_argument("--root", default=None, help="folder with the source files (mnist, fashion-mnist, cifar10)")
    pp.add_argument("--out", default=None, help="output folder (default: $LAYERPAR_DATA_CACHE or ./data_cache)")
    pp.add_argument("--seed", type=int, default=0, help="seed of the stratified split / peaks generation (default 0)")
    pp.add_argument("--test-fraction", type=float, default=0.2,
                    help="test share for sets without a shipped split (default 0.2)")
    pv = sub.add_parser("verify", help="validate HDF5 cache files and recompute their checksums")
    pv.add_argument("files", nargs="+", help="cache files written by `prepare`")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import DataFormatError

    try:
        if args.command == "list":
            from .datasets import available_datasets, dataset_info

            for name in available_datasets():
                info = dataset_info(name)
                print(f"{name:14s} {'needs --root' if info.needs_root else 'offline     '}  {info.description}")
            print(f"{'hdf5':14s} {'needs --root'}  cache pair written by `python -m data prepare` (lazy reads)")
        elif args.command == "prepare":
            from .h5cache import prepare

            out = args.out if args.out is not None else _default_out()
            paths = prepare(args.name, out, root=args.root, seed=args.seed, test_fraction=args.test_fraction)
            for path in paths:
                print(path)
        elif args.command == "verify":
            from .h5reader import open_h5_split

            for f in args.files:
                s = open_h5_split(f, normalize=False, verify=True)
                print(f"{f}: ok name={s.name} split={s.split} n={len(s)} x{s.x.shape} {s.x.dtype} "
                      f"classes={s.num_classes} sha256={s.checksum[:16]}...")
                s.close()
    except (FileNotFoundError, DataFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
