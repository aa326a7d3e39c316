"""Shared pieces of the layer-wise trainers: argument checks, optimizers, stage splits,
feature shapes, the seeded global-batch schedule (same convention as
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

__all__ = ["OPTIMIZERS", "check_int", "check_float", "make_optimizer", "split_stages",
           "output_shapes", "global_batches", "shard", "shard_loss", "release_gradients",
           "as_tensor", "module_dtype"]

#: Optimizer names accepted by :func:`make_optimizer`.
OPTIMIZERS = ("sgd", "adam")


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
               num_replicas: int = 1) -> torch.Tensor:
    """This replica's cross-entropy loss such that the **mean** of the replicas' gradients is
    the gradient of the mean loss over the global batch of ``global_batch`` samples.

    ``F.cross_entropy(logits, y)`` (the mean over the shard) when every replica holds
    ``global_batch / num_replicas`` samples (bitwise the single-process loss for one
    replica); otherwise the summed loss times ``num_replicas / global_batch`` (0 for an empty
    shard). Unlike weighting the averaged gradients by the shard size, this keeps the loss a
    share of one global loss, which the cross-replica backward of synchronized BatchNorm
    (:mod:`layerwise.replicas`) needs. ``logits`` ``(n, C)``, ``y`` int64 ``(n,)``, ``n >= 0``.
    """
    if len(y) * num_replicas == global_batch:
        return F.cross_entropy(logits, y)
    return F.cross_entropy(logits, y, reduction="sum") * (num_replicas / global_batch)


def release_gradients(modules: Iterable[nn.Module]) -> None:
    """Set ``.grad = None`` on every parameter of ``modules`` (frees the memory of gradients
    that no later step reads: finished stages, the end of training)."""
    for m in modules:
        for p in m.parameters():
            p.grad = None


def as_tensor(x, dtype: torch.dtype | None = None) -> torch.Tensor:
    """numpy array or tensor -> CPU tensor (features: ``dtype``; labels: keep int64)."""
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t
