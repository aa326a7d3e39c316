"""The main job's spatial-coarsening flags (issue 35 item 4): ``--spatial-coarsening LEVELS``,
``--spatial-restrict``, ``--spatial-prolong`` are refused outside conv steps of ``--model
resnet`` under ``--method mgrit`` (the same message on every rank: validation needs no
communication), recorded in the run's config, and an exact-mode job with them trains like the
serial job (spatial coarsening changes only the coarse-grid correction, never the fixed
point)."""
from __future__ import annotations

import json

import pytest
import torch
from mpi4py import MPI

from layerpar.validation import spatial_levels
from tests.job.test_train_job import _load_script

CONV = ["--dataset", "digits", "--step", "conv", "--channels", "2", "--layers", "4", "--relax",
        "FCF"]


@pytest.fixture(scope="module")
def parser():
    return _load_script().build_parser()


@pytest.mark.parametrize("args, message", [
    (["--dataset", "digits", "--spatial-coarsening", "1"],
     "use --model resnet with --step conv or twoconv (got --model resnet --step dense)"),
    (CONV + ["--spatial-coarsening", "1", "--serial"],
     "acts on the coarse MGRIT levels: use --method mgrit (got --method serial)"),
    (CONV + ["--spatial-coarsening", "1,3"],
     "names level 3, but --levels 3 has levels 0..2"),
    (CONV + ["--spatial-coarsening", "0"], "--spatial-coarsening='0' is not allowed"),
    (CONV + ["--spatial-coarsening", "1,1"], "each once"),
    (CONV + ["--spatial-coarsening", "x"], "--spatial-coarsening='x' is not allowed"),
    (CONV + ["--spatial-restrict", "injection"],
     "--spatial-restrict injection chooses an operator of spatial coarsening: it needs "
     "--spatial-coarsening LEVELS"),
    (CONV + ["--spatial-prolong", "constant"], "needs --spatial-coarsening"),
    (CONV + ["--spatial-coarsening", "1", "--relax", "F,FCF"],
     "--spatial-coarsening level 1 needs C-relaxation on level 0, but --relax F,FCF gives it F"),
    (CONV + ["--spatial-coarsening", "2", "--relax", "FCF,F"], "on level 1, but --relax FCF,F"),
    (CONV + ["--spatial-coarsening", "1", "--spatial-restrict", "average"],
     "invalid choice: 'average'"),
])
def test_spatial_flags_are_refused_outside_conv_mgrit(parser, args, message, capsys):
    with pytest.raises(SystemExit) as e:
        parser.parse_config(args, 1)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_spatial_flags_are_settings(parser):
    c = parser.parse_config(CONV + ["--spatial-coarsening", "2,1", "--spatial-restrict",
                                    "injection", "--spatial-prolong", "constant"], 1)
    d = c.to_dict()
    assert (d["spatial_coarsening"], d["spatial_restrict"], d["spatial_prolong"]) == \
        ("2,1", "injection", "constant")
    assert spatial_levels(c.spatial_coarsening) == (1, 2) and spatial_levels("") == ()
    plain = parser.parse_config(CONV, 1).to_dict()
    assert (plain["spatial_coarsening"], plain["spatial_restrict"]) == ("", None)


def test_spatial_option_of_a_config(parser):
    pytest.importorskip("mgrit.spatial")
    from mgrit.models.options import spatial_option
    from mgrit.spatial import SpatialCoarsening

    assert spatial_option(parser.parse_config(CONV, 1)) is None
    s = spatial_option(parser.parse_config(CONV + ["--spatial-coarsening", "1,2",
                                                   "--spatial-prolong", "constant"], 1))
    assert isinstance(s, SpatialCoarsening)
    assert tuple(s.levels) == (1, 2) and s.restrict_kind == "full_weighting" and s.prolong_kind == "constant"


@pytest.mark.slow  # two whole jobs in this process (a few seconds)
def test_exact_job_with_spatial_coarsening_trains_like_serial(parser, tmp_path):
    """Voxel data (3-D conv steps), 2 MGRIT levels with level 1 coarsened (15^3 -> 7^3),
    exact mode in float64: the final loss and accuracies equal the serial job's (1e-8), and
    the flags are in config.json and summary.json."""
    pytest.importorskip("mgrit.spatial")
    from layerpar.job import run_job

    base = ["--dataset", "voxels", "--step", "conv", "--channels", "2", "--layers", "8",
            "--levels", "2", "--cfactor", "2", "--relax", "FCF", "--epochs", "1", "--limit-train", "40",
            "--limit-test", "20", "--batch-size", "20", "--dtype", "float64", "--no-progress",
            "--lr", "0.05"]
    dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        sp = run_job(parser.parse_config(base + ["--tol", "1e-11", "--spatial-coarsening", "1",
                                                 "--out", str(tmp_path / "sp")], 1),
                     MPI.COMM_SELF)
        ser = run_job(parser.parse_config(base + ["--serial", "--out", str(tmp_path / "ser")],
                                          1), MPI.COMM_SELF)
    finally:
        torch.set_default_dtype(dtype)
    assert sp["loss"] == pytest.approx(ser["loss"], rel=1e-8)
    assert sp["test_acc"] == ser["test_acc"] and sp["train_acc"] == ser["train_acc"]
    cfg = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert cfg["spatial_coarsening"] == "1" and cfg["input_shape"] == [1, 15, 15, 15]
    summary = json.loads((tmp_path / "sp" / "summary.json").read_text())
    assert summary["config"]["spatial_coarsening"] == "1"
