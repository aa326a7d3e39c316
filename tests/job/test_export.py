"""``python -m layerpar.export`` (issue 40 item 12): a run folder of every method -- mgrit,
serial, and the layer-wise sequential and decoupled runs, whose test metrics come from the
serial forward of the trained network -- becomes a TorchScript file that a process where
``mgrit``, ``layerpar``, ``layerwise`` and ``data`` cannot be imported loads with PyTorch
alone, and whose outputs equal the layerpar model's in float64 (the reference: the network
the job trained, evaluated by the job's own loop, and :func:`layerpar.export.load_run`)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from mpi4py import MPI

from layerpar.jobconfig import JobConfig

pytestmark = pytest.mark.slow  # whole (tiny) jobs in this process

TINY = dict(epochs=1, limit_train=40, limit_test=12, batch_size=20, no_progress=True,
            dtype="float64")
RUNS = {  # name: (settings, input kind)
    "mgrit": (dict(dataset="digits", layers=4, width=6, levels=2, cfactor=2), "image"),
    "sequential": (dict(dataset="digits", layers=2, width=6, method="sequential"), "image"),
    "decoupled": (dict(dataset="digits", layers=3, width=6, method="decoupled", stages=2),
                  "image"),
    "vit": (dict(dataset="digits", model="vit", layers=2, d_model=8, heads=2, patch=4,
                 serial=True), "image"),
    "gpt": (dict(dataset="pydoc-topics", model="gpt", layers=2, d_model=8, heads=2,
                 context=12, buffer_layers=1, serial=True), "text"),
    "gru": (dict(dataset="adding", model="gru", hidden=5, seq_len=9, serial=True), "seq"),
}

BLOCKED = textwrap.dedent('''
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("mgrit", "layerpar", "layerwise", "data"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
    sys.meta_path.insert(0, Block())
    import torch
    try:
        import mgrit
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("mgrit importable")
    names, inputs = sys.argv[1], sys.argv[2]
    xs = torch.load(inputs)
    outs = {n: torch.jit.load(f"{names}/{n}.pt")(xs[n]) for n in xs}
    assert not [m for m in sys.modules if m.split(".")[0] in ("mgrit", "layerpar", "layerwise")]
    torch.save(outs, f"{names}/outs.pt")
''')


def test_every_method_exports_a_model_that_loads_with_pytorch_alone(tmp_path):
    from layerpar.export import export_run, load_run, main as export_main
    from layerpar.job import _load, run_job

    before = torch.get_default_dtype()
    xs, want, summary = {}, {}, {}
    try:
        for name, (kw, kind) in RUNS.items():
            run = tmp_path / name
            c = JobConfig(**TINY, **kw, out=str(run)).validated(1)
            torch.set_default_dtype(torch.float64)
            run_job(c, MPI.COMM_WORLD)
            (_, _), (xte, yte), _ = _load(c, torch.float64)
            xs[name] = xte[:5]
            model = load_run(run)
            assert not model.training and next(model.parameters()).dtype == torch.float64
            with torch.no_grad():
                want[name] = model(xs[name])
                logits = model(xte)
            summary[name] = json.loads((run / "summary.json").read_text())["final"]
            if name in ("sequential", "decoupled", "vit"):  # their test metrics: this network's
                acc = (logits.argmax(1) == yte).double().mean().item()
                assert acc == pytest.approx(summary[name]["test_acc"], abs=1e-12), name
            if name == "gru":
                assert export_main([str(run), str(tmp_path / f"{name}.pt")]) == 0
            else:
                export_run(run, tmp_path / f"{name}.pt")
    finally:
        torch.set_default_dtype(before)
    torch.save(xs, tmp_path / "inputs.pt")
    r = subprocess.run([sys.executable, "-I", "-c", BLOCKED, str(tmp_path),
                        str(tmp_path / "inputs.pt")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / "outs.pt")
    for name in RUNS:
        assert got[name].dtype == torch.float64 and got[name].shape == want[name].shape, name
        assert torch.allclose(got[name], want[name], rtol=1e-12, atol=1e-14), \
            (name, (got[name] - want[name]).abs().max())
