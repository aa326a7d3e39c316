"""Evaluation of a layer-wise trained network: the combined network (all stage bodies, then
the last head) and, optionally, the ensemble of all stage heads (mean of their softmax
probabilities, as in Belilovsky et al. 2020 Sec. 4 / Nøkland & Eidnes 2019 "prediction from
intermediate heads").
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

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
             y: torch.Tensor, *, batch_size: int = 1024, ensemble: bool = False) -> dict:
    """Evaluate the combined network ``heads[-1](bodies[-1](...bodies[0](x)))``.

    Args:
        bodies, heads: as in :func:`stage_logits`; ``heads[-1]`` is the output head and must
            not be ``None``.
        x: inputs ``(n, *in_shape)`` (dtype of the model); y: int64 labels ``(n,)``.
        ensemble: also report ``ensemble_acc`` (mean softmax of all non-``None`` heads).

    Returns:
        ``{"loss": cross-entropy of the output head, "acc": its accuracy, "stage_acc": [accuracy
        of each head or None], "ensemble_acc": ... (only if ensemble)}``.
    """
    if heads[-1] is None:
        raise ValueError("the last stage needs an output head to evaluate the combined network")
    logits = stage_logits(bodies, heads, x, batch_size)
    res = {"loss": float(F.cross_entropy(logits[-1], y)), "acc": accuracy(logits[-1], y),
           "stage_acc": [None if l is None else accuracy(l, y) for l in logits]}
    if ensemble:
        res["ensemble_acc"] = accuracy(ensemble_probs([l for l in logits if l is not None]), y)
    return res
