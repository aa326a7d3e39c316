"""The documentation site builds from the docstrings without a single warning (``-W``), and
its pages are there: getting started, concepts, one page per feature, the API reference with
the public classes of every package."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.job.test_train_job import ROOT

pytestmark = pytest.mark.slow  # MPI launches / builds (the quick subset skips them)

pytest.importorskip("sphinx")  # the dev and docs extras install it

FEATURES = ["resnet", "segments", "transformers", "gru", "dataparallel", "checkpoints", "resume",
            "guard", "layerwise", "mgopt", "mainjob", "tracing", "spatial_coarsening"]
API = ["mgrit.solver.MGRIT", "mgrit.options.MGRITOptions", "mgrit.propagator.Propagator",
       "mgrit.nn.LayerParallelResNet", "mgrit.nn.LayerParallelNet", "mgrit.nn.ParallelGRU",
       "mgrit.parallel.ProcessGrid",
       "mgrit.perf.trace.Tracer", "mgrit.training.Trainer", "mgrit.training.LRSchedule",
       "mgrit.training.lrschedule.make_scheduler", "mgrit.training.callbacks.state_keys",
       "layerwise.build_method",
       "data.load_dataset"]


def test_docs_build_without_warnings(tmp_path):
    out = tmp_path / "html"
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-j", "1", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "WARNING" not in p.stderr, p.stdout[-3000:] + p.stderr[-5000:]
    for page in ["index", "getting_started", "concepts", "api"] + [f"features/{f}" for f in FEATURES]:
        assert (out / f"{page}.html").is_file(), page
    api = (out / "api.html").read_text()
    missing = [name for name in API if f'id="{name}"' not in api]
    assert not missing, f"not documented in api.html: {missing}"
    # the examples are shown as they are run by tests/docs/test_examples.py
    assert "GatedStep" in (out / "getting_started.html").read_text()
