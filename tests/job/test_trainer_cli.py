"""What a user sees (issue 13 items 8 and 10) and the researcher's script (issue 16).

* Failures after argument parsing: one line (rank, phase, message, what to do), the traceback
  in ``RUN/error-rank-R.log`` (printed with ``--debug``), no MPI abort banner.
* A bad flag: the usage block once, exit status 2. ``--help``: one default per flag.
* A crafted checkpoint (``__reduce__`` that writes a marker file): refused with the file named,
  nothing runs -- through ``load_checkpoint`` and through ``--resume``.
* The <= 15-line script of the README trains on 4 ranks (2 layer x 2 data) with a checkpoint
  and equals a serial plain loop (float64, exact MGRIT: 1e-8).
"""
from __future__ import annotations

import ast
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from data import load_dataset
from mgrit.nn import DenseStep, serial_resnet
from mgrit.training.checkpoint import load_checkpoint
from mgrit.training.checkpoint.io import FORMAT
from tests.mpi_harness import mpiexec_path
from tests.job.test_train_job import ROOT, TIMEOUT, TINY, _load_script, job_env, run_jobs


class _Crafted:
    """Unpickling calls ``open(marker, "w")``: a stand-in for any code a file could run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _craft(tmp_path):
    marker = tmp_path / "MARKER"
    zipped, legacy = tmp_path / "crafted.pt", tmp_path / "crafted-legacy.pt"
    torch.save({"format": FORMAT, "model": _Crafted(str(marker))}, zipped)
    with open(legacy, "wb") as fh:
        pickle.dump({"format": FORMAT, "model": _Crafted(str(marker))}, fh, protocol=2)
    return marker, zipped, legacy


def test_crafted_checkpoint_runs_nothing(tmp_path):
    """Issue 13 item 10 (library): both file kinds are a ValueError naming the file."""
    marker, zipped, legacy = _craft(tmp_path)
    for path in (zipped, legacy):
        with pytest.raises(ValueError) as e:
            load_checkpoint(path, nn.Linear(2, 2), None)
        assert str(path) in str(e.value) and "nothing in it was loaded or run" in str(e.value)
    assert not marker.exists()


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    marker, zipped, _ = _craft(base)
    jobs = {
        "badout": (2, TINY + ["--out", "/proc/layerpar-no-such-dir/run"]),
        "badflag": (2, TINY + ["--levels", "0"]),
        "crafted": (2, TINY + ["--resume", str(zipped)]),
        "crafted-debug": (1, TINY + ["--resume", str(zipped), "--debug"]),
    }
    return marker, zipped, run_jobs(jobs, base)


def _failure_lines(text):
    """The one-line reports (the traceback's note 'rank R failed in phase P' has no colon)."""
    return [line for line in text.splitlines() if re.match(r"rank \d+ failed .*: ", line)]


@pytest.mark.slow
def test_bad_out_is_one_clear_line(cli):
    out, rc, so, se = cli[2]["badout"]
    text = so + se
    assert rc != 0
    lines = _failure_lines(text)
    assert len(lines) == 1, text
    assert "rank 0 failed in phase run directory: OSError: cannot create the run directory" \
        in lines[0] and "what to do: choose a writable run directory" in lines[0], text
    assert "Traceback" not in text and "Abort(" not in text, text


@pytest.mark.slow
def test_bad_flag_prints_usage_once(cli):
    out, rc, so, se = cli[2]["badflag"]
    text = so + se
    assert rc == 2, text
    assert text.count("usage:") == 1 and text.count("--levels=0 is not allowed") == 1, text
    assert "Abort(" not in text and "Traceback" not in text, text


@pytest.mark.slow
def test_crafted_resume_is_one_line_and_runs_nothing(cli):
    marker, zipped, results = cli
    out, rc, so, se = results["crafted"]
    text = so + se
    assert rc != 0 and not marker.exists()
    lines = _failure_lines(text)
    assert len(lines) == 1, text
    assert "failed in phase checkpoint: ValueError" in lines[0] and str(zipped) in lines[0], text
    assert f"traceback: {out / 'error-rank-0.log'}" in lines[0], text
    assert "Traceback" not in text and "Abort(" not in text, text
    assert "Traceback" in (out / "error-rank-0.log").read_text()
    out, rc, so, se = results["crafted-debug"]
    assert rc != 0 and "Traceback" in se and len(_failure_lines(so + se)) == 1, so + se


def test_help_shows_each_default_once():
    text = " ".join(_load_script().build_parser().format_help().split())
    assert "(default: None)" not in text
    assert not re.search(r"\(default:[^()]*(\([^()]*\))?[^()]*\) \(default:", text), text
    assert "(default: on in inexact mode, off with --tol > 0)" in text


def _readme_script() -> str:
    """The python block under "Using the layer-parallel ResNet" in README.md."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using the layer-parallel ResNet", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


SCRIPT = _readme_script()


def _serial_reference():
    """The script's network and training as a serial plain loop (float64)."""
    train, test = load_dataset("digits")
    layers = serial_resnet(lambda k: DenseStep(16, "tanh"), 8, T=1.0, seed=0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(64, 16)), *layers, nn.Linear(16, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.as_tensor(train.x, dtype=torch.float64), torch.as_tensor(train.y)
    for epoch in range(2):
        perm = np.random.default_rng([0, epoch]).permutation(len(y))
        tot = np.zeros(3)
        for s in range(0, len(y), 50):
            j = torch.as_tensor(perm[s:s + 50])
            opt.zero_grad()
            out = net(x[j])
            loss = F.cross_entropy(out, y[j])
            loss.backward()
            opt.step()
            tot += [loss.item() * len(j), (out.argmax(1) == y[j]).sum().item(), len(j)]
    with torch.no_grad():
        out = net(torch.as_tensor(test.x, dtype=torch.float64))
        ty = torch.as_tensor(test.y)
        test_loss = F.cross_entropy(out, ty).item()
        test_acc = (out.argmax(1) == ty).double().mean().item()
    return net, {"loss": tot[0] / tot[2], "train_acc": tot[1] / tot[2], "test_acc": test_acc,
                 "test_loss": test_loss}


@pytest.mark.slow
def test_researcher_script_on_4_ranks(tmp_path):
    """Issue 16: the README's script (<= 15 lines) trains layer-parallel x data-parallel with a
    checkpoint through the library loop; its result equals the serial plain loop (exact MGRIT,
    float64: 1e-8), and its checkpoint loads into the serial network."""
    lines = [line for line in SCRIPT.splitlines() if line.strip()]
    assert len(lines) <= 15, len(lines)
    script, ckpt = tmp_path / "script.py", tmp_path / "run" / "checkpoint.pt"
    script.write_text(SCRIPT)
    # mpiexec interleaves the ranks' stdout at arbitrary byte boundaries: each rank writes its
    # own file (MPICH's PMI_RANK), the script itself runs unchanged.
    wrapper = tmp_path / "per_rank_stdout.py"
    wrapper.write_text("import os, runpy, sys\n"
                       "sys.stdout = open(f'stdout.{os.environ[\"PMI_RANK\"]}.txt', 'w')\n"
                       f"sys.argv = [{str(script)!r}] + sys.argv[1:]\n"
                       f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    proc = subprocess.run([mpiexec_path(), "-n", "4", sys.executable, "-m", "mpi4py",
                           str(wrapper), str(ckpt)], cwd=tmp_path, env=job_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    outs = [(tmp_path / f"stdout.{r}.txt").read_text() if (tmp_path / f"stdout.{r}.txt").exists()
            else "" for r in range(4)]
    assert proc.returncode == 0, "".join(outs)[-3000:] + proc.stderr[-3000:]
    finals = [ast.literal_eval(line.split("final ", 1)[1]) for out in outs
              for line in out.splitlines() if line.startswith("final ")]
    assert len(finals) == 4 and all(f == finals[0] for f in finals), outs
    assert "MGRIT forward: 2 level(s)" in outs[0]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ref, want = _serial_reference()
        loaded = nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(64, 16)),  # other weights
                               *serial_resnet(lambda k: DenseStep(16, "tanh"), 8, seed=5),
                               nn.Linear(16, 10))
        load_checkpoint(ckpt, loaded, None, restore_rng=False)
    finally:
        torch.set_default_dtype(default)
    for k in ("loss", "test_loss", "train_acc", "test_acc"):
        assert abs(finals[0][k] - want[k]) <= 1e-8, (k, finals[0], want)
    for (n, a), b in zip(loaded.state_dict().items(), ref.state_dict().values()):
        assert float((a - b).abs().max()) <= 1e-8 * max(1.0, float(b.abs().max())), n
