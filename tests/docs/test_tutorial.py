"""The tutorial notebook (``examples/tutorial.ipynb``, committed without outputs) executes on
one process in a kernel of this interpreter, and what it prints holds: the MGRIT states
approach the serial states with every cycle, and the layer-parallel gradient approaches serial
autograd's with every cycle, to round-off in exact mode."""
from __future__ import annotations

import json
import re
import sys

import pytest

from tests.job.test_train_job import ROOT

pytestmark = pytest.mark.slow  # MPI launches / builds (the quick subset skips them)

nbformat = pytest.importorskip("nbformat")  # the dev extra installs nbclient, nbformat, ipykernel
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
NOTEBOOK = ROOT / "examples" / "tutorial.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in nb.cells if c.cell_type == "code")


def test_tutorial_runs(tmp_path, monkeypatch):
    # a kernel spec of this interpreter, whatever kernels the machine has installed
    spec = tmp_path / "kernels" / "layerpar-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "layerpar test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="layerpar-test",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")
    states = [float(e) for e in re.findall(r"^\s+\d+\s+\S+\s+(\S+)$", text, re.M)]
    assert len(states) == 6 and all(b < a for a, b in zip(states, states[1:])), text
    grads = [float(e) for e in re.findall(r"^\s+\d+\s+(\S+)$", text, re.M)]
    assert len(grads) == 5 and all(b < a for a, b in zip(grads, grads[1:])), text
    exact = float(re.search(r"exact \(tol 1e-10\)\s+(\S+)", text).group(1))
    assert exact < 1e-10 and grads[-1] < 1e-3, text
    factors = re.findall(r"^(F|FCF)\s+\d+\s+\d+\s+\d+\s+(\S+)$", text, re.M)
    assert len(factors) == 12 and all(0 <= float(f) < 1 for _, f in factors), text
