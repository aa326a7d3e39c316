"""Decoupled greedy learning (DGL; Belilovsky, Eickenberg, Oyallon, ICML 2020, "Decoupled
Greedy Learning of CNNs"): stages, and the single-process training loop.

The network (a list of ``nn.Module`` layers, each one block: ``Linear+ReLU``, a conv block, a
:class:`~layerwise.heads.ResidualStep`, ...) is split into ``K`` contiguous stages. Stage ``k``
has a body (its layers), an auxiliary head and its own optimizer; per batch it runs forward,
computes its local loss (cross-entropy on class labels, or MSE on regression targets:
``loss="mse"``), back-propagates *inside the stage only*, steps, and hands
its **detached** output to stage ``k + 1``. There is no backward dependency between stages, so
the MPI pipeline (:class:`layerwise.pipeline.DecoupledPipeline`) reproduces this loop exactly.

Asynchronous variant (paper Sec. 3.2, simulated here single-process): a bounded replay buffer
(FIFO of the last ``buffer_size`` items) between consecutive stages; per tick stage 0 trains on
the new batch and pushes its output, every later stage trains on an item drawn uniformly (seeded)
from its input buffer and pushes its own output, so later stages see stale inputs.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from .common import (check_int, check_loss, check_targets, correct_count, make_optimizer,
                     module_dtype, output_shapes, release_gradients, shard_loss, split_stages)
from .evaluate import evaluate
from .heads import HeadSpec, make_head

__all__ = ["DecoupledModel", "DecoupledTrainer", "stage_step", "summarize"]


class DecoupledModel(nn.Module):
    """``K`` stages of a layer list, each with an auxiliary head.

    Args:
        layers: the network's layers (used as-is, not copied), all of one dtype; applied in order.
        num_classes: C, number of classes (logits per head); with ``loss="mse"`` the output
            dimension D of every head (targets ``(n, D)``).
        in_shape: per-sample input shape, e.g. ``(64,)`` or ``(1, 8, 8)``.
        num_stages: K, 1 <= K <= len(layers).
        head: head kind or factory (see :mod:`layerwise.heads`) for every stage (default
            ``"linear"``); the last stage's head is the network's output head.
        stage_sizes: layers per stage (default: as even as possible).
        head_hidden: hidden width of ``"mlp"``/``"conv"`` heads.
        seed: heads are initialised under ``torch.manual_seed(seed + 7919 * k)`` (rank
            independent, global RNG state restored).
        loss: every stage's local loss, ``"cross_entropy"`` (default; int64 labels ``(n,)``)
            or ``"mse"`` (float targets ``(n, D)``; no accuracy), see
            :data:`layerwise.common.LOSSES`.

    Attributes:
        bodies, heads: ``nn.ModuleList`` of length K.
        bounds: ``(start, stop)`` layer range of every stage.
        in_shapes, out_shapes: per-sample input/output shape of every stage.

    Raises:
        ValueError: unknown ``loss``, more stages than layers, bad ``stage_sizes``, a layer
            not accepting its input, or a head that does not fit a stage's output shape.
    """

    def __init__(self, layers: Sequence[nn.Module], num_classes: int, in_shape: Sequence[int], *,
                 num_stages: int, head: HeadSpec = "linear",
                 stage_sizes: Sequence[int] | None = None, head_hidden: int = 64, seed: int = 0,
                 loss: str = "cross_entropy"):
        super().__init__()
        self.loss = check_loss(loss)
        layers = list(layers)
        self.bounds = split_stages(len(layers), num_stages, stage_sizes)
        dtype = module_dtype(layers)
        shapes = output_shapes(layers, tuple(in_shape), dtype)
        self.in_shapes = [tuple(in_shape) if a == 0 else shapes[a - 1] for a, _ in self.bounds]
        self.out_shapes = [shapes[b - 1] for _, b in self.bounds]
        self.num_classes = num_classes
        self.bodies = nn.ModuleList(nn.Sequential(*layers[a:b]) for a, b in self.bounds)
        heads = []
        for k, shape in enumerate(self.out_shapes):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 7919 * k)
                try:
                    heads.append(make_head(head, shape, num_classes, hidden=head_hidden,
                                           dtype=dtype))
                except ValueError as exc:
                    raise ValueError(f"stage {k} (layers {self.bounds[k][0]}..{self.bounds[k][1] - 1}): "
                                     f"{exc}") from None
        self.heads = nn.ModuleList(heads)

    @property
    def num_stages(self) -> int:
        return len(self.bodies)

    @property
    def dtype(self) -> torch.dtype:
        return module_dtype(self.heads)

    def stage_parameters(self, k: int) -> list[nn.Parameter]:
        """Trainable parameters of stage ``k``: body then head, in a fixed order."""
        return [p for p in (*self.bodies[k].parameters(), *self.heads[k].parameters())
                if p.requires_grad]

    def make_optimizers(self, name: str = "sgd", lr: float = 0.05, momentum: float = 0.9,
                        weight_decay: float = 0.0) -> list[torch.optim.Optimizer]:
        """One optimizer per stage (see :func:`layerwise.common.make_optimizer`)."""
        return [make_optimizer(name, self.stage_parameters(k), lr, momentum, weight_decay)
                for k in range(self.num_stages)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(n, C)`` of the combined network (all bodies, then the last head)."""
        for body in self.bodies:
            x = body(x)
        return self.heads[-1](x)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 1024,
                 ensemble: bool = False) -> dict:
        """:func:`layerwise.evaluate.evaluate` of this model with its loss (all heads
        reported)."""
        return evaluate(list(self.bodies), list(self.heads), x, y, batch_size=batch_size,
                        ensemble=ensemble, loss=self.loss)


def stage_step(model: DecoupledModel, k: int, x: torch.Tensor, y: torch.Tensor,
               optimizer: torch.optim.Optimizer,
               after_backward: Callable[[int], None] | None = None,
               global_batch: int | None = None,
               num_replicas: int = 1) -> tuple[torch.Tensor, float, int | None]:
    """One local DGL update of stage ``k`` on a batch (or one replica's shard of it).

    Args:
        x: stage input ``(b, *in_shapes[k])`` (no graph attached; ``b`` may be 0 for a replica
            with an empty shard); y: int64 labels ``(b,)``, or float targets ``(b, D)`` when
            ``model.loss == "mse"``.
        after_backward: called with ``k`` between ``backward`` and ``optimizer.step`` (used for
            data-parallel gradient averaging).
        global_batch, num_replicas: the global batch size this shard belongs to and the number
            of replicas; the loss is :func:`~layerwise.common.shard_loss` of ``model.loss``
            (default: the mean over ``x``, the single-process loss).

    Returns:
        ``(out, loss, correct)``: detached output ``(b, *out_shapes[k])``, the mean loss over
        this batch's ``b`` samples as a float (0.0 for ``b = 0``; the summed loss is ``loss *
        b``), and the number of correct head predictions (None for MSE).
    """
    out = model.bodies[k](x)
    logits = model.heads[k](out)
    n = len(y) if global_batch is None else global_batch
    loss = shard_loss(logits, y, n, num_replicas, model.loss)
    optimizer.zero_grad()
    loss.backward()
    if after_backward is not None:
        after_backward(k)
    optimizer.step()
    correct = correct_count(logits, y, model.loss)
    value = float(loss.detach())
    if len(y) * num_replicas != n:  # the shard's share of the global loss -> its mean
        value = value * (n / num_replicas) / len(y) if len(y) else 0.0
    return out.detach(), value, correct


class DecoupledTrainer:
    """Single-process DGL training loop (the reference the MPI pipeline must equal).

    Args:
        model: the stages.
        optimizer, lr, momentum, weight_decay: per-stage optimizer (see ``make_optimizer``).
        asynchronous: replay-buffer variant (see module doc; default False).
        buffer_size: capacity of each replay buffer (>= 1, default 16).
        seed: seeds the buffer sampling.
    """

    def __init__(self, model: DecoupledModel, *, optimizer: str = "sgd", lr: float = 0.05,
                 momentum: float = 0.9, weight_decay: float = 0.0, asynchronous: bool = False,
                 buffer_size: int = 16, seed: int = 0):
        self.model = model
        self.optimizers = model.make_optimizers(optimizer, lr, momentum, weight_decay)
        self.asynchronous = bool(asynchronous)
        self.buffer_size = check_int("buffer_size", buffer_size)
        self.buffers = [deque(maxlen=self.buffer_size) for _ in range(model.num_stages - 1)]
        self.rng = np.random.default_rng([seed, 104729])

    def train_batch(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[float, int, int]]:
        """One tick: every stage takes one step. Returns per stage ``(loss_sum, correct, n)``
        (``correct`` NaN for MSE)."""
        stats = []
        m = self.model
        for k in range(m.num_stages):
            if self.asynchronous and k > 0:
                buf = self.buffers[k - 1]
                x, y = buf[int(self.rng.integers(len(buf)))]
            x, loss, correct = stage_step(m, k, x, y, self.optimizers[k])
            stats.append((loss * len(y), np.nan if correct is None else correct, len(y)))
            if self.asynchronous and k < m.num_stages - 1:
                self.buffers[k].append((x, y))
        return stats

    def train_epoch(self, x: torch.Tensor, y: torch.Tensor,
                    batches: Sequence[np.ndarray]) -> dict:
        """Train on ``x[idx], y[idx]`` for every index array in ``batches``.

        ``y``: int64 labels ``(n,)``, or float targets ``(n, D)`` when the model's loss is
        ``"mse"``.

        Returns ``{"stage_loss": [...], "stage_acc": [...], "loss": last stage's mean loss,
        "train_acc": last stage's accuracy}`` (running averages over the epoch; accuracies
        None for MSE). The parameters' ``.grad`` are released (``None``) at the end.

        Raises:
            ValueError: ``y`` not targets of the model's loss (before any step).
        """
        check_targets(y, self.model.loss, self.model.num_classes)
        K = self.model.num_stages
        tot = np.zeros((K, 3))
        self.model.train()
        for idx in batches:
            idx = torch.as_tensor(idx)
            tot += np.array(self.train_batch(x[idx], y[idx]), dtype=float)
        release_gradients([self.model])  # nothing reads them before the next step
        return summarize(tot)


def summarize(tot: np.ndarray) -> dict:
    """Per-stage sums ``(loss_sum, correct, n)`` -> the metrics dict of an epoch (a NaN
    ``correct``, i.e. MSE, gives accuracy None)."""
    n = np.maximum(tot[:, 2], 1)
    loss = (tot[:, 0] / n).tolist()
    acc = [None if np.isnan(c) else float(c / m) for c, m in zip(tot[:, 1], n)]
    return {"loss": loss[-1], "train_acc": acc[-1], "stage_loss": loss, "stage_train_acc": acc}
