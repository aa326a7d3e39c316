"""Shared pieces of the layer-wise trainers: argument checks, optimizers, stage splits,
feature shapes, the training losses (:data:`LOSSES`: cross-entropy on class labels, MSE on
regression targets; :func:`check_targets`, :func:`shard_loss`, :func:`eval_loss`), the seeded
global-batch schedule (same convention as
``data.GlobalBatchSampler``: permutation ``default_rng([seed, epoch])``, consecutive global
batches of ``B`` indices, replica ``r`` takes chunk ``r`` of ``np.array_split(batch, R)``,
which is empty when the batch has fewer than ``r + 1`` samples) and the replica loss
(:func:`shard_loss`).

Every sample is used for every batch size and replica count: a replica with an empty shard
runs its step on zero samples, its loss share is 0, and it still takes part in every
collective (gradient averaging, BatchNorm statistics), so ``R`` replicas reproduce the
single-process updates.

Every check here is a pure function of its arguments, so a bad configuration raises the same
``ValueError`` on every rank before any communication.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["OPTIMIZERS", "LOSSES", "check_loss", "check_targets", "eval_loss", "mse_loss",
           "correct_count", "as_targets", "no_nan", "check_int", "check_float", "make_optimizer",
           "split_stages", "output_shapes", "global_batches", "shard", "shard_loss",
           "release_gradients", "as_tensor", "module_dtype"]

#: Optimizer names accepted by :func:`make_optimizer`.
OPTIMIZERS = ("sgd", "adam")

#: Training losses of the layer-wise methods: ``"cross_entropy"`` (classification: every head
#: outputs ``C`` logits, targets are int64 class labels ``(n,)``) and ``"mse"`` (regression:
#: every head outputs ``D`` values, targets are floats ``(n, D)``; the loss is
#: ``F.mse_loss``, the mean over samples and output dimensions).
LOSSES = ("cross_entropy", "mse")


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as int; ``ValueError`` naming it unless it is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed: use an int >= {minimum}")
    return int(value)


def check_float(name: str, value, positive: bool = True) -> float:
    """``value`` as float; ``ValueError`` unless finite and > 0 (or >= 0 if not ``positive``)."""
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: use a finite number "
                         f"{'> 0' if positive else '>= 0'}")
    return float(value)


def check_loss(loss) -> str:
    """``loss`` if it is one of :data:`LOSSES`, else ``ValueError`` naming it."""
    if not isinstance(loss, str) or loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not allowed: use one of {', '.join(LOSSES)} "
                         f"(cross-entropy on int64 class labels, or MSE on float targets (n, D))")
    return loss


def check_targets(y: torch.Tensor, loss: str, num_outputs: int, what: str = "y") -> None:
    """``ValueError`` unless ``y`` are targets of ``loss`` for heads of ``num_outputs``
    outputs: int64-compatible integer labels ``(n,)`` for ``"cross_entropy"``, floats ``(n,
    num_outputs)`` for ``"mse"`` (``n >= 0``). A pure function of its arguments: the same
    error on every rank that holds the same targets."""
    if loss == "mse":
        if not y.is_floating_point() or y.dim() != 2 or y.shape[1] != num_outputs:
            raise ValueError(f"{what} of dtype {y.dtype} and shape {tuple(y.shape)} is not "
                             f"allowed with loss='mse': use float targets of shape (n, "
                             f"{num_outputs}) (num_classes={num_outputs} is the output "
                             f"dimension D)")
    elif y.is_floating_point() or y.is_complex() or y.dtype == torch.bool or y.dim() != 1:
        raise ValueError(f"{what} of dtype {y.dtype} and shape {tuple(y.shape)} is not allowed "
                         f"with loss='cross_entropy': use integer class labels of shape (n,) "
                         f"(for regression targets pass loss='mse')")


def mse_loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``F.mse_loss(out, y)`` (``"mean"``: over samples and output dimensions) or, with
    ``reduction="sum"``, the sum over the ``n`` samples of each sample's mean squared error
    (``F.mse_loss(out, y, reduction="sum") / D``), so that ``sum / n`` is the mean: the form
    the training loop's evaluation sums over chunks and replicas. ``out``, ``y``: ``(n, D)``."""
    if reduction == "sum":
        return F.mse_loss(out, y, reduction="sum") / out.shape[1]
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r} is not allowed: use 'mean' or 'sum'")
    return F.mse_loss(out, y)


def eval_loss(loss: str):
    """The per-sample loss ``fn(out, y, reduction="mean"|"sum")`` of ``loss`` for
    :class:`mgrit.training.Trainer`'s evaluation: ``F.cross_entropy`` or :func:`mse_loss`."""
    return mse_loss if check_loss(loss) == "mse" else F.cross_entropy


def correct_count(out: torch.Tensor, y: torch.Tensor, loss: str) -> int | None:
    """Correct argmax predictions among the rows of ``out`` (cross-entropy), None for
    ``"mse"`` (a regression has no accuracy)."""
    if loss == "mse":
        return None
    with torch.no_grad():
        return int((out.argmax(1) == y).sum())


def no_nan(value):
    """``value`` with NaN as None (the training loop reports a missing accuracy as NaN)."""
    return None if isinstance(value, float) and math.isnan(value) else value


def make_optimizer(name: str, params: Iterable[nn.Parameter], lr: float, momentum: float = 0.0,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``torch.optim.SGD(lr, momentum, weight_decay)`` for ``"sgd"``, ``torch.optim.Adam(lr,
    weight_decay)`` for ``"adam"`` (``momentum`` ignored). ``ValueError`` for other names or
    ``lr <= 0``, ``momentum``/``weight_decay < 0``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not allowed: use one of {', '.join(OPTIMIZERS)}")
    lr = check_float("lr", lr)
    momentum = check_float("momentum", momentum, positive=False)
    weight_decay = check_float("weight_decay", weight_decay, positive=False)
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)


def split_stages(num_layers: int, num_stages: int,
                 stage_sizes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` layer ranges of ``num_stages`` stages.

    Default: as even as possible (``np.array_split``; earlier stages get the extra layer).
    ``stage_sizes`` gives the number of layers of each stage explicitly.

    Raises:
        ValueError: ``num_stages < 1``, more stages than layers, or ``stage_sizes`` of the wrong
            length, with a non-positive entry, or not summing to ``num_layers``.
    """
    num_layers = check_int("number of layers", num_layers)
    num_stages = check_int("num_stages", num_stages)
    if num_stages > num_layers:
        raise ValueError(f"num_stages={num_stages} is more stages than layers ({num_layers}): "
                         f"use 1..{num_layers} stages (every stage needs at least one layer)")
    if stage_sizes is None:
        q, r = divmod(num_layers, num_stages)
        stage_sizes = [q + (1 if k < r else 0) for k in range(num_stages)]
    sizes = list(stage_sizes)
    if (len(sizes) != num_stages or any(not isinstance(s, int) or s < 1 for s in sizes)
            or sum(sizes) != num_layers):
        raise ValueError(f"stage_sizes={list(stage_sizes)!r} is not allowed: use {num_stages} "
                         f"positive ints summing to the number of layers {num_layers}")
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    return bounds


def module_dtype(modules: Iterable[nn.Module]) -> torch.dtype:
    """dtype of the first floating parameter found, else torch's default dtype."""
    for m in modules:
        for p in m.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.get_default_dtype()


def output_shapes(layers: Sequence[nn.Module], in_shape: Sequence[int],
                  dtype: torch.dtype | None = None) -> list[tuple]:
    """Per-sample output shape of every layer, from one ``no_grad`` forward pass of two zero
    samples (layers are put in eval mode for it and restored). ``ValueError`` if a layer does
    not accept its predecessor's output."""
    dtype = dtype or module_dtype(layers)
    x = torch.zeros((2, *in_shape), dtype=dtype)
    shapes = []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            training = layer.training
            layer.eval()
            try:
                x = layer(x)
            except Exception as exc:
                raise ValueError(f"layer {i} ({type(layer).__name__}) does not accept input of "
                                 f"shape {tuple(x.shape[1:])}: {exc}") from None
            finally:
                layer.train(training)
            shapes.append(tuple(x.shape[1:]))
    return shapes


def global_batches(num_samples: int, batch_size: int, seed: int, epoch: int,
                   num_replicas: int = 1, drop_last: bool = False) -> list[np.ndarray]:
    """The global batches (int64 index arrays) of one epoch.

    Every sample is used: a final incomplete batch is kept unless ``drop_last`` (an explicit
    user choice) -- also when it has fewer samples than ``num_replicas`` (the last replicas
    then get empty shards, see :func:`shard`). ``num_replicas`` does not change the batches
    (kept for callers that pass it).
    """
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64)
    batches = [perm[i:i + batch_size] for i in range(0, num_samples, batch_size)]
    if batches and drop_last and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


def shard(batch: np.ndarray, rank: int, num_replicas: int) -> np.ndarray:
    """Chunk ``rank`` of ``np.array_split(batch, num_replicas)`` (as ``data.shard_bounds``):
    int64, empty when ``len(batch) <= rank``."""
    q, rem = divmod(len(batch), num_replicas)
    start = rank * q + min(rank, rem)
    return np.asarray(batch, dtype=np.int64)[start:start + q + (1 if rank < rem else 0)]


def shard_loss(logits: torch.Tensor, y: torch.Tensor, global_batch: int,
               num_replicas: int = 1, loss: str = "cross_entropy") -> torch.Tensor:
    """This replica's loss such that the **mean** of the replicas' gradients is the gradient
    of the mean loss over the global batch of ``global_batch`` samples.

    The mean over the shard (``F.cross_entropy(logits, y)`` / ``F.mse_loss(logits, y)``)
    when every replica holds ``global_batch / num_replicas`` samples (bitwise the
    single-process loss for one replica); otherwise the summed per-sample loss times
    ``num_replicas / global_batch`` (cross-entropy: ``F.cross_entropy(..., reduction="sum")``;
    MSE: ``F.mse_loss(..., reduction="sum") / D``, each sample's mean over its ``D``
    outputs), 0 for an empty shard. Unlike weighting the averaged gradients by the shard size,
    this keeps the loss a share of one global loss, which the cross-replica backward of
    synchronized BatchNorm (:mod:`mgrit.parallel.replicas`) needs.

    Args:
        logits: head outputs ``(n, C)`` (``(n, D)`` for MSE), ``n >= 0``.
        y: int64 labels ``(n,)`` (cross-entropy) or float targets ``(n, D)`` (MSE).
        loss: one of :data:`LOSSES` (default ``"cross_entropy"``).
    """
    if len(y) * num_replicas == global_batch:
        return F.mse_loss(logits, y) if loss == "mse" else F.cross_entropy(logits, y)
    if loss == "mse":
        return F.mse_loss(logits, y, reduction="sum") / logits.shape[1] \
            * (num_replicas / global_batch)
    return F.cross_entropy(logits, y, reduction="sum") * (num_replicas / global_batch)


def release_gradients(modules: Iterable[nn.Module]) -> None:
    """Set ``.grad = None`` on every parameter of ``modules`` (frees the memory of gradients
    that no later step reads: finished stages, the end of training)."""
    for m in modules:
        for p in m.parameters():
            p.grad = None


def as_targets(y, loss: str, num_outputs: int, dtype: torch.dtype, what: str = "y") -> torch.Tensor:
    """Targets of ``loss`` as a CPU tensor checked by :func:`check_targets`: int64 labels
    (cross-entropy) or floats in ``dtype`` (MSE, the layers' dtype)."""
    t = as_tensor(y)
    check_targets(t, loss, num_outputs, what)
    return t.to(dtype) if loss == "mse" else t.long()


def as_tensor(x, dtype: torch.dtype | None = None) -> torch.Tensor:
    """numpy array or tensor -> CPU tensor (features: ``dtype``; labels: keep int64)."""
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t
