"""Shared results helper of the experiment scripts: one place that writes what a study measured.

Every study writes under ``experiments/results/<study>/``:

* ``results.h5`` -- one HDF5 dataset per measured series (``save_series``) plus run metadata as
  attributes;
* ``table.md`` -- a markdown table (``markdown_table``) headed by the metadata block (command,
  git commit, machine, date, load average) so a committed table says how it was produced;
* ``*.png`` -- matplotlib figures (Agg backend) from ``plot_lines``.

Only world rank 0 should call the writers.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

import h5py
import numpy as np

__all__ = ["run_metadata", "results_dir", "create_checked", "save_series", "markdown_table", "write_table",
           "plot_lines", "add_study_flags"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"


def run_metadata(argv: Sequence[str] | None = None, world_size: int = 1) -> dict:
    """Command line, git commit (``+dirty`` when the tree has changes), machine, date, load."""
    root = ROOT
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        # changed or new files count as dirty, except the results being written
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ".",
                                ":(exclude)experiments/results"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit = (commit or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    argv = list(sys.argv if argv is None else argv)
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {"command": " ".join(shlex.quote(a) for a in argv), "commit": commit,
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                       f"{platform.python_implementation()} {platform.python_version()}",
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "loadavg": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", "world_size": world_size}


def add_study_flags(parser, full_help: str, smoke_help: str = "tiny settings for the test suite"):
    """The flags every study shares: ``--full`` (paper scale), ``--smoke`` (seconds, for the
    test suite) and ``--out`` (results base folder)."""
    parser.add_argument("--full", action="store_true", help=full_help)
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--out", default=None,
                        help="results base folder (default experiments/results)")
    return parser


def results_dir(study: str, base: str | os.PathLike | None = None) -> Path:
    """``experiments/results/<study>`` (or ``base/<study>``), created."""
    d = Path(base) if base is not None else RESULTS
    d = d / study
    d.mkdir(parents=True, exist_ok=True)
    return d


def create_checked(group: h5py.Group, name: str, data) -> h5py.Dataset:
    """``group.create_dataset(name, data=data)`` with HDF5's Fletcher-32 checksum filter
    (chunked): HDF5 verifies it on every read, so a corrupted file raises :class:`OSError`
    ("filter returned failure during read") instead of returning wrong numbers. Scalars (0-d)
    cannot be chunked in HDF5 and are stored unchecked."""
    arr = np.asarray(data)
    if arr.ndim == 0:
        return group.create_dataset(name, data=arr)
    return group.create_dataset(name, data=arr, fletcher32=True)


def save_series(path: str | os.PathLike, series: Mapping[str, Sequence], meta: Mapping) -> None:
    """Write each series as a float/int dataset of ``path`` (HDF5, atomically, Fletcher-32
    checksummed by :func:`create_checked`) with ``meta`` as attributes (non-scalar values
    JSON-encoded)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with h5py.File(tmp, "w") as f:
        for k, v in series.items():
            create_checked(f, k, v)
        for k, v in meta.items():
            f.attrs[k] = v if isinstance(v, (int, float, str)) else json.dumps(v)
    os.replace(tmp, path)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub markdown table; floats get 4 significant digits."""
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.4g}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def write_table(path: str | os.PathLike, title: str, meta: Mapping, body: str) -> None:
    """Write ``# title``, the metadata block, then ``body`` (markdown) to ``path``."""
    head = [f"# {title}", ""]
    head += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items()]
    Path(path).write_text("\n".join(head) + "\n\n" + body.rstrip() + "\n")


def plot_lines(path: str | os.PathLike, curves: Mapping[str, tuple], xlabel: str, ylabel: str,
               title: str = "", logy: bool = False, logx: bool = False) -> None:
    """One PNG with a line per ``name -> (x, y)``."""
    # matplotlib is imported here: it takes about a second and only the root rank plots
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (x, y) in curves.items():
        ax.plot(x, y, marker="o", ms=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
