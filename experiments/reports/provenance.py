"""The provenance check of ``experiments/results/`` (issue 24, item 6): which files are results,
and what each must say about how it was produced.

Every results file carries, per run that produced it, the keys of
:data:`mgrit.reporting.writers.PROVENANCE_KEYS` -- ``command``, ``commit``, ``machine``, ``cores``,
``date``, ``loadavg`` (the 1/5/15-minute load averages when the run started) and
``loadavg_after`` (when its results were written) -- and a table whose 1-minute load average
before or after was at or above ``cores`` carries :data:`~mgrit.reporting.writers.LOAD_FLAG`.
``tests/experiments/test_provenance.py`` runs :func:`problems` on every file of
:func:`results_files`.

The set of results files and what is checked in each:

* ``*.md`` (tables, ``MANIFEST.md``): the metadata block under the title -- ``- key: value``
  lines (what :func:`~mgrit.reporting.writers.write_table` writes: one run), or
  ``- <part> part: key `value`, ...`` lines (a table with parts,
  :func:`~mgrit.reporting.writers.part_lines`: every part is a run). Not checked: a
  ``summary.md`` with a ``table.md`` beside it (generated from that table's runs, which the
  check covers), ``logs/`` (the launcher's output) and ``runs/`` (see below).
* ``*.h5`` (``results.h5``, a benchmark's ``.h5``): the file's attributes, or, for a file of
  parts (:mod:`experiments.reports.study_parts`), every ``meta/<part>`` attribute.
* ``headline.json`` / ``<table>.headline.json``: a non-empty ``commits`` list and its table
  beside it (``table.md`` in the folder, or ``<table>.md``), which is checked itself.
* other ``*.json`` (raw numbers, :func:`~mgrit.reporting.writers.write_raw`; result dumps): a
  ``meta`` object with every key.
* ``runs/<run>/summary.json`` (the main job's run directories, written by ``train.py``): its
  ``argv`` and ``git_commit``; the table that cites the run carries the machine and load.
  The other files of a run directory (``config.json``, ``metrics.h5``, ...) belong to that
  summary.
* not results: figures (``*.png``, drawn from the stored numbers beside them), ``*.jsonl``
  (event logs of a run whose table carries the provenance).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import h5py

from mgrit.reporting.writers import LOAD_FLAG, PROVENANCE_KEYS, load_flagged

__all__ = ["results_files", "problems", "table_runs"]

_PART = re.compile(r"^- (.+?) part: (.*)$")
_PAIR = re.compile(r"(\w+) `([^`]*)`")
_KEY = re.compile(r"^- (\w+): (.*)$")


def results_files(results: str | Path) -> list[Path]:
    """Every results file under ``results`` that the check covers (see the module docstring),
    sorted."""
    results = Path(results)
    out = []
    for f in sorted(results.rglob("*")):
        rel = f.relative_to(results).parts
        if not f.is_file() or rel[0] == "logs":
            continue
        if "runs" in rel[:-1]:
            if f.name == "summary.json":
                out.append(f)
            continue
        if f.suffix in (".md", ".h5", ".json"):
            if f.name == "summary.md" and (f.parent / "table.md").is_file():
                continue
            out.append(f)
    return out


def table_runs(text: str) -> list[dict]:
    """The runs named by a markdown table's metadata block: one dict per ``- <part> part:``
    line, or else one dict of its ``- key: value`` lines (command values lose their
    backticks). The block is the first list of the file, before any table or ``## `` section
    (a paragraph between the title and the list is allowed)."""
    lines = text.splitlines()
    block, started = [], False
    for ln in lines[1:]:
        if ln.startswith("- ") or ln.startswith("  - "):
            started = True
            block.append(ln)
        elif started or ln.startswith("|") or ln.startswith("## "):
            break  # the block ends, or a table / section came first: no block
    parts = [dict(_PAIR.findall(m.group(2))) for m in map(_PART.match, block) if m]
    if parts:
        return parts
    run = {}
    for ln in block:
        m = _KEY.match(ln)
        if m:
            run[m.group(1)] = m.group(2).strip().strip("`")
    return [run]


def _missing(meta: dict) -> list[str]:
    """Keys of PROVENANCE_KEYS that ``meta`` lacks, has empty, ``None`` or ``unknown...``."""
    return [k for k in PROVENANCE_KEYS
            if str(meta.get(k, "")).strip() in ("", "None") or
            str(meta.get(k)).startswith("unknown")]


def _check_runs(runs: list[dict], text: str | None) -> list[str]:
    out = []
    for i, run in enumerate(runs):
        miss = _missing(run)
        if miss:
            out.append(f"run {i}: no {', '.join(miss)}")
        elif text is not None and load_flagged(run) and LOAD_FLAG not in text:
            out.append(f"run {i}: 1-minute load {run['loadavg'].split()[0]} before / "
                       f"{run['loadavg_after'].split()[0]} after on {run['cores']} cores, "
                       f"and no line {LOAD_FLAG!r}")
    return out


def _h5_runs(path: Path) -> list[dict]:
    with h5py.File(path, "r") as f:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    parts = [json.loads(v) for k, v in attrs.items() if k.startswith("meta/")]
    return parts or [attrs]


def problems(path: str | Path) -> list[str]:
    """What ``path`` (a file of :func:`results_files`) lacks; empty when its provenance is
    complete. Unreadable files are a problem, never an exception."""
    path = Path(path)
    try:
        if path.suffix == ".md":
            text = path.read_text()
            return _check_runs(table_runs(text), text)
        if path.suffix == ".h5":
            return _check_runs(_h5_runs(path), None)
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return [f"unreadable: {e}"]
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    if path.name == "summary.json":
        return [f"no {k}" for k in ("argv", "git_commit") if not doc.get(k)]
    if path.name.endswith("headline.json"):
        table = (path.parent / "table.md" if path.name == "headline.json"
                 else path.with_name(path.name[:-len(".headline.json")] + ".md"))
        out = [] if doc.get("commits") else ["no commits"]
        return out + ([] if table.is_file() else [f"no table {table.name} beside it"])
    meta = doc.get("meta")
    if not isinstance(meta, dict):
        return ["no meta object"]
    return _check_runs([meta], None)
