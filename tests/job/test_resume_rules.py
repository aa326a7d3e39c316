"""The main job's run folder on resume and after a late error (issue 40 items 1, 2, 4, 7, 9):

* a folder where a job failed before its first step (config, console and error logs only) is
  re-used by the corrected rerun; a folder with trained results is refused as before;
* ``--resume`` into another run's non-empty folder is refused unless ``--overwrite``; into the
  checkpoint's own folder it continues there (``--overwrite`` then refused);
* one layer-parallel job in this process (1 rank), resumed with ``--serial --no-progress
  --epochs 4 --lr 0.05``: every step of the first run stays in ``steps.csv``, the new rate,
  the re-planned cosine and the guard state the serial run has no use for are in
  ``summary.json`` and the console; ``--epochs 2`` from the epoch-2 checkpoint is refused.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from mpi4py import MPI

from tests.job.test_train_job import TINY, _load_script


@pytest.fixture(scope="module")
def parser():
    return _load_script().build_parser()


def _refused(parser, args, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parser.parse_config(args, 1)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_never_trained_folder_is_reused(parser, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"argv": ["train.py"], "model": "vit"}))
    (run / "console.log").write_text("[train] ...\n")
    (run / "error-rank-0.log").write_text("Traceback ...\n")
    (run / "steps.csv").write_text("step,epoch,loss,accuracy\n")
    parser.parse_config(TINY + ["--out", str(run)], 1)  # accepted: no job trained there
    (run / "steps.csv").write_text("step,epoch,loss,accuracy\n0,0.5,2.3,0.1\n")
    assert "exists and is not empty" in _refused(parser, TINY + ["--out", str(run)], capsys)
    (run / "steps.csv").unlink()
    (run / "config.json").write_text("{}")  # not the job's config.json: someone's file
    assert "exists and is not empty" in _refused(parser, TINY + ["--out", str(run)], capsys)
    (run / "config.json").unlink()  # logs without the job's config.json: not the job's
    assert "exists and is not empty" in _refused(parser, TINY + ["--out", str(run)], capsys)


def test_resume_into_another_runs_folder_needs_overwrite(parser, tmp_path, capsys):
    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir()
    other.mkdir()
    ckpt = home / "checkpoint.pt"
    ckpt.write_text("x")
    (home / "summary.json").write_text("{}")
    (other / "summary.json").write_text("{}")
    err = _refused(parser, TINY + ["--resume", str(ckpt), "--out", str(other)], capsys)
    assert f"--out={str(other)!r} is another run's folder" in err and str(home) in err
    parser.parse_config(TINY + ["--resume", str(ckpt), "--out", str(other), "--overwrite"], 1)
    parser.parse_config(TINY + ["--resume", str(ckpt), "--out", str(home)], 1)
    parser.parse_config(TINY + ["--resume", str(ckpt), "--out", str(tmp_path / "new")], 1)
    assert "pass one of them" in _refused(
        parser, TINY + ["--resume", str(ckpt), "--out", str(home), "--overwrite"], capsys)


@pytest.mark.slow  # whole jobs (in this process, a few seconds)
def test_resumed_job_uses_and_records_its_settings(parser, tmp_path, capsys):
    from layerpar.job import run_job

    base = ["--dataset", "digits", "--layers", "2", "--width", "8",
            "--limit-train", "100", "--limit-test", "50", "--batch-size", "25",
            "--lr-schedule", "cosine", "--checkpoint-every", "4"]  # 4 steps per epoch
    a, b = tmp_path / "a", tmp_path / "b"
    dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        run_job(parser.parse_config(base + ["--epochs", "2", "--out", str(a)], 1), MPI.COMM_SELF)
        capsys.readouterr()
        run_job(parser.parse_config(base + ["--epochs", "4", "--lr", "0.05", "--no-progress",
                                            "--serial", "--resume", str(a / "checkpoint.pt"),
                                            "--out", str(b)], 1), MPI.COMM_SELF)
        out = capsys.readouterr().out
        run_job(parser.parse_config(base + ["--epochs", "3", "--fwd-iters", "3", "--resume",
                                            str(a / "checkpoint.pt"), "--out",
                                            str(tmp_path / "d")], 1), MPI.COMM_SELF)
        capsys.readouterr()
        err = _refused(parser, base + ["--epochs", "2", "--resume", str(a / "checkpoint.pt"),
                                       "--out", str(tmp_path / "c")], capsys)
        assert "is at the end of epoch 2 of the run's 2: nothing is left to train" in err
        # into the run's own folder (the newcomer's trial): refused before any output, so the
        # finished run's files stay as they were; a weights-only file likewise
        before = {f.name: f.read_bytes() for f in a.iterdir() if f.is_file()}
        for args, says in ((["--epochs", "1", "--resume", str(a / "checkpoint.pt")],
                            "nothing is left to train"),
                           (["--epochs", "3", "--resume", str(a / "model.pt")],
                            "is not a training checkpoint")):
            assert says in _refused(parser, base + args + ["--out", str(a)], capsys)
        assert {f.name: f.read_bytes() for f in a.iterdir() if f.is_file()} == before
    finally:
        torch.set_default_dtype(dtype)
    rows = (b / "steps.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(16))  # the first run's 8 too
    lrs = [float(r.split(",")[4]) for r in rows]  # the rate each step used: cosine per step
    cos = [0.5 * (1 + math.cos(math.pi * k / n)) for n, ks in ((8, range(8)), (16, range(8, 16)))
           for k in ks]  # over 8 steps at 0.01, then re-planned over 16 at 0.05 from step 8
    assert lrs == pytest.approx([0.01 * c for c in cos[:8]] + [0.05 * c for c in cos[8:]],
                                rel=1e-12)
    summary = json.loads((b / "summary.json").read_text())
    notes = summary["resumed"]["notes"]
    assert summary["config"]["lr"] == 0.05 and summary["resumed"]["at_epoch"] == 3
    assert any("lr 0.01 -> 0.05" in n for n in notes), notes
    assert any("re-planned" in n and "epochs 2 -> 4" in n for n in notes), notes
    assert any("ConvergenceGuard not restored" in n for n in notes), notes  # (mgrit only)
    assert "lr 0.01 -> 0.05" in out and "re-planned" in out
    assert len(json.loads((b / "summary.json").read_text())["epochs"]["loss"]) == 4
    t = summary["times"]  # this run's 2 epochs within its wall time; all 4 epochs beside
    epoch_s = summary["epochs"]["epoch_time"]
    assert t["train_s"] == pytest.approx(sum(epoch_s[2:])) and t["train_s"] <= t["total_s"]
    assert t["train_s_all_runs"] == pytest.approx(sum(epoch_s))
    assert not (tmp_path / "c").exists()  # refused before any output
    notes = json.loads((tmp_path / "d" / "summary.json").read_text())["resumed"]["notes"]
    assert any("the checkpoint's MGRIT options continue" in n and "max_iter 2 (this run: 3)" in n
               for n in notes), notes  # kept (a guard may have changed them), and said so
