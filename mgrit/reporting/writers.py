"""Shared results helper of the experiment scripts: one place that writes what a study measured.

Every study writes under ``experiments/results/<study>/``:

* ``results.h5`` -- one HDF5 dataset per measured series (``save_series``) plus run metadata as
  attributes;
* ``table.md`` -- a markdown table (``markdown_table``) headed by the metadata block (command,
  git commit, machine, cores, date, load average before and after the run; the flag
  :data:`LOAD_FLAG` when either 1-minute load average was at or above the core count) so a
  committed table says how it was produced;
* ``<table>.raw.json`` -- the raw per-repeat numbers of a timing table with median, quartiles
  and min/max (``write_raw``);
* ``*.png`` -- matplotlib figures (Agg backend) from ``plot_lines``.

Only world rank 0 should call the writers. ``tests/experiments/test_provenance.py`` checks every
committed results file for the keys of :data:`PROVENANCE_KEYS`.

A script that does nothing on this machine (a GPU benchmark without a GPU, a study whose flag
the main job lacks) ends with ``return skip(reason)``: it prints ``SKIP: <reason>`` and exits
with :data:`EXIT_SKIP`, which ``experiments/regenerate.py`` lists as ``skip (<reason>)``, not
``ok``.
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

__all__ = ["run_metadata", "finish_metadata", "load_flagged", "part_lines", "meta_lines",
           "results_dir", "create_checked", "save_series", "markdown_table", "write_table",
           "write_raw", "spread", "interval", "paired_interval", "skip", "plot_lines", "add_study_flags", "PROVENANCE_KEYS",
           "LOAD_FLAG", "EXIT_SKIP"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"


#: Keys every results file's metadata carries (``tests/experiments/test_provenance.py``):
#: the command line, the git commit (``+dirty`` when the tree had uncommitted changes outside
#: ``experiments/results``), the machine, its core count (``os.cpu_count()``), the UTC date, and
#: the load averages (1, 5, 15 min) when the run started (``loadavg``) and when its results were
#: written (``loadavg_after``).
PROVENANCE_KEYS = ("command", "commit", "machine", "cores", "date", "loadavg", "loadavg_after")
#: The line a table carries when a 1-minute load average (before or after) was at or above the
#: core count: its wall times were measured on an oversubscribed machine.
LOAD_FLAG = "load >= cores: timings unreliable"
#: Exit status of a script that ran but did nothing on this machine (EX_TEMPFAIL of sysexits.h).
EXIT_SKIP = 75


def _loadavg() -> str:
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def run_metadata(argv: Sequence[str] | None = None, world_size: int = 1) -> dict:
    """Provenance of a run, taken when it starts: ``command`` (``argv``, default ``sys.argv``),
    ``commit`` (short hash, ``+dirty`` when the tree has changes outside
    ``experiments/results``), ``machine``, ``cores`` (int), ``date`` (UTC, minutes),
    ``loadavg`` (the 1/5/15-minute load averages now, a string of three numbers) and
    ``world_size``. The writers (:func:`write_table`, :func:`save_series`, :func:`write_raw`)
    add ``loadavg_after`` when they write (:func:`finish_metadata`)."""
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
    return {"command": " ".join(shlex.quote(a) for a in argv), "commit": commit,
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                       f"{platform.python_implementation()} {platform.python_version()}",
            "cores": os.cpu_count() or 1,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "loadavg": _loadavg(), "world_size": world_size}


def finish_metadata(meta: Mapping) -> dict:
    """``meta`` with ``loadavg_after`` (the load averages now) when it has none, and ``cores``
    (``os.cpu_count()``) when it has none; call when the run's results are written."""
    out = dict(meta)
    out.setdefault("loadavg_after", _loadavg())
    out.setdefault("cores", os.cpu_count() or 1)
    return out


def load_flagged(meta: Mapping) -> bool:
    """Whether the 1-minute load average before (``loadavg``) or after (``loadavg_after``) the
    run was at or above ``cores``: the run's wall times then need :data:`LOAD_FLAG`. A missing
    or unreadable value counts as not flagged (the provenance check reports it missing)."""
    try:
        cores = float(meta["cores"])
    except (KeyError, TypeError, ValueError):
        return False
    for k in ("loadavg", "loadavg_after"):
        try:
            if float(str(meta[k]).split()[0]) >= cores:
                return True
        except (KeyError, IndexError, ValueError):
            pass
    return False


def part_lines(part: str, meta: Mapping) -> list[str]:
    """The metadata lines of one part of a table with parts (written by its report builder,
    not :func:`write_table`): ``- <part> part: key `value`, ...`` over
    ``PROVENANCE_KEYS + ("world_size",)`` and, when :func:`load_flagged`, an indented
    ``  - warning: LOAD_FLAG`` line under it."""
    keys = (*PROVENANCE_KEYS, "world_size")
    out = [f"- {part} part: " + ", ".join(f"{k} `{meta.get(k)}`" for k in keys)]
    if load_flagged(meta):
        out.append(f"  - warning: {LOAD_FLAG} ({part} part)")
    return out


def skip(reason: str) -> int:
    """Print ``SKIP: <reason>`` and return :data:`EXIT_SKIP`: ``return skip("no CUDA device")``
    from a script's ``main`` that has nothing to do on this machine."""
    print(f"SKIP: {reason}", flush=True)
    return EXIT_SKIP


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
    JSON-encoded; ``loadavg_after`` added by :func:`finish_metadata`)."""
    path = Path(path)
    meta = finish_metadata(meta)
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


def meta_lines(meta: Mapping) -> list[str]:
    """The metadata block of a table: ``meta`` completed by :func:`finish_metadata`, one
    ``- key: value`` line per key (the command in backticks), and ``- warning: LOAD_FLAG (...)``
    when :func:`load_flagged`. For scripts that write their own header (:func:`write_table`
    uses it)."""
    meta = finish_metadata(meta)
    out = [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items()]
    if load_flagged(meta):
        out += [f"- warning: {LOAD_FLAG} (1-minute load average {meta['loadavg'].split()[0]} "
                f"before, {meta['loadavg_after'].split()[0]} after, on {meta['cores']} cores)"]
    return out


def write_table(path: str | os.PathLike, title: str, meta: Mapping, body: str) -> None:
    """Write ``# title``, the metadata block (:func:`meta_lines`: one ``- key: value`` line per
    key of ``meta``, with ``loadavg_after`` and ``cores`` added by :func:`finish_metadata`, and
    the line ``- warning: LOAD_FLAG`` when :func:`load_flagged`), then ``body`` (markdown) to
    ``path``."""
    head = [f"# {title}", "", *meta_lines(meta)]
    Path(path).write_text("\n".join(head) + "\n\n" + body.rstrip() + "\n")


def spread(values: Sequence[float]) -> dict:
    """``{"n", "median", "q1", "q3", "iqr", "min", "max"}`` of ``values`` (same unit;
    quartiles by numpy's linear interpolation). Raises :class:`ValueError` on an empty
    sequence."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        raise ValueError("spread() of no values: need at least one repeat")
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {"n": int(v.size), "median": float(med), "q1": float(q1), "q3": float(q3),
            "iqr": float(q3 - q1), "min": float(v.min()), "max": float(v.max())}


def interval(values: Sequence[float], level: float = 0.95) -> dict:
    """Mean of ``values`` (independent repeats, e.g. one per seed) with its two-sided Student-t
    confidence interval: ``{"n", "mean", "sd", "lo", "hi", "level"}`` (``sd``: sample standard
    deviation; ``lo``/``hi``: ``mean -+ t_{(1+level)/2, n-1} * sd / sqrt(n)``; NaN when
    ``n == 1``). Raises :class:`ValueError` on no values or a ``level`` outside (0, 1)."""
    from scipy import stats  # ~0.3 s: only the writers of accuracy tables need it
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        raise ValueError("interval() of no values: need at least one seed")
    if not 0.0 < level < 1.0:
        raise ValueError(f"interval(level={level!r}): the confidence level must lie in (0, 1)")
    mean = float(v.mean())
    if v.size == 1:
        return {"n": 1, "mean": mean, "sd": float("nan"), "lo": float("nan"),
                "hi": float("nan"), "level": level}
    sd = float(v.std(ddof=1))
    half = float(stats.t.ppf((1.0 + level) / 2.0, v.size - 1)) * sd / np.sqrt(v.size)
    return {"n": int(v.size), "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half,
            "level": level}


def paired_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> dict:
    """:func:`interval` of the paired differences ``b[i] - a[i]`` (same seed ``i`` in both
    arms, e.g. ``a`` serial and ``b`` MGRIT test accuracies). Raises :class:`ValueError` when
    the lengths differ."""
    if len(a) != len(b):
        raise ValueError(f"paired_interval: {len(a)} values against {len(b)}: pairs need one "
                         "value per seed in both arms")
    return interval([float(y) - float(x) for x, y in zip(a, b)], level)


def write_raw(path: str | os.PathLike, samples: Mapping[str, Sequence[float]], meta: Mapping,
              unit: str = "s") -> dict:
    """Write a timing table's raw per-repeat numbers as JSON beside it (``path``, by convention
    ``<table>.raw.json``): ``{"meta": ..., "unit": unit, "series": {name: {**spread(values),
    "values": [...]}}}`` in the order measured, ``meta`` completed by :func:`finish_metadata`.
    Returns the series dict (its medians and spreads are what the table should print)."""
    series = {str(k): {**spread(v), "values": [float(x) for x in v]} for k, v in samples.items()}
    doc = {"meta": finish_metadata(meta), "unit": unit, "series": series}
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return series


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
