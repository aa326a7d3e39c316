"""Settings the main job used to accept silently (issue 40 items 8 and 10): conflicting flags
are refused naming both, an oversubscribed node is warned about, a batch larger than the data
is said, and a network that cannot fit the node's memory is refused before it is built, with
the estimate and the available memory."""
from __future__ import annotations

import dataclasses
import io
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from mpi4py import MPI

from layerpar.jobconfig import JobConfig
from layerpar.resources import (BYTES_PER_LAYER, available_memory, memory_verdict, model_bytes,
                                oversubscription, preflight)
from tests.job.test_train_job import ROOT, SCRIPT, _load_script, job_env


@pytest.mark.parametrize("args, message", [
    (["--serial", "--method", "mgrit"], "--serial is short for --method serial: it conflicts "
                                        "with --method mgrit"),
    (["--serial", "--method", "decoupled"], "conflicts with --method decoupled"),
    (["--stages", "3"], "--stages=3 sets the stages of --method decoupled: it has no effect "
                        "with --method mgrit"),
    (["--serial", "--stages", "2"], "no effect with --method serial"),
    (["--out", ""], "--out='' names no folder"),
])
def test_conflicting_flags_are_refused(args, message, capsys):
    parser = _load_script().build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_config(args, 2)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_serial_shortcut_and_the_method_default():
    parser = _load_script().build_parser()
    assert parser.parse_config([], 1).method == "mgrit"
    assert parser.parse_config(["--serial"], 1).method == "serial"
    assert parser.parse_config(["--serial", "--method", "serial"], 1).method == "serial"
    assert parser.parse_config(["--method", "decoupled", "--stages", "2"], 2).stages == 2
    assert "training method (default: mgrit)" in " ".join(parser.format_help().split())


def test_oversubscription_warning():
    assert oversubscription(1, 2, ncores=2) is None and oversubscription(2, 1, ncores=2) is None
    msg = oversubscription(64, 1, ncores=2)
    assert msg == ("warning: 64 torch threads x 1 rank(s) on this node = 64 threads for 2 "
                   "cores: the threads wait for each other (many times slower); use --threads 2")
    assert "use --threads 1" in oversubscription(2, 2, ncores=2)


def _cfg(**kw):
    return JobConfig(**{"dataset": "digits", **kw}).validated(1)


def test_memory_estimate_is_the_built_networks_parameters():
    """The estimate's bytes per layer and for the rest, times the depth, equal the parameters
    of the network built at that depth (an independent count), times the training copies."""
    for kw, copies in (({"width": 8}, 3), ({"width": 8, "optimizer": "adam"}, 4),
                       ({"width": 8, "momentum": 0.0}, 2),
                       ({"model": "resnet", "step": "conv", "channels": 3}, 3)):
        c = _cfg(**kw)
        per_layer, rest = model_bytes(c, (1, 8, 8), 10)
        net = __import__("mgrit.models", fromlist=["build_model"]).build_model(
            c.model, dataclasses.replace(c, layers=7), (1, 8, 8), 10)
        n = sum(p.numel() for p in net.parameters())
        assert 7 * (per_layer - BYTES_PER_LAYER) + rest == n * 4 * copies, kw
    assert model_bytes(_cfg(model="gru", dataset="adding"), (1024, 2), 1) is None


def test_a_network_that_cannot_fit_is_refused_with_both_numbers():
    c = _cfg(layers=10_000_000)
    per_layer, rest = model_bytes(c, (1, 8, 8), 10)
    gib = float(1 << 30)
    msg = memory_verdict(c, (1, 8, 8), 10, layer_ranks=2, ranks_here=2,
                         available=(8 << 30, "MemAvailable in /proc/meminfo", None))
    need = 2 * (per_layer * 5_000_000 + rest)
    assert msg.startswith(f"--layers 10000000 --model resnet: training needs at least "
                          f"{need / gib:.1f} GiB on this node (2 rank(s) x "
                          f"{need / 2 / gib:.1f} GiB: 5000000 layers of")
    assert msg.endswith("but 8.0 GiB are available (MemAvailable in /proc/meminfo): use fewer "
                        "--layers or a smaller network, or more layer ranks / nodes")
    assert need > 100 * gib  # 1,056 parameters per layer: 12 KiB in training, + objects
    msg = memory_verdict(c, (1, 8, 8), 10, 1, 1, available=(None, "", 2 << 30))
    assert "the address-space limit (ulimit -v) leaves each process 2.0 GiB" in msg
    assert memory_verdict(_cfg(), (1, 8, 8), 10, 1, 1,
                          available=(1 << 30, "x", None)) is None  # the default fits in 1 GiB
    node, where, _ = available_memory()
    assert node is None or (node > 0 and where)


def test_a_huge_width_is_estimated_without_allocating_it():
    """The newcomer's ``--width 100000000``: the estimate builds on the meta device (no memory),
    so the refusal names the numbers instead of the allocator failing in the real build."""
    per_layer, rest = model_bytes(_cfg(width=100_000_000, layers=4), (1, 8, 8), 10)
    assert per_layer > (10 ** 16) * 4  # a width x width weight per layer, in training
    msg = memory_verdict(_cfg(width=100_000_000, layers=4), (1, 8, 8), 10, 1, 1,
                         available=(8 << 30, "MemAvailable in /proc/meminfo", None))
    assert msg is not None and "but 8.0 GiB are available" in msg


def test_preflight_notes_and_refusal():
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        preflight(_cfg(batch_size=100000), MPI.COMM_SELF, 1, (1, 8, 8), 10, 1437)
    assert ("note: --batch-size 100000 exceeds the 1437 training samples: every epoch is one "
            "full batch of 1437") in out.getvalue()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(512)
        with redirect_stdout(out), redirect_stderr(err):
            preflight(_cfg(), MPI.COMM_SELF, 1, (1, 8, 8), 10, 1437)
    finally:
        torch.set_num_threads(threads)
    assert re.search(r"warning: 512 torch threads x 1 rank\(s\) on this node", err.getvalue())
    with pytest.raises(MemoryError, match=r"training needs at least .* GiB are available"):
        preflight(_cfg(layers=10 ** 9), MPI.COMM_SELF, 1, (1, 8, 8), 10, 1437)


@pytest.mark.slow
def test_huge_depth_fails_before_building(tmp_path):
    """--layers 10000000 (it used to build for minutes and die in an MPICH assertion): one
    line with the estimate and the available memory, status 1, before any layer is built."""
    r = subprocess.run([sys.executable, "-m", "mpi4py", str(SCRIPT), "--dataset", "digits",
                        "--layers", "10000000", "--no-progress", "--out", str(tmp_path / "r")],
                       cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert re.search(r"rank 0 failed in phase model setup: MemoryError: --layers 10000000 "
                     r"--model resnet: training needs at least \d+\.\d GiB on this node .* "
                     r"\d+\.\d GiB are available", r.stderr), r.stderr[-2000:]


def test_model_defaults_and_help(capsys):
    """Issue 40 item 13: --model gpt defaults to its text corpus and the quick setting, vit and
    gpt to nested iteration (not with an explicit --warm-start), flags given win; --help shows
    the optimizer's default and the per-model defaults."""
    from layerpar.flags import MODEL_DEFAULTS

    parser = _load_script().build_parser()
    c = parser.parse_config(["--model", "gpt"], 2)
    assert c.dataset == "pydoc-topics" and c.nested_iteration and c.warm_start is False
    assert {k: getattr(c, k) for k in MODEL_DEFAULTS["gpt"]} == MODEL_DEFAULTS["gpt"]
    c = parser.parse_config(["--model", "gpt", "--layers", "4", "--lr", "0.01"], 2)
    assert (c.layers, c.lr, c.context) == (4, 0.01, 32)
    assert parser.parse_config(["--model", "vit"], 2).nested_iteration
    c = parser.parse_config(["--model", "vit", "--warm-start"], 2)
    assert not c.nested_iteration and c.warm_start
    c = parser.parse_config([], 2)
    assert (c.dataset, c.layers, c.optimizer, c.nested_iteration) == ("mnist5k", 32, "sgd", False)
    helptext = " ".join(parser.format_help().split())
    assert "it equals Adam) (default: sgd)" in helptext
    assert "per-model defaults (flags given win): --model gpt: --dataset pydoc-topics" in helptext
    with pytest.raises(SystemExit):
        parser.parse_config(["--model", "gpt", "--dataset", "mnist5k"], 1)
    err = capsys.readouterr().err
    assert "experiments/train.py: error: --model gpt is a language model" in err


def test_sequential_console_names_the_layer_in_training():
    from layerwise import build_method
    from mgrit.training.callbacks import ConsoleLog
    from mgrit.training.records import EpochRecord

    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    m = build_method("sequential", layers, 2, (4,), epochs=2)
    assert m.plan == [0, 0, 1, 1, 2, 2, "head", "head"]
    lines = []
    log = ConsoleLog(print_fn=lines.append)
    log._epochs = len(m.plan)
    trainer = type("T", (), {"method": m, "is_root": True})()
    for e in (1, 4, 8):
        log.on_epoch_end(trainer, EpochRecord(epoch=e, loss=1.0, train_acc=0.5, test_acc=None,
                                              test_loss=None, epoch_time=0.0, eval_time=0.0))
    assert lines[0].endswith("| trains layer 1/3 (epoch 1/2 of it)")
    assert lines[1].startswith("epoch 4/8 ") and lines[1].endswith("| trains layer 2/3 (epoch 2/2 "
                                                                   "of it)")
    assert lines[2].endswith("| trains the output head")
