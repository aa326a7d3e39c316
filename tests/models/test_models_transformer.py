"""The main job's staged ResNet, ViT and character-level GPT (``--model staged-resnet|vit|gpt``),
the text corpus (``data.text``) and the language-model loss, metric and sampling
(``mgrit.models.lm``).

One process: corpus and split against the text itself; ``lm_loss`` / ``token_accuracy`` against
``F.cross_entropy`` over all tokens, also through ``Trainer.evaluate``; greedy sampling against
step-by-step argmax; flag checks. Two ranks (one MPI job, ``tests/mpi_cases/training/
transformer_model_cases.py``): exact-mode equality of each model's layer-parallel network with
its serial form (float64, 1e-10), tiny end-to-end jobs, resume and ``--dp``, bad input.
"""
from __future__ import annotations

import ast
import importlib
import json
import math
import sys

import numpy as np
import pytest
import torch
from mpi4py import MPI
from pydoc_data.topics import topics
from torch import nn
from torch.nn import functional as F

from data.text import TEXT_CORPORA, corpus_text, decode, load_text, split_text, vocabulary
from mgrit.training import Trainer
from layerpar.jobconfig import JobConfig
from mgrit.models.lm import bits_per_char, greedy_sample, lm_loss, token_accuracy
from mgrit.models import MODELS, build_model, mgrit_options
from mgrit.models.transformer_parts import PatchEmbedding, TokenEmbedding
from tests.mpi_harness import MPIBatch
from tests.experiments.regenerate_quick import MPIEXEC, ROOT

C = "tests.mpi_cases.training.transformer_model_cases"
BATCH = MPIBatch(timeout=500)
for _name in ("staged-resnet", "vit", "gpt"):
    BATCH.add(2, f"exact-{_name}", f"{C}:check_builder_exact", model=_name)
for _name in ("staged-resnet", "vit", "gpt"):
    BATCH.add(2, f"job-{_name}", f"{C}:check_job", model=_name)
BATCH.add(2, "gpt-resume-dp", f"{C}:check_gpt_resume_and_dp")
BATCH.add(2, "bad-input", f"{C}:check_bad_input")


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_models_mpi(k, name):
    results = BATCH.run(k, name)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    value = ast.literal_eval(results[0])
    if name.startswith("exact"):
        worst, n_params = value
        assert worst <= 1e-10 and n_params > 0
        print(f"{name}: worst rel err {worst:.2e} over {n_params} parameters")


# -- corpus ---------------------------------------------------------------------------------
def test_corpus_is_the_python_documentation_shipped_with_cpython():
    text, info = corpus_text("pydoc-topics")
    assert text == "\n\n".join(topics[k] for k in sorted(topics))
    assert "The \"assert\" statement" in text and info.chars == len(text) > 100_000
    assert "PSF" in info.licence and len(info.sha256) == 64
    assert TEXT_CORPORA == ("pydoc-topics",)
    with pytest.raises(ValueError, match="unknown: use one of"):
        corpus_text("shakespeare")


def test_windows_are_the_text_and_the_split_is_contiguous_and_seeded():
    text, _ = corpus_text("pydoc-topics")
    n = len(text)
    vocab = vocabulary(text)
    train, test = load_text("pydoc-topics", context=32, seed=4, test_fraction=0.1)
    assert train.num_classes == len(vocab) == len(set(text)) and train.class_names == vocab
    assert train.x.dtype == np.int64 and train.x.shape[1] == 32 and train.y.shape == train.x.shape
    a, b = split_text(len(text), 0.1, 4)
    assert b - a == round(0.1 * len(text))
    val = text[a:b]
    assert len(test) == (len(val) - 1) // 32
    for i in (0, len(test) - 1):  # windows of stride 32, target = next character
        assert decode(test.x[i], vocab) == val[32 * i:32 * i + 32]
        assert decode(test.y[i], vocab) == val[32 * i + 1:32 * i + 33]
    # training windows: from the text before the validation span, then from the text after it
    before = (a - 1) // 32 if a > 32 else 0
    after = (n - b - 1) // 32 if n - b > 32 else 0
    assert len(train) == before + after
    assert decode(train.x[0], vocab) == (text[:32] if before else text[b:b + 32])
    assert decode(train.x[before], vocab) == text[b:b + 32]
    assert decode(train.y[-1], vocab) == text[b + 32 * (after - 1) + 1:b + 32 * after + 1]
    assert split_text(len(text), 0.1, 4) == (a, b) and split_text(len(text), 0.1, 5) != (a, b)
    with pytest.raises(ValueError, match="context=0"):
        load_text(context=0)
    with pytest.raises(ValueError, match="holds no window"):
        load_text(context=200_000, test_fraction=0.1)


# -- loss, metric, sampling -----------------------------------------------------------------
def test_lm_loss_and_token_accuracy_are_per_token_means():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 11, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (5, 7), generator=g)
    ref = F.cross_entropy(logits.reshape(-1, 11), y.reshape(-1))
    assert torch.allclose(lm_loss(logits, y), ref, rtol=1e-14, atol=0)
    assert abs(lm_loss(logits, y, reduction="sum").item() / 5 - ref.item()) <= 1e-14
    acc = (logits.argmax(-1) == y).double().mean().item()
    assert abs(token_accuracy(logits, y) / 5 - acc) <= 1e-14
    assert bits_per_char(math.log(2) * 3) == pytest.approx(3.0, rel=1e-15)
    with pytest.raises(ValueError, match="do not fit"):
        lm_loss(logits, y[:, :3])


def test_trainer_evaluates_a_language_model_per_token():
    """Trainer.evaluate with lm_loss and token_accuracy on 13 sequences in batches of 5 equals
    the mean over all tokens computed directly."""
    torch.manual_seed(0)
    model = nn.Sequential(TokenEmbedding(9, 6, 8), nn.Linear(8, 9)).double()
    x = torch.randint(0, 9, (13, 6))
    y = torch.randint(0, 9, (13, 6))
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=lm_loss,
                 metric=token_accuracy, eval_batch_size=5)
    acc, loss = tr.evaluate((x, y))
    with torch.no_grad():
        out = model(x)
    assert abs(loss - F.cross_entropy(out.reshape(-1, 9), y.reshape(-1)).item()) <= 1e-13
    assert abs(acc - (out.argmax(-1) == y).double().mean().item()) <= 1e-13
    with pytest.raises(TypeError, match="metric must be callable"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), metric=3)


def test_greedy_sample_is_stepwise_argmax_within_the_context():
    torch.manual_seed(1)
    model = nn.Sequential(TokenEmbedding(7, 4, 8), nn.Flatten(0, 1), nn.Linear(8, 7),
                          nn.Unflatten(0, (1, -1))).double()
    prompt = torch.tensor([1, 2, 3, 4, 5, 6])
    out = greedy_sample(model, prompt, 5, context=4)
    ids = prompt.tolist()
    for t in range(5):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids[-4:]]))[0, -1].argmax()))
        assert out[t] == ids[-1]


# -- flags and builders ---------------------------------------------------------------------
def test_models_are_registered():
    assert {"resnet", "staged-resnet", "vit", "gpt"} <= set(MODELS)


@pytest.mark.parametrize("kw,message", [
    (dict(model="vit", d_model=30, heads=4), "--d-model=30 is not divisible by --heads=4"),
    (dict(model="gpt"), "--model gpt is a language model: use a text corpus"),
    (dict(dataset="pydoc-topics"), "is a text corpus: use a language model"),
    (dict(model="staged-resnet"), "use --step conv or twoconv"),
    (dict(model="gpt", dataset="pydoc-topics", buffer_layers=-1), "--buffer-layers=-1"),
    (dict(model="vit", patch=0), "--patch=0"),
    (dict(model="vit", method="decoupled"), "--method decoupled has no --model vit"),
    (dict(nested_iteration=True, warm_start=True), "cannot be combined with --warm-start"),
])
def test_bad_flags_are_named(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        JobConfig(**kw).validated(1)


def test_nested_iteration_reaches_both_solves_and_turns_the_warm_start_off():
    c = JobConfig(model="vit", nested_iteration=True).validated(2)
    assert c.warm_start is False
    fwd, bwd = mgrit_options(c)
    assert fwd.nested_iteration and bwd.nested_iteration and fwd.max_iter == 2
    net = build_model("vit", JobConfig(model="vit", d_model=8, heads=2, layers=4, patch=4,
                                       nested_iteration=True).validated(1),
                      (1, 8, 8), 10, comm=MPI.COMM_SELF)
    assert net.segments[0].warm_start is False and net.segments[0].fwd_opts.nested_iteration
    assert not mgrit_options(JobConfig().validated(1))[0].nested_iteration


def test_builders_refuse_data_that_does_not_fit():
    c = JobConfig(model="vit", patch=5).validated(1)
    with pytest.raises(ValueError, match=r"--patch=5 does not divide the 28x28 images"):
        build_model("vit", c, (1, 28, 28), 10)
    with pytest.raises(ValueError, match="needs image data"):
        build_model("vit", c, (784,), 10)
    g = JobConfig(model="gpt", dataset="pydoc-topics", context=8).validated(1)
    with pytest.raises(ValueError, match="more than the model's --context=8"):
        build_model("gpt", g, (9,), 20)
    with pytest.raises(ValueError, match="no layer-wise form"):
        build_model("gpt", g, (8,), 20, form="layers")
    emb = TokenEmbedding(5, 4, 2)
    with pytest.raises(ValueError, match="9 tokens is longer than the model's 4 positions"):
        emb(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="patch=3 does not divide the image size 8x8"):
        PatchEmbedding((1, 8, 8), 3, 4)


def test_staged_resnet_shapes_and_serial_keys():
    """Three segments (4 -> 8 -> 16 channels, 28 -> 14 -> 7 pixels); the serial form's keys are
    the layer-parallel network's global keys (checkpoints load into each other)."""
    c = JobConfig(model="staged-resnet", step="conv", layers=2, channels=4).validated(1)
    ser = build_model("staged-resnet", c, (1, 28, 28), 10)
    shapes, h = [], torch.zeros(2, 1, 28, 28)
    for m in ser:
        h = m(h)
        shapes.append(tuple(h.shape[1:]))
    assert shapes[1] == (4, 28, 28) and shapes[4] == (8, 14, 14) and shapes[7] == (16, 7, 7)
    assert shapes[-1] == (10,)
    net = build_model("staged-resnet", c, (1, 28, 28), 10, comm=MPI.COMM_SELF)
    assert len(net.segments) == 3
    assert list(net.gather_state_dict()) == list(ser.state_dict())


@pytest.mark.slow
def test_records_gpt_job_and_exact_evaluation(tmp_path):
    """transformer_records.py's GPT layer-parallel run at the smoke size with the 3/2 cycles
    (one job, ``transformer_records.run``): the 2-rank job runs, its final checkpoint is
    evaluated with the exact (serial) forward on the text corpus and then deleted, and the
    job's load average is kept. The exact evaluation's loss is checked against the run's own
    test loss: 3 forward cycles on 4 layers (2 levels, coarsening factor 2) are converged
    (residual ~1e-7), so the two agree to 1e-4. (The record's choice, intervals and report:
    tests/experiments/test_record_seeds.py and test_experiments_b.py.)"""
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    tr = importlib.import_module("experiments.records.transformer_records")
    method = tr.tag("3/2")
    tr.run("gpt", "ode", 0, method, tmp_path, smoke=True)
    run = tr.run_dir(tmp_path, "gpt", "ode", 0, method)
    exact = json.loads((run / "exact_eval.json").read_text())
    final = json.loads((run / "summary.json").read_text())["final"]
    assert not (run / "checkpoint.pt").exists()
    assert math.isfinite(exact["test_loss"])
    assert exact["test_loss"] == pytest.approx(final["test_loss"], rel=1e-4)
    load = json.loads((run / "load.json").read_text())
    assert len(load["before"]) == 3 and load["cores"] >= 1


def test_lm_report_says_when_the_greedy_sample_is_whitespace(tmp_path):
    """A model whose argmax is always ' ' (as the quick GPT after 2 epochs): the sample is
    reported as it is, with its whitespace fraction and a note; a model that writes text gets
    no note."""
    import types

    from torch import nn

    from mgrit.models.lm import LanguageModelReport

    class Fixed(nn.Module):
        def __init__(self, ids):
            super().__init__()
            self.ids = ids

        def forward(self, x):  # logits (1, T, 3): the next id cycles through self.ids
            out = torch.zeros(1, x.shape[1], 3)
            out[0, -1, self.ids[x.shape[1] % len(self.ids)]] = 1.0
            return out

    vocab = [" ", "a", "b"]
    hist = {"epoch": [1], "loss": [2.0], "test_loss": [2.0], "test_acc": [0.3]}
    for ids, noted in (([0], True), ([1, 2, 0], False)):
        said = []
        rep = LanguageModelReport(vocab, torch.tensor([1, 2]), context=4, run=tmp_path,
                                  sample_length=20, print_fn=said.append)
        trainer = types.SimpleNamespace(net=Fixed(ids), is_root=True)
        rep.on_fit_end(trainer, types.SimpleNamespace(history=hist))
        lm = json.loads((tmp_path / "lm.json").read_text())
        assert lm["sample_whitespace_fraction"] == pytest.approx(
            lm["sample"].count(" ") / 20)
        assert noted == any("whitespace" in s for s in said), said
