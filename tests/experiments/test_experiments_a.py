"""The one command (``experiments/regenerate.py --quick``) on the Kirby, TorchBraid, convergence
and PyMGRIT scripts: every script exits 0 and leaves results.h5 / table.md / summary.md /
headline.json, and the numbers of each summary are the numbers stored in results.h5 (the
summaries are generated, not written by hand). Plus the registry logic and the parts store
(no MPI). The scripts run concurrently (``--jobs 2``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.experiments.regenerate_quick import assert_every_script_ok

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

ROOT = Path(__file__).resolve().parents[2]
ONLY = ["kirby2020", "torchbraid_mnist", "convergence", "bench_pymgrit"]
ROOMS = {"kirby2020": "reproductions", "torchbraid_mnist": "reproductions", "convergence": "studies"}

QUICK = ONLY  # run by the session's one quick run (tests/experiments/conftest.py)


def test_regenerate_quick_runs_every_script(quick):
    assert_every_script_ok(quick, ONLY)


@pytest.mark.parametrize("study", ["kirby2020", "torchbraid_mnist", "convergence"])
def test_study_outputs(quick, study):
    d = quick[0] / ROOMS[study] / study
    for f in ("results.h5", "table.md", "summary.md", "headline.json"):
        assert (d / f).is_file() and (d / f).stat().st_size > 0, f"{study}: missing {f}"
    assert "commit" in (d / "table.md").read_text()
    with h5py.File(d / "results.h5") as h:
        assert "commit" in h.attrs
    head = json.loads((d / "headline.json").read_text())
    assert head["commits"] and head["rows"] and all(r["ours"] for r in head["rows"])


def test_kirby_summary_is_generated_from_results(quick):
    from experiments.reports.study_parts import read_part
    d = quick[0] / "reproductions" / "kirby2020"
    acc, _ = read_part(d / "results.h5", "accuracy")
    cnt, _ = read_part(d / "results.h5", "count")
    summary = (d / "summary.md").read_text()
    # smoke accuracy run: N = 32, m = 4 -> 8 coarse blocks (2 FCF iterations are not exact)
    assert int(acc["N"][0]) // int(acc["m"][0]) >= 8
    for k in ("serial_acc", "parallel_acc_mgrit", "parallel_acc_exact"):
        assert f"{acc[k][0]:.4f}" in summary
    assert f"{acc['rel_output_error'][0]:.2e}" in summary
    assert acc["rel_output_error"][0] > 0  # inexact forward: not exact by construction
    # count model: N / critical-path steps, stated as a model
    i = int(np.flatnonzero(cnt["P"] == 1)[-1])
    assert cnt["speedup"][i] == pytest.approx(cnt["N"][i] / cnt["units"][i])
    assert f"{int(cnt['N'][i])} / {cnt['units'][i]:.0f}" in summary and "MODEL" in summary


def test_torchbraid_states_differences(quick):
    d = quick[0] / "reproductions" / "torchbraid_mnist"
    summary, table = (d / "summary.md").read_text(), (d / "table.md").read_text()
    assert "Differences from the example's defaults" in summary
    assert "Differences from TorchBraid's example defaults" in table
    from experiments.reports.study_parts import read_part
    s, meta = read_part(d / "results.h5", "run")
    for i, name in enumerate(meta["configs"]):
        assert f"{name} {s[f'cfg{i}/acc'][-1]:.4f}" in summary
    # over seeds (smoke: 2): the verdict is the paired interval of the stored accuracies
    from experiments.reports import seeds
    from mgrit.reporting.writers import paired_interval
    a, b = s["seeds/serial/acc"], s["seeds/layer/acc"]
    assert a.shape == b.shape == (len(meta["seeds"]), meta["epochs"]) and len(meta["seeds"]) >= 2
    d = paired_interval(a[:, -1], b[:, -1])
    assert f"{seeds.fmt(d, 100, 1, signed=True)} points with the inexact MGRIT forward " \
           f"({seeds.verdict(d, 1.0)})" in summary


def test_pymgrit_same_problem_code(quick):
    text = (quick[0] / "benchmarks" / "bench_pymgrit.md").read_text()
    assert "Solver vs solver on the same problem code" in text
    assert "Problem implementations apart" in text
    rows = [l for l in text.splitlines() if l.startswith("| dahlquist-L2") or l.startswith("| heat-L5")]
    assert len(rows) >= 4  # solver rows and step-speed rows
    for r in rows[:2]:  # all four solver x problem combinations: same iterations, same history
        cells = [c.strip() for c in r.strip("|").split("|")]
        its = cells[2].split("/")
        assert len(set(its)) == 1, r
        assert float(cells[4]) < 1e-12, r


def test_registry_parts_logic():
    from experiments import regenerate as rg
    e = {x.name: x for x in rg.REGISTRY}
    out = Path("/x")
    assert "--part" not in rg.command(e["kirby2020"], "full", "all", out)
    assert rg.command(e["kirby2020"], "full", "timing", out)[-2:] == ["--part", "timing"]
    assert rg.command(e["convergence"], "full", "timing", out) is None
    assert rg.command(e["convergence"], "full", "accuracy", out) is not None
    assert rg.command(e["bench_pymgrit"], "full", "accuracy", out) is None
    assert rg.command(e["guenther2020"], "full", "timing", out) is not None  # mixed: both parts
    assert rg.command(e["bench_dataparallel"], "quick", "all", out) is None  # no quick mode yet
    assert "/x/benchmarks/bench_pymgrit.md" in rg.command(e["bench_pymgrit"], "quick", "all", out)


def test_parts_store_keeps_other_parts(tmp_path):
    from experiments.reports.study_parts import parts_in, read_part, write_part
    f = tmp_path / "r.h5"
    write_part(f, "accuracy", {"a": [1.0, 2.0]}, {"commit": "c1"})
    write_part(f, "timing", {"t": [3.0]}, {"commit": "c2"})
    write_part(f, "timing", {"t": [4.0, 5.0]}, {"commit": "c3"})
    assert parts_in(f) == ["accuracy", "timing"]
    a, ma = read_part(f, "accuracy")
    t, mt = read_part(f, "timing")
    assert list(a["a"]) == [1.0, 2.0] and ma["commit"] == "c1"
    assert list(t["t"]) == [4.0, 5.0] and mt["commit"] == "c3"
    assert read_part(f, "nope") is None
