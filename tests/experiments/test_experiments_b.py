"""The one command (``experiments/regenerate.py --quick``) on the Günther and layer-wise studies,
the GPU scripts' CPU dry runs (``bench_gpu.py --dry-run``, ``gpu_check.py --dry-run``: the
same code paths with device = cpu, so they cannot rot on machines without a GPU) and the main
job's acceptance record (``compare_mainjob.py``); checks of their outputs against independent
references (parameter counts by hand, the Peaks objective at the shared initialization, the
runs' own ``summary.json``) and the ``--help`` flags."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.experiments.regenerate_quick import assert_every_script_ok

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

ROOT = Path(__file__).resolve().parents[2]
# stateful_records.py's end-to-end smoke is batchnorm_dropout; its tied_resnet study (the same
# script and report) runs the tied pair alone: test_tied_study_runs_and_reports
ONLY = ["guenther2020", "layerwise", "bench_gpu", "gpu_check", "mnist_mgrit_vs_serial",
        "batchnorm_dropout", "transformers"]

QUICK = ONLY  # run by the session's one quick run (tests/experiments/conftest.py)


def test_regenerate_quick_runs_every_script(quick):
    assert_every_script_ok(quick, ONLY)


def test_guenther_seeds_and_summary(quick):
    from experiments.reports.study_parts import read_part
    d = quick[0] / "reproductions" / "guenther2020"
    s, meta = read_part(d / "results.h5", "run")
    S = int(meta["setting_seeds"])
    assert S >= 2
    for i in range(S):
        ser, sim = s[f"seed{i}/serial/objective"], s[f"seed{i}/simultaneous/objective"]
        assert len(ser) == len(sim) == 4  # iterations 0..3
        assert ser[-1] < ser[0] and sim[-1] < sim[0]
        # same initial weights: the 2-iteration MGRIT objective is close to the exact one
        assert abs(ser[0] - sim[0]) < 1e-2 * ser[0]
        assert np.all(np.isfinite(s[f"seed{i}/simultaneous/fwd_factor"][1:]))
    summary = (d / "summary.md").read_text()
    assert "no published number" in summary
    val = np.array([s[f"seed{i}/serial/val_acc"][-1] for i in range(S)])
    assert f"{100 * val.mean():.1f} ± {100 * val.std():.1f}%" in summary
    for f in ("objective_vs_iter.png", "val_acc_vs_iter.png", "convergence_factors.png"):
        assert (d / f).stat().st_size > 1000


def test_layerwise_sweep_memory_and_parameters(quick):
    from experiments.reports.study_parts import read_part
    d = quick[0] / "reproductions" / "layerwise"
    s, meta = read_part(d / "results.h5", "accuracy")
    n = "digits_3x16"
    lrs = meta["lrs"]
    for m in ("e2e", "seq", "dgl", "e2e_long", "seq_long"):
        val = s[f"{n}/{m}/val"]
        assert val.shape == (len(lrs), meta["seeds"]) and np.all((0 <= val) & (val <= 1))
        assert int(s[f"{n}/{m}/selected"][0]) == int(np.argmax(val.mean(1)))
    names = [x.decode() for x in s[f"{n}/memory_names"]]
    # digits: 64 inputs, 10 classes; MLP 3x16 with linear heads -- counted by hand
    layer = [64 * 16 + 16, 16 * 16 + 16, 16 * 16 + 16]
    head = 16 * 10 + 10
    tps = {nm: list(s[f"{n}/memory/{i}/trainable_per_stage"]) for i, nm in enumerate(names)}
    assert tps["end-to-end"] == [sum(layer) + head]
    assert tps["sequential"] == [v + head for v in layer]
    for i, nm in enumerate(names):
        assert s[f"{n}/memory/{i}/activations"][0] > 0
    # sequential's peak stage holds frozen + trainable state: less than end-to-end's 3x all
    assert s[f"{n}/memory/{names.index('sequential')}/state"][0] < s[f"{n}/memory/0/state"][0]
    r = "peaksreg_2x8"  # the regression path: end-to-end always, MSE > 0
    assert np.all(s[f"{r}/e2e/test"] > 0)
    summary = (d / "summary.md").read_text()
    assert "our reading of Kim 2019" in summary
    i = int(s[f"{n}/e2e/selected"][0])
    t = s[f"{n}/e2e/test"][i]
    from experiments.reports import seeds
    assert f"end-to-end {seeds.fmt_values(t, 100, 1, '%')}" in summary  # mean [95% interval]
    j = int(s[f"{n}/dgl/selected"][0])
    d = seeds.fmt(report_paired(t, s[f"{n}/dgl/test"][j]), 100, 1, signed=True)
    assert f"DGL {d} points" in summary  # the paired difference to end-to-end


def report_paired(a, b):
    from mgrit.reporting.writers import paired_interval
    return paired_interval(a, b)


def test_gpu_scripts_dry_run(quick):
    text = (quick[0] / "benchmarks" / "gpu_dry_run" / "bench_gpu.md").read_text()
    assert "DRY RUN" in text and "fwd speedup" in text
    assert "PASS" in (quick[0] / "logs" / "gpu_check.log").read_text()


def test_mainjob_record_is_generated_from_the_runs(quick):
    """compare_mainjob.py --smoke: seeds 0 and 1, serial on 1 rank and MGRIT (2 / 1 cycles) on
    2 ranks at the job's defaults with a validation split; the per-epoch gap and its paired
    interval in table.md are those recomputed here from the runs' own summary.json (Student-t
    by hand), the choice is written with its validation numbers, headline.json states them."""
    import math

    from scipy import stats

    from experiments import regenerate as rg
    from layerpar.jobconfig import JobConfig
    d = quick[0] / "records" / "mnist_mgrit_vs_serial"
    for f in ("table.md", "summary.md", "headline.json", "choice.json", "gap.png"):
        assert (d / f).is_file() and (d / f).stat().st_size > 0, f"missing {f}"
    runs = d / "runs"
    load = lambda r: json.loads((runs / r / "summary.json").read_text())  # noqa: E731
    ser = [load(f"resnet-s{k}-serial") for k in (0, 1)]
    mg = [load(f"resnet-s{k}-mgrit-c21") for k in (0, 1)]
    defaults = JobConfig()
    for k, (s, m) in enumerate(zip(ser, mg)):
        assert (s["world_size"], m["world_size"]) == (1, 2)
        assert s["config"]["seed"] == m["config"]["seed"] == k
        assert s["config"]["n_val"] == m["config"]["n_val"] > 0
        for key in ("dataset", "model", "step", "width", "activation", "levels", "cfactor",
                    "fwd_iters", "bwd_iters", "relax", "tol", "optimizer", "lr", "momentum",
                    "batch_size", "dtype"):  # the job at its defaults (smoke: size only)
            assert m["config"][key] == s["config"][key] == getattr(defaults, key), key
        assert not (runs / f"resnet-s{k}-mgrit-c21" / "checkpoint.pt").exists()
    choice = json.loads((d / "choice.json").read_text())
    assert choice["chosen"] == "2/1" and choice["validation"]["2/1"]["n"] == 2
    val = [100 * m["epochs"]["val_acc"][-1] for m in mg]
    assert abs(choice["validation"]["2/1"]["mean"] - sum(val) / 2) < 1e-9
    table = (d / "table.md").read_text()
    for e in range(len(ser[0]["epochs"]["test_acc"])):
        diff = [100 * (m["epochs"]["test_acc"][e] - s["epochs"]["test_acc"][e])
                for s, m in zip(ser, mg)]
        mean = sum(diff) / 2
        half = stats.t.ppf(0.975, 1) * abs(diff[0] - diff[1]) / math.sqrt(2) / math.sqrt(2)
        assert f"| {mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}] |" in table, (e, diff)
    head = json.loads((d / "headline.json").read_text())
    assert head["commits"] == sorted({r["git_commit"] for r in ser + mg})
    acc, timing = head["rows"]
    assert acc["kind"] == "measured" and timing["kind"] in ("timing", "unreliable timing")
    assert "2 seeds" in acc["ours"] and "95% interval" in acc["ours"]
    assert "[mnist_mgrit_vs_serial](results/records/mnist_mgrit_vs_serial/summary.md)" in \
        rg.readme_block(quick[0])
    e = {x.name: x for x in rg.REGISTRY}["mnist_mgrit_vs_serial"]
    assert rg.command(e, "full", "all", Path("/x"))[:2] == [sys.executable,
                                                            str(ROOT / e.script)]


def test_transformer_record_is_generated_from_the_runs(quick):
    """transformer_records.py --smoke: the ViT and the GPT, seed 0, serial and MGRIT 2 / 1 with
    a validation split; the choice, the per-epoch gap (one seed: no interval) and the README
    sentence come from the runs' summary.json."""
    d = quick[0] / "records" / "transformers"
    choice = json.loads((d / "choice.json").read_text())
    assert choice["chosen"] == {"vit": "2/1", "gpt": "2/1"}
    table, summary = (d / "table.md").read_text(), (d / "summary.md").read_text()
    for model, key in (("vit", "test_acc"), ("gpt", "test_loss")):
        ser, mg = (json.loads((d / "runs" / f"{model}-ode-s0-{m}" / "summary.json").read_text())
                   for m in ("serial", "mgrit-c21"))
        assert (ser["world_size"], mg["world_size"]) == (1, 2)
        assert ser["config"]["n_val"] == mg["config"]["n_val"] > 0
        a, b = ser["epochs"][key][-1], mg["epochs"][key][-1]
        gap = 100 * (b - a) if key == "test_acc" else 100 * (b / a - 1)
        unit = "points" if key == "test_acc" else "%"
        assert f"MGRIT - serial {gap:+.2f} {unit} from one seed: no interval" in table
        assert f"{model} ode {gap:+.2f} (n=1, no interval) {unit}" in summary
    assert (d / "gap_vit.png").is_file() and (d / "gap_gpt.png").is_file()


def test_stateful_records_are_generated_from_the_runs(quick):
    """stateful_records.py (issue 23): the BatchNorm ResNet and the dropout ViT, serial on 1
    rank and MGRIT on 2 with the same flags and seed; the summary's gap table states the runs'
    last-epoch accuracies (one seed: no interval, no verdict)."""
    d = quick[0] / "records" / "batchnorm_dropout"
    summary = (d / "summary.md").read_text()
    for model, flag in (("cifar-resnet", ("model", "cifar-resnet")),
                        ("vit-dropout", ("dropout", 0.1))):
        ser, mg = (json.loads((d / "runs" / f"{model}-s0-{m}" / "summary.json").read_text())
                   for m in ("serial", "mgrit"))
        assert (ser["world_size"], mg["world_size"]) == (1, 2)
        assert ser["config"][flag[0]] == mg["config"][flag[0]] == flag[1]
        assert ser["config"]["seed"] == mg["config"]["seed"] == 0
        sa, ma = ser["epochs"]["test_acc"][-1] * 100, mg["epochs"]["test_acc"][-1] * 100
        last = len(ser["epochs"]["test_acc"])
        section = summary.split(f"## {model} (1 seeds: [0])", 1)[1].split("## ", 1)[0]
        assert (f"| {last} | {sa:.2f}% (n=1, no interval) | {ma:.2f}% (n=1, no interval) | "
                in section), section
        assert "Verdict (last epoch, test): MGRIT - serial" in section
        assert "from one seed: no interval, no verdict" in section


def test_tied_study_runs_and_reports(tmp_path, monkeypatch):
    """stateful_records.py's tied_resnet study (issue 23): the main job has --tied (the study
    runs, it is not skipped); its smoke jobs of the tied ResNet, serial on 1 rank and MGRIT on
    2, run with the study's flags and seed, and the study's report states them. (The untied
    twin is the job's default --model resnet, the main job's record; the script's end-to-end
    smoke is batchnorm_dropout in the quick run: same main loop, same report.)"""
    from experiments.records import records
    from experiments.records import stateful_records as sr
    assert sr.has_flag("--tied")
    base = tmp_path / "tied_resnet"
    for method in sr.METHODS:
        sr.run("tied_resnet", "resnet-tied", method, 0, base, smoke=True)
    monkeypatch.setitem(sr.STUDIES, "tied_resnet",
                        {"resnet-tied": sr.STUDIES["tied_resnet"]["resnet-tied"]})
    sr.report("tied_resnet", base, (0,))
    ser, mg = (records.load(base / "runs" / f"resnet-tied-s0-{m}") for m in sr.METHODS)
    assert (ser["world_size"], mg["world_size"]) == (1, 2)
    assert ser["config"]["tied"] is mg["config"]["tied"] is True
    assert ser["config"]["seed"] == mg["config"]["seed"] == 0
    assert mg["exact_eval"] is not None  # the MGRIT run's final weights, exact forward
    summary = (base / "summary.md").read_text()
    section = summary.split("## resnet-tied (1 seeds: [0])", 1)[1]
    sa, ma = ser["epochs"]["test_acc"][-1] * 100, mg["epochs"]["test_acc"][-1] * 100
    last = len(ser["epochs"]["test_acc"])
    assert f"| {last} | {sa:.2f}% (n=1, no interval) | {ma:.2f}% (n=1, no interval) | " \
        in section, section


def test_help_flags():
    for script in ("reproductions/reproduce_guenther.py", "reproductions/reproduce_layerwise.py",
                   "records/compare_mainjob.py"):
        p = subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--help"],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0 and "--full" in p.stdout and "--smoke" in p.stdout
        assert "--report-only" in p.stdout


@pytest.mark.parametrize("script, args, first", [
    ("stateful_records.py", ["--study", "tied_resnet"], "resnet-tied-s0-serial"),
    ("transformer_records.py", [], "vit-ode-s0-serial")])
def test_record_report_only_without_runs_is_an_error(tmp_path, capsys, script, args, first):
    """--report-only on a folder without the runs refuses (status 2, the missing runs named)
    and creates nothing, instead of writing empty tables. (In-process, the script's
    ``main(argv)``: its run as a program is the quick run's.)"""
    out = tmp_path / "nothing_here"
    code, err = _main_status(script, [*args, "--report-only", "--out", str(out)], capsys)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "--report-only needs every run; missing" in last and first in last, last
    assert not out.exists()


def _main_status(script, argv, capsys):
    """``(exit status, stderr)`` of ``experiments/records/<script>``'s ``main(argv)``."""
    import importlib
    mod = importlib.import_module(f"experiments.records.{script.removesuffix('.py')}")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    return e.value.code, capsys.readouterr().err


def test_mainjob_report_only_without_runs_is_an_error(tmp_path, capsys):
    code, err = _main_status("compare_mainjob.py", ["--report-only", "--out", str(tmp_path)],
                             capsys)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert "--report-only needs every run; missing" in last and "resnet-s0-serial" in last \
        and "resnet-s4-mgrit-c32" in last, last
    assert not (tmp_path / "mnist_mgrit_vs_serial").exists()
