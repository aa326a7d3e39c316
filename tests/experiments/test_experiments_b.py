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

from tests.experiments.regenerate_quick import assert_every_script_ok, run_quick

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

ROOT = Path(__file__).resolve().parents[2]
ONLY = ["guenther2020", "layerwise", "bench_gpu", "gpu_check", "mnist_mgrit_vs_serial",
        "batchnorm_dropout", "tied_resnet"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_quick(tmp_path_factory, ONLY)


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
    from mgrit.training.report import paired_interval
    return paired_interval(a, b)


def test_gpu_scripts_dry_run(quick):
    text = (quick[0] / "benchmarks" / "gpu_dry_run" / "bench_gpu.md").read_text()
    assert "DRY RUN" in text and "fwd speedup" in text
    assert "PASS" in (quick[0] / "logs" / "gpu_check.log").read_text()


def test_mainjob_record_is_generated_from_the_runs(quick):
    """compare_mainjob.py: the serial job on 1 rank and the MGRIT job on 2 ranks at the job's
    defaults; summary.md / headline.json state the numbers of the runs' own files."""
    from experiments import regenerate as rg
    from layerpar.jobconfig import JobConfig
    d = quick[0] / "records" / "mnist_mgrit_vs_serial"
    for f in ("table.md", "summary.md", "headline.json"):
        assert (d / f).is_file() and (d / f).stat().st_size > 0, f"missing {f}"
    runs = d / "runs"
    ser, mg = (json.loads((runs / f"resnet-{m}" / "summary.json").read_text())
               for m in ("serial", "mgrit"))
    assert (ser["method"], ser["world_size"], mg["method"], mg["world_size"]) == \
        ("serial", 1, "mgrit", 2)
    defaults = JobConfig()
    for k in ("dataset", "model", "step", "width", "activation", "levels", "cfactor",
              "fwd_iters", "bwd_iters", "relax", "tol", "optimizer", "lr", "momentum",
              "batch_size", "seed", "dtype"):  # the job at its defaults (smoke: size only)
        assert mg["config"][k] == ser["config"][k] == getattr(defaults, k), k
    summary = (d / "summary.md").read_text()
    sa, ma = ser["final"]["test_acc"], mg["final"]["test_acc"]
    assert f"test accuracy {ma * 100:.2f}% (MGRIT) vs {sa * 100:.2f}% (serial)" in summary
    met = (sa - ma) * 100 <= 1
    assert f"**Result: {'met' if met else 'NOT met'}**" in summary
    exact = json.loads((runs / "resnet-mgrit" / "exact_eval.json").read_text())
    assert f"exact (serial) forward: {exact['test_acc'] * 100:.2f}% test accuracy" in summary
    assert not (runs / "resnet-mgrit" / "checkpoint.pt").exists()
    same = ser["final"]["initial_test_acc"] == mg["final"]["initial_test_acc"]
    assert f"(MGRIT, its inexact forward): {'equal' if same else 'not equal'}." in summary
    assert f"parameters {mg['config']['parameters']};" in summary
    ts, tm = ser["times"]["mean_epoch_s"], mg["times"]["mean_epoch_s"]
    assert f"serial {ts:.2f} s on 1 rank, MGRIT {tm:.2f} s on 2 ranks ({tm / ts:.2f}x" in summary
    head = json.loads((d / "headline.json").read_text())
    assert head["commits"] == sorted({ser["git_commit"], mg["git_commit"]})
    acc, timing = head["rows"]
    assert acc["kind"] == "measured" and timing["kind"] == "timing"
    assert acc["ours"].startswith(f"serial {sa * 100:.2f}% vs MGRIT {ma * 100:.2f}%")
    load = json.loads((runs / "resnet-serial" / "load.json").read_text())["before"]
    assert timing["ours"] == (f"serial {ts:.2f} s, MGRIT {tm:.2f} s: {tm / ts:.2f}x of serial "
                              f"(load {' '.join(f'{x:.2f}' for x in load)})")
    assert "[mnist_mgrit_vs_serial](results/records/mnist_mgrit_vs_serial/summary.md)" in \
        rg.readme_block(quick[0])
    e = {x.name: x for x in rg.REGISTRY}["mnist_mgrit_vs_serial"]
    assert rg.command(e, "full", "all", Path("/x"))[:2] == [sys.executable,
                                                            str(ROOT / e.script)]


def test_stateful_records_are_generated_from_the_runs(quick):
    """stateful_records.py (issue 23): the BatchNorm ResNet and the dropout ViT, serial on 1
    rank and MGRIT on 2 with the same flags and seed; the summary states the runs' accuracies;
    the tied study runs (the main job has --tied: the study is ``ok``, not ``skip``)."""
    d = quick[0] / "records" / "batchnorm_dropout"
    summary = (d / "summary.md").read_text()
    for model, flag in (("cifar-resnet", ("model", "cifar-resnet")),
                        ("vit-dropout", ("dropout", 0.1))):
        ser, mg = (json.loads((d / "runs" / f"{model}-s0-{m}" / "summary.json").read_text())
                   for m in ("serial", "mgrit"))
        assert (ser["world_size"], mg["world_size"]) == (1, 2)
        assert ser["config"][flag[0]] == mg["config"][flag[0]] == flag[1]
        assert ser["config"]["seed"] == mg["config"]["seed"] == 0
        sa, ma = ser["final"]["test_acc"] * 100, mg["final"]["test_acc"] * 100
        assert f"**{model}**: test accuracy serial {sa:.2f}% (one seed), MGRIT {ma:.2f}%" \
            in summary
    t = quick[0] / "records" / "tied_resnet"
    assert (t / "summary.md").is_file()


def test_help_flags():
    for script in ("reproductions/reproduce_guenther.py", "reproductions/reproduce_layerwise.py",
                   "records/compare_mainjob.py"):
        p = subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--help"],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0 and "--full" in p.stdout and "--smoke" in p.stdout
        assert "--report-only" in p.stdout


def test_mainjob_report_only_without_runs_is_an_error(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "records" / "compare_mainjob.py"),
                        "--report-only", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert "--report-only needs both runs; missing" in last and "resnet-serial" in last \
        and "resnet-mgrit" in last, last
    assert not (tmp_path / "mnist_mgrit_vs_serial").exists()
