"""Language-model pieces of the training loop: the next-token loss and token accuracy in the
per-sample form the :class:`~mgrit.training.Trainer` expects, greedy sampling, and the
:class:`LanguageModelReport` callback (validation loss and bits per character per epoch, a
greedy sample at the end).

Per-sample convention: the loop sums ``loss(out, y, reduction="sum")`` and ``metric(out, y)``
over the samples of an evaluation and divides by the number of samples. Here a sample is one
sequence of ``T`` tokens and its loss / score is its *mean over tokens*; all sequences have the
same length, so the loop's averages are exactly the per-token mean cross-entropy and the
token accuracy.

Depends on torch, :mod:`mgrit.nn` and :mod:`mgrit.training`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..nn import LayerParallelNet
from ..training.support.nets import SerialNet
from ..training.records import EpochRecord, FitResult

__all__ = ["lm_loss", "token_accuracy", "bits_per_char", "greedy_sample", "serial_module",
           "LanguageModelReport"]


def lm_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of ``logits`` ``(batch, T, vocab)`` against ``int64`` targets
    ``(batch, T)``. ``"mean"``: over all tokens (= ``F.cross_entropy`` of the flattened
    tensors); ``"sum"``: the sum over sequences of each sequence's mean over its tokens (see the
    module doc); ``"none"``: per sequence ``(batch,)``.

    Raises:
        ValueError: shapes that do not fit, an unknown ``reduction``.
    """
    if logits.dim() != 3 or target.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(target.shape)} do not "
                         f"fit: use logits (batch, T, vocab) and targets (batch, T)")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not allowed: use 'mean', 'sum' or 'none'")
    V = logits.shape[-1]
    if reduction == "mean":
        return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
    per_seq = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1),
                              reduction="none").view(target.shape).mean(1)
    return per_seq.sum() if reduction == "sum" else per_seq


def token_accuracy(logits: torch.Tensor, target: torch.Tensor) -> float:
    """Sum over sequences of each sequence's share of tokens whose argmax is the target (the
    loop divides by the number of sequences: the token accuracy)."""
    return (logits.argmax(-1) == target).to(torch.float64).mean(1).sum().item()


def bits_per_char(loss: float | None) -> float | None:
    """``loss / ln 2``: a mean cross-entropy in nats per character as bits per character."""
    return None if loss is None else loss / math.log(2)


def serial_module(net: nn.Module) -> nn.Module:
    """The serial network of the trainer's ``net``: ``net.to_serial()`` for a
    :class:`~mgrit.nn.LayerParallelNet` (collective over its layer communicator: call on every
    rank), the wrapped module of a :class:`~mgrit.training.support.nets.SerialNet`, else ``net``."""
    if isinstance(net, LayerParallelNet):
        return net.to_serial()
    return net.module if isinstance(net, SerialNet) else net


@torch.no_grad()
def greedy_sample(model: nn.Module, prompt: torch.Tensor, length: int, context: int) -> list:
    """``length`` token ids continuing ``prompt`` (``int64`` ``(T0,)``, ``T0 >= 1``), each the
    argmax of ``model``'s logits ``(1, T, vocab)`` at the last position, given at most the last
    ``context`` tokens. ``model`` runs in eval mode (restored afterwards)."""
    if prompt.dim() != 1 or len(prompt) < 1:
        raise ValueError(f"prompt of shape {tuple(prompt.shape)} is not allowed: use (T0,), "
                         f"T0 >= 1")
    was = model.training
    model.eval()
    ids = prompt.to(torch.long).tolist()
    out = []
    for _ in range(length):
        x = torch.tensor([ids[-context:]], dtype=torch.long)
        nxt = int(model(x)[0, -1].argmax())
        ids.append(nxt)
        out.append(nxt)
    model.train(was)
    return out


def _validation(history: dict) -> tuple[list, list] | None:
    """``(val_loss, val_acc)`` of ``history`` when it holds one entry per epoch (a
    :class:`~mgrit.training.heldout.Validation` callback ran before this one), else None."""
    v = history.get("val_loss")
    if not v or len(v) != len(history["epoch"]):
        return None
    return list(v), list(history.get("val_acc", [float("nan")] * len(v)))


class LanguageModelReport:
    """Callback: per epoch (root rank) the validation loss and bits per character (``bpc =
    loss / ln 2``), the test loss and bpc and the training bpc; at the end a greedy sample of
    ``sample_length`` characters after ``prompt`` from the trained weights, evaluated *serially*
    (the layer-parallel network is gathered with ``to_serial()``, collective over the layer
    communicator; rank 0 generates), printed and written with the per-epoch numbers to
    ``run/lm.json`` and into ``extra["lm"]`` (pass a :class:`MetricsWriter`'s ``extra``, and put
    this callback before it, to have them in ``summary.json``).

    The validation numbers (``val_*`` keys) are those of a
    :class:`~mgrit.training.heldout.Validation` callback placed before this one (``--val-fraction``);
    without one there are none, and only the test split's numbers (``test_*`` keys) are reported,
    labelled as test numbers.

    Args:
        vocab: the characters (``vocab[i]`` decodes id ``i``).
        prompt: ``int64`` ids ``(T0,)`` to continue (e.g. the start of the held-out text).
        context: the model's positions (longest input).
        run: run directory for ``lm.json`` (None: not written). extra: dict to update.
        sample_length: characters to generate (default 200).
        print_fn: output function (default ``print(..., flush=True)``).
    """

    def __init__(self, vocab: list, prompt: torch.Tensor, context: int, run=None,
                 extra: dict | None = None, sample_length: int = 200, print_fn=None):
        self.vocab, self.prompt, self.context = list(vocab), prompt, int(context)
        self.run = None if run is None else Path(run)
        self.extra = extra
        self.sample_length = int(sample_length)
        self.print_fn = print_fn or (lambda s: print(s, flush=True))

    def _decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def on_epoch_end(self, trainer, r: EpochRecord) -> None:
        if not trainer.is_root:
            return
        val = _validation(trainer.history)
        parts = []
        if val is not None:
            parts.append(f"validation loss {val[0][-1]:.4f} = {bits_per_char(val[0][-1]):.4f} bpc, "
                         f"token accuracy {val[1][-1]:.4f}")
        if r.test_loss is not None:
            parts.append(f"test loss {r.test_loss:.4f} = {bits_per_char(r.test_loss):.4f} bpc, "
                         f"token accuracy {r.test_acc:.4f}")
        if parts:
            self.print_fn(f"[lm] epoch {r.epoch}: {'; '.join(parts)} (train "
                          f"{bits_per_char(r.loss):.4f} bpc)")

    def on_fit_end(self, trainer, result: FitResult) -> None:
        model = serial_module(trainer.net)  # every rank (collective for layer-parallel nets)
        if not trainer.is_root:
            return
        ids = greedy_sample(model, self.prompt, self.sample_length, self.context)
        h = result.history
        report = {"epochs": h["epoch"], "train_bpc": [bits_per_char(v) for v in h["loss"]]}
        val = _validation(h)
        series = [("val", *val)] if val is not None else []
        if any(v is not None for v in h["test_loss"]):
            series.append(("test", h["test_loss"], h["test_acc"]))
        for name, loss, acc in series:
            report.update({f"{name}_loss": loss, f"{name}_bpc": [bits_per_char(v) for v in loss],
                           f"{name}_token_accuracy": acc, f"final_{name}_loss": loss[-1],
                           f"final_{name}_bpc": bits_per_char(loss[-1])})
        report.update({"sample_prompt": self._decode(self.prompt), "sample": self._decode(ids),
                       "sample_note": "greedy, from the trained weights evaluated serially "
                                      "(to_serial())"})
        blank = sum(c.isspace() for c in report["sample"]) / max(1, len(report["sample"]))
        report["sample_whitespace_fraction"] = blank
        self.print_fn(f"[lm] greedy sample after {report['sample_prompt']!r}:\n"
                      f"{report['sample']}")
        if blank > 0.8:  # e.g. the quick default after 2 epochs: "e" and 199 spaces
            self.print_fn(f"[lm] the sample is {blank:.0%} whitespace: greedy decoding of a "
                          f"weakly trained character model repeats its most likely character; "
                          f"train longer (--epochs) for text")
        if self.extra is not None:
            self.extra["lm"] = report
        if self.run is not None:
            (self.run / "lm.json").write_text(json.dumps(report, indent=2))
