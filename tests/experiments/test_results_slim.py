"""Issue 39, item 1: ``experiments/results/`` keeps what a reader reads and no weights or
per-step HDF5 dumps; every main-job run folder keeps the CSV/JSON that hold all of its numbers
(``experiments/README.md``, "What a record folder holds"). Reads git's index, launches nothing."""
from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: a fresh clone's working tree must stay under this (issue 39's acceptance: 30 MB)
MAX_TRACKED_BYTES = 30 * 1024 * 1024
RUN_KEEPS = ("config.json", "summary.json", "metrics.csv", "steps.csv")


def _tracked() -> list[str]:
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                           timeout=60)
    except FileNotFoundError:
        pytest.skip("no git")
    if p.returncode:
        pytest.skip("not a git checkout")
    return [f for f in p.stdout.decode().split("\0") if f]


def test_no_weights_or_step_dumps_in_git():
    bad = [f for f in _tracked() if f.startswith("experiments/results/")
           and (f.endswith((".pt", ".pth", ".ckpt")) or f.endswith("/metrics.h5"))]
    assert bad == [], bad[:10]


def test_run_folder_outputs_are_ignored():
    run = "experiments/results/records/any_record/runs/any-run"
    names = [f"{run}/{n}" for n in ("model.pt", "checkpoint.pt", "metrics.h5")]
    p = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *names],
                       capture_output=True, text=True, timeout=60)
    assert sorted(p.stdout.split()) == sorted(names), p.stdout + p.stderr
    kept = f"{run}/metrics.csv"
    p = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", kept],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, f"{kept} must stay in git"


def test_every_run_folder_keeps_its_numbers():
    files = set(_tracked())
    runs = sorted({f.rsplit("/", 1)[0] for f in files
                   if f.startswith("experiments/results/") and "/runs/" in f
                   and f.endswith("/summary.json")})
    assert runs, "no run folders found"
    missing = [f"{r}/{n}" for r in runs for n in RUN_KEEPS if f"{r}/{n}" not in files]
    assert missing == [], missing[:10]
    for r in runs:  # the per-epoch table has the columns the HDF5 dump had
        with open(ROOT / r / "metrics.csv", newline="") as fh:
            header = next(csv.reader(fh))
        assert {"epoch", "loss", "test_acc", "test_loss"} <= set(header), (r, header)


def test_tracked_tree_is_small():
    total = sum((ROOT / f).stat().st_size for f in _tracked() if (ROOT / f).is_file())
    assert total < MAX_TRACKED_BYTES, f"{total / 2**20:.1f} MiB tracked"
