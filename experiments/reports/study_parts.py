"""A study's results measured in separate parts, kept together in one ``results.h5``.

A study whose accuracy runs and timing runs are independent (e.g. Kirby: training accuracy vs
forward timings) writes each part under its own group ``<part>/...`` of ``results.h5``, with
the part's run metadata (command, commit, machine, date, load) as the JSON attribute
``meta/<part>``. Re-running one part (``--part timing`` on a quiet machine) replaces only that
part's datasets; the study then rebuilds ``table.md`` and ``summary.md`` from everything stored,
so every number in them comes from the file.

Only world rank 0 calls these.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Mapping

import h5py
import numpy as np

from mgrit.reporting import writers as reporting

__all__ = ["write_part", "read_part", "parts_in", "idle_barrier", "write_headline"]


def write_headline(path: str | os.PathLike, rows: list, metas: list) -> None:
    """``headline.json`` of a study (``path`` a folder, or a file path to write): ``rows`` of
    ``{"claim", "ours", "kind"}`` generated from the study's results, and the commits of the
    runs (``metas``: run metadata dicts) -- read by ``experiments/regenerate.py`` to build the
    generated block of ``experiments/README.md``."""
    path = Path(path)
    if path.is_dir():
        path = path / "headline.json"
    commits = sorted({str(m.get("commit", "unknown")) for m in metas})
    path.write_text(json.dumps({"commits": commits, "rows": rows}, indent=1))


def idle_barrier(comm) -> None:
    """A barrier over ``comm`` that sleeps (5 ms polls) instead of spinning, so a rank waiting
    for another rank's timed work does not steal its core (MPI barriers busy-wait)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def _read_all(path: Path) -> tuple[dict, dict]:
    data, attrs = {}, {}
    if not path.is_file():
        return data, attrs
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                data[name] = obj[()]
        f.visititems(visit)
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    return data, attrs


def write_part(path: str | os.PathLike, part: str, series: Mapping[str, object],
               meta: Mapping) -> None:
    """Replace part ``part`` of ``path`` by ``series`` (name -> array-like) and ``meta``.

    The other parts are kept. ``attrs["commit"]`` and ``attrs["command"]`` are those of the
    last part written; ``attrs["meta/<part>"]`` holds each part's metadata as JSON.
    """
    path = Path(path)
    meta = reporting.finish_metadata(meta)  # the part's load when its results are written
    data, attrs = _read_all(path)
    data = {k: v for k, v in data.items() if not k.startswith(part + "/")}
    data.update({f"{part}/{k}": np.asarray(v) for k, v in series.items()})
    attrs[f"meta/{part}"] = json.dumps(dict(meta), default=str)
    for k in ("commit", "command", "date"):
        if k in meta:
            attrs[k] = str(meta[k])
    tmp = path.with_suffix(path.suffix + ".tmp")
    with h5py.File(tmp, "w") as f:
        for k, v in data.items():
            # HDF5's Fletcher-32 checksum, verified on each read (scalars cannot be chunked)
            f.create_dataset(k, data=v, fletcher32=np.ndim(v) > 0)
        for k, v in attrs.items():
            f.attrs[k] = v
    os.replace(tmp, path)


def read_part(path: str | os.PathLike, part: str) -> tuple[dict, dict] | None:
    """``(series, meta)`` of part ``part`` of ``path`` (names without the ``<part>/`` prefix),
    or None when the file or the part is missing. A part stored before its metadata recorded
    ``cores`` and ``loadavg_after`` reads them as ``"unknown (not recorded)"``, so that a
    report rebuilt from it never takes today's load for the run's (the provenance check
    counts them missing)."""
    data, attrs = _read_all(Path(path))
    key = f"meta/{part}"
    if key not in attrs:
        return None
    pre = part + "/"
    series = {k[len(pre):]: v for k, v in data.items() if k.startswith(pre)}
    meta = json.loads(attrs[key])
    for k in ("cores", "loadavg_after"):
        meta.setdefault(k, "unknown (not recorded)")
    return series, meta


def parts_in(path: str | os.PathLike) -> list[str]:
    """Names of the parts stored in ``path`` (sorted)."""
    _, attrs = _read_all(Path(path))
    return sorted(k[len("meta/"):] for k in attrs if k.startswith("meta/"))
