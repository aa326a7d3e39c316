"""Evaluation of a layer-wise trained network: the combined network (all stage bodies, then
the last head) and, optionally, the ensemble of all stage heads (classification: mean of their
softmax probabilities, as in Belilovsky et al. 2020 Sec. 4 / Nøkland & Eidnes 2019 "prediction
from intermediate heads"; regression: mean of their outputs).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .common import check_loss, mse_loss

__all__ = ["stage_logits", "evaluate", "ensemble_probs", "accuracy"]


def stage_logits(bodies: Sequence[nn.Module], heads: Sequence[nn.Module | None],
                 x: torch.Tensor, batch_size: int = 1024) -> list[torch.Tensor | None]:
    """Logits ``(n, C)`` of every stage head on inputs ``x`` of shape ``(n, *in_shape)``.

    ``bodies[k]`` maps stage ``k``'s input to its output; ``heads[k]`` (or ``None`` to skip) maps
    that output to logits. Runs under ``no_grad`` in eval mode (modes are restored after).
    """
    mods = [m for m in (*bodies, *heads) if m is not None]
    modes = [m.training for m in mods]
    for m in mods:
        m.eval()
    out: list[list[torch.Tensor]] = [[] for _ in bodies]
    try:
        with torch.no_grad():
            for i in range(0, len(x), batch_size):
                h = x[i:i + batch_size]
                for k, (body, head) in enumerate(zip(bodies, heads)):
                    h = body(h)
                    if head is not None:
                        out[k].append(head(h))
    finally:
        for m, t in zip(mods, modes):
            m.train(t)
    return [torch.cat(o) if o else None for o in out]


def ensemble_probs(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean of ``softmax(logits_k)`` over the given heads, shape ``(n, C)``."""
    return torch.stack([F.softmax(l, dim=1) for l in logits]).mean(0)


def accuracy(scores: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of rows of ``scores`` whose argmax equals ``y`` (int64, shape ``(n,)``)."""
    return float((scores.argmax(1) == y).double().mean()) if len(y) else float("nan")


def evaluate(bodies: Sequence[nn.Module], heads: Sequence[nn.Module | None], x: torch.Tensor,
             y: torch.Tensor, *, batch_size: int = 1024, ensemble: bool = False,
             loss: str = "cross_entropy") -> dict:
    """Evaluate the combined network ``heads[-1](bodies[-1](...bodies[0](x)))``.

    Args:
        bodies, heads: as in :func:`stage_logits`; ``heads[-1]`` is the output head and must
            not be ``None``.
        x: inputs ``(n, *in_shape)`` (dtype of the model); y: int64 labels ``(n,)``
            (cross-entropy) or float targets ``(n, D)`` (MSE).
        ensemble: also evaluate the ensemble of all non-``None`` heads: ``ensemble_acc``
            (argmax of the mean softmax; None for MSE) and, for MSE, ``ensemble_loss`` (MSE
            of the mean of the heads' outputs).
        loss: ``"cross_entropy"`` (default) or ``"mse"``.

    Returns:
        ``{"loss": the output head's loss (cross-entropy, or MSE over samples and outputs),
        "acc": its accuracy (None for MSE), "stage_loss" / "stage_acc": of each head (None for
        a missing head; accuracies None for MSE), "ensemble_acc" (and for MSE
        "ensemble_loss"): only if ensemble}``.
    """
    if heads[-1] is None:
        raise ValueError("the last stage needs an output head to evaluate the combined network")
    mse = check_loss(loss) == "mse"
    fn = mse_loss if mse else F.cross_entropy
    acc = (lambda out: None) if mse else (lambda out: accuracy(out, y))
    logits = stage_logits(bodies, heads, x, batch_size)
    res = {"loss": float(fn(logits[-1], y)), "acc": acc(logits[-1]),
           "stage_loss": [None if l is None else float(fn(l, y)) for l in logits],
           "stage_acc": [None if l is None else acc(l) for l in logits]}
    if ensemble:
        outs = [l for l in logits if l is not None]
        if mse:
            res["ensemble_acc"] = None
            res["ensemble_loss"] = float(mse_loss(torch.stack(outs).mean(0), y))
        else:
            res["ensemble_acc"] = accuracy(ensemble_probs(outs), y)
    return res
