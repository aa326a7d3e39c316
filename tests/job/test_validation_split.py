"""The main job's ``--val-fraction`` (issue 24 item 2: choices made on held-out training data):

* bad values fail with one clear line naming the value (the flag, and a split too small for
  the training set);
* :func:`layerpar.job.hold_out` on the real MNIST subset and the text corpus: validation,
  training and test samples are disjoint, and training + validation are the training split in
  order;
* the :class:`~mgrit.training.heldout.Validation` callback's per-epoch numbers equal a plain
  PyTorch evaluation of the network on the held-out samples (independent reference), and a
  resumed fit keeps the series of the epochs before the resume.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerpar.job import hold_out
from mgrit.training import Trainer
from mgrit.training.heldout import Validation
from tests.job.test_train_job import _load_script


@pytest.mark.parametrize("value", ["-0.1", "1", "1.5", "nan"])
def test_bad_val_fraction_fails_naming_the_value(value, capsys):
    parser = _load_script().build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_config(["--val-fraction", value], 1)
    assert e.value.code == 2
    assert f"--val-fraction={float(value)} is not allowed: use a number in [0, 1)" in \
        capsys.readouterr().err


def test_hold_out_refuses_empty_splits():
    x, y = torch.zeros(10, 3), torch.arange(10)
    with pytest.raises(ValueError, match=r"--val-fraction=0\.01 of 10 training samples leaves 0 "
                       r"for validation.*use a larger --val-fraction"):
        hold_out((x, y), 0.01)
    # no sample left for training: the advice is the other way round
    with pytest.raises(ValueError, match=r"--val-fraction=0\.9 of 1 training samples leaves 1 "
                       r"for validation and 0 for training.*use a smaller --val-fraction"):
        hold_out((x[:1], y[:1]), 0.9)
    with pytest.raises(ValueError, match=r"--val-fraction=1\.0 is not allowed"):
        hold_out((x, y), 1.0)
    assert hold_out((x, y), 0.0) == ((x, y), None)


def _rows(a) -> set:
    a = np.ascontiguousarray(np.asarray(a))
    return {r.tobytes() for r in a.reshape(len(a), -1)}


@pytest.mark.parametrize("dataset", ["mnist5k", "pydoc-topics"])
def test_validation_never_overlaps_train_or_test(dataset):
    from layerpar.job import _load
    from layerpar.jobconfig import JobConfig
    model = "gpt" if dataset == "pydoc-topics" else "resnet"
    c = JobConfig(dataset=dataset, model=model, val_fraction=0.2).validated(1)
    (xtr, ytr), (xte, yte), _ = _load(c, torch.float32)
    (xt, yt), (xv, yv) = hold_out((xtr, ytr), c.val_fraction)
    n = len(ytr)
    assert len(yv) == round(0.2 * n) and len(yt) + len(yv) == n
    assert torch.equal(torch.cat([xt, xv]), xtr) and torch.equal(torch.cat([yt, yv]), ytr)
    val, train, test = _rows(xv), _rows(xt), _rows(xte)
    assert len(val) > 0.99 * len(yv)  # (a few identical windows of text may repeat)
    assert not val & test  # the test split of the loader is disjoint from the training split
    # no validation input is also a training input (text: only windows repeated verbatim)
    assert len(val & train) <= 0.01 * len(yv)
    if dataset == "mnist5k":  # the images: none shared; every class held out
        assert not val & train and len(set(yv.tolist())) == 10


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def test_validation_callback_equals_plain_evaluation_and_survives_resume(tmp_path):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(60, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (60,),
                                                                               generator=g)
    (xt, yt), (xv, yv) = hold_out((x, y), 0.25)
    net = _net()
    cb = Validation((xv, yv), print_fn=None)
    tr = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), callbacks=[cb],
                 checkpoint=tmp_path / "c.pt", checkpoint_every=0)
    hist = tr.fit((xt, yt), epochs=2, batch_size=15, seed=0).history
    with torch.no_grad():
        out = net(xv)
    want_acc = (out.argmax(1) == yv).double().mean().item()
    want_loss = F.cross_entropy(out, yv).item()
    assert len(hist["val_acc"]) == 2 == len(hist["epoch"])
    assert hist["val_acc"][-1] == pytest.approx(want_acc, abs=1e-12)
    assert hist["val_loss"][-1] == pytest.approx(want_loss, rel=1e-12)
    # resume from the checkpoint after epoch 2, two more epochs: 4 entries, the first 2 kept
    net2 = _net()
    cb2 = Validation((xv, yv), print_fn=None)
    tr2 = Trainer(net2, torch.optim.SGD(net2.parameters(), lr=0.1), callbacks=[cb2])
    hist2 = tr2.fit((xt, yt), epochs=4, batch_size=15, seed=0,
                    resume=tmp_path / "c.pt").history
    assert hist2["val_acc"][:2] == hist["val_acc"] and len(hist2["val_loss"]) == 4
    with pytest.raises(ValueError, match="no samples"):
        Validation((xv[:0], yv[:0]))


def test_default_run_folder_is_runs_at_the_top_of_the_checkout():
    """``runs/<method>-<timestamp>`` (README, ``--help``) lies in the checkout, beside
    ``setup.py``, where ``.gitignore`` ignores ``/runs/`` -- not in the folder above it."""
    from pathlib import Path

    from layerpar.job import RUNS
    root = Path(__file__).resolve().parents[2]
    assert RUNS == root / "runs"
    assert (root / "setup.py").is_file() and "/runs/" in (root / ".gitignore").read_text()


def test_language_model_report_uses_the_validation_split(tmp_path):
    """Issue 40 item 5: with a validation split, ``lm.json``'s ``val_*`` numbers and the
    console's "validation loss" are the validation split's (a plain evaluation of the network
    on it, the independent reference), the test split's are reported as ``test_*``; without
    one, no number is called validation."""
    import json
    import math

    from mgrit.models.lm import LanguageModelReport, lm_loss, token_accuracy

    V, T = 5, 6
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, V, (40, T), generator=g)
    y = torch.randint(0, V, (40, T), generator=g)
    xte, yte = torch.randint(0, V, (12, T), generator=g), torch.randint(0, V, (12, T), generator=g)
    (xt, yt), (xv, yv) = hold_out((x, y), 0.25)

    def fit(val, run):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Embedding(V, 4), nn.Linear(4, V)).double()
        lines = []
        cbs = [Validation((xv, yv), print_fn=None)] if val else []
        cbs.append(LanguageModelReport([chr(97 + i) for i in range(V)], xte[0][:3], T, run=run,
                                       sample_length=5, print_fn=lines.append))
        tr = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), loss=lm_loss,
                     metric=token_accuracy, callbacks=cbs)
        tr.fit((xt, yt), epochs=2, batch_size=10, seed=0, test=(xte, yte))
        with torch.no_grad():
            ref = {k: (lm_loss(net(a), b).item(), token_accuracy(net(a), b) / len(b))
                   for k, (a, b) in (("val", (xv, yv)), ("test", (xte, yte)))}
        return json.loads((run / "lm.json").read_text()), lines, ref

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    lm, lines, ref = fit(True, tmp_path / "a")
    assert ref["val"][0] != pytest.approx(ref["test"][0], rel=1e-3)  # the two can be told apart
    for k in ("val", "test"):
        assert lm[f"final_{k}_loss"] == pytest.approx(ref[k][0], rel=1e-12)
        assert lm[f"{k}_token_accuracy"][-1] == pytest.approx(ref[k][1], abs=1e-12)
        assert lm[f"final_{k}_bpc"] == pytest.approx(ref[k][0] / math.log(2), rel=1e-12)
    assert f"validation loss {ref['val'][0]:.4f}" in lines[1]
    assert f"test loss {ref['test'][0]:.4f}" in lines[1] and lines[1].startswith("[lm] epoch 2:")
    lm, lines, ref = fit(False, tmp_path / "b")
    assert not [k for k in lm if "val" in k] and "validation" not in lines[1]
    assert lm["final_test_loss"] == pytest.approx(ref["test"][0], rel=1e-12)
