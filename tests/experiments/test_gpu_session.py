"""The GPU session script (issue 38) off the GPU: ``--device cuda`` without CUDA fails loudly
(exit 2, the reason in its JSON) instead of skipping; ``--device cpu`` runs the benchmark and
report code paths at tiny sizes and writes results that pass the provenance check."""
import json

import pytest
import torch

from experiments.benchmarks import gpu_session
from experiments.reports import provenance


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda_fails_loudly(tmp_path, capsys):
    assert gpu_session.main(["--out", str(tmp_path), "--device", "cuda"]) == 2
    assert "FAIL" in capsys.readouterr().err
    doc = json.loads((tmp_path / "gpu_session.json").read_text())
    assert "torch.cuda.is_available() is False" in doc["errors"]["cuda"]


@pytest.mark.slow
def test_cpu_code_path_run_measures_and_reports(tmp_path):
    rc = gpu_session.main(["--out", str(tmp_path), "--device", "cpu", "--sections", "bench"])
    assert rc == 1  # the correctness sections did not run: not a pass
    doc = json.loads((tmp_path / "gpu_session.json").read_text())
    assert not doc["errors"], doc["errors"]
    (row,) = doc["sections"]["bench"]["rows"]
    for v in ("serial_eager", "mgrit", "lean_eager"):
        for phase in ("fwd", "train"):
            t = row["variants"][v][phase]
            assert 0 < t["min_s"] <= t["median_s"] <= t["max_s"], (v, phase, t)
    assert row["checks"]["lean_fwd_rel_err"] < 1e-5  # the lean loop is the serial network
    assert 0 < row["checks"]["mgrit_fwd_rel_err"] < 0.5  # 2 cycles: inexact, not wrong
    md = tmp_path / "gpu_session.md"
    assert "### Training step" in md.read_text()
    assert provenance.problems(md) == [] and provenance.problems(tmp_path / "gpu_session.json") == []
