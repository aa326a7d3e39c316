"""Sequential layer-by-layer training (Kim 2019, "Sequential Training Algorithm for Neural
Networks", arXiv 1905.07490; same family as greedy layer-wise training, Belilovsky et al. 2019).

Stage ``k`` (k = 0..L-1) trains layer ``k`` on the **cached** outputs of the frozen layers
``0..k-1`` (the cache is advanced once per stage by applying the just-frozen layer to it, so a
frozen layer is never recomputed per epoch: the compute and memory saving of the method):

* ``grow="top"``: a fresh temporary head on top of layer ``k`` is trained together with it;
  the last stage's head becomes the output head.
* ``grow="before_output"``: one output head is kept throughout and every new hidden layer is
  inserted just below it; each stage trains (layer ``k`` + output head). The head must fit
  every layer's output shape.

Afterwards layer ``k`` is frozen (``requires_grad = False``, parameters bitwise unchanged from
then on). Finally the output head is re-fitted on the cached top features for ``head_epochs``
and, optionally, the whole network is fine-tuned end to end for ``finetune_epochs``. The
layers' original ``requires_grad`` flags are restored when :meth:`SequentialTrainer.fit` ends.

Data parallelism: pass the data-parallel communicator; each replica trains on its shard of every
global batch (every sample is used; a replica whose shard is empty contributes zero) and the
gradients are averaged, every replica holding the full feature cache. BatchNorm layers use the
statistics of the global batch and update their running statistics identically on every
replica; any other module whose buffers change in a training forward is refused with a
``ValueError`` on every rank before its first step (:mod:`layerwise.replicas`). So ``R``
replicas give the single-process result up to rounding.

Memory: when a stage ends, the gradients of everything it trained are released (``.grad =
None``; a frozen layer never needs them again) and its optimizer (momentum/Adam state) is
dropped, so memory does not grow with the number of stages.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from mgrit.parallel.dataparallel import GradientBuckets

from .common import (check_float, check_int, global_batches, make_optimizer, module_dtype,
                     output_shapes, release_gradients, shard, shard_loss)
from .evaluate import accuracy
from .heads import HeadSpec, check_head_fits, make_head
from .replicas import ReplicaSync, refuse_unsynchronized

__all__ = ["SequentialTrainer", "GROW_MODES"]

#: Values of ``grow``.
GROW_MODES = ("top", "before_output")


class SequentialTrainer:
    """Kim-style sequential trainer.

    Args:
        layers: the network's layers (trained in place), applied in order; one stage per layer.
        num_classes: C.
        in_shape: per-sample input shape.
        grow: ``"top"`` (fresh temporary head per layer) or ``"before_output"`` (one head kept).
        head: head kind or factory (:mod:`layerwise.heads`, default ``"linear"``).
        head_hidden: hidden width for ``"mlp"``/``"conv"`` heads.
        optimizer, lr, momentum, weight_decay: a fresh optimizer per stage.
        epochs_per_layer: int >= 1, or a list with one entry per layer (default 5).
        head_epochs: epochs of the final head re-fit on cached features (>= 0; default:
            ``epochs_per_layer`` of the last layer).
        finetune_epochs: epochs of end-to-end fine-tuning of everything at the end (default 0).
        finetune_lr: its learning rate (default ``lr``).
        batch_size: global batch size (split over replicas).
        seed: batch order (``default_rng([seed, epoch])``) and head initialisation.
        data_comm: data-parallel communicator (default: none).
        cache_batch_size: chunk size when advancing the feature cache (default 1024).
        log: called with every epoch's metrics dict (default: nothing).

    Raises:
        ValueError: unknown ``grow``/``head``/``optimizer``; non-positive epochs, lr or
            batch size; a head that does not fit a layer's output shape; with replicas, a
            module other than BatchNorm whose buffers change in a training forward (on every
            rank, :func:`layerwise.replicas.refuse_unsynchronized`).
    """

    def __init__(self, layers: Sequence[nn.Module], num_classes: int, in_shape: Sequence[int], *,
                 grow: str = "top", head: HeadSpec = "linear", head_hidden: int = 64,
                 optimizer: str = "sgd", lr: float = 0.05, momentum: float = 0.9,
                 weight_decay: float = 0.0, epochs_per_layer: int | Sequence[int] = 5,
                 head_epochs: int | None = None, finetune_epochs: int = 0,
                 finetune_lr: float | None = None, batch_size: int = 64, seed: int = 0,
                 data_comm: MPI.Comm | None = None, cache_batch_size: int = 1024,
                 log: Callable[[dict], None] | None = None):
        self.layers = list(layers)
        L = len(self.layers)
        if L < 1:
            raise ValueError("layers is empty: sequential training needs at least one layer")
        if grow not in GROW_MODES:
            raise ValueError(f"grow={grow!r} is not allowed: use one of {', '.join(GROW_MODES)}")
        epl = [epochs_per_layer] * L if isinstance(epochs_per_layer, (int, np.integer)) \
            else list(epochs_per_layer)
        if len(epl) != L:
            raise ValueError(f"epochs_per_layer has {len(epl)} entries for {L} layers: give one "
                             f"int or one per layer")
        self.epochs_per_layer = [check_int("epochs_per_layer", e) for e in epl]
        self.head_epochs = self.epochs_per_layer[-1] if head_epochs is None \
            else check_int("head_epochs", head_epochs, 0)
        self.finetune_epochs = check_int("finetune_epochs", finetune_epochs, 0)
        self.batch_size = check_int("batch_size", batch_size)
        self.cache_batch_size = check_int("cache_batch_size", cache_batch_size)
        self.lr = check_float("lr", lr)
        self.finetune_lr = self.lr if finetune_lr is None else check_float("finetune_lr", finetune_lr)
        make_optimizer(optimizer, [nn.Parameter(torch.zeros(1))], lr, momentum, weight_decay)
        self.opt_args = (optimizer, momentum, weight_decay)
        self.grow, self.seed, self.num_classes = grow, seed, num_classes
        self.data_comm = data_comm
        self.log = log
        self.dtype = module_dtype(self.layers)
        self.shapes = output_shapes(self.layers, tuple(in_shape), self.dtype)
        self.heads: list[nn.Module] = []
        for k, shape in enumerate(self.shapes):
            if grow == "before_output" and k > 0:
                try:
                    check_head_fits(self.heads[0], shape, num_classes, what="the output head")
                except ValueError as exc:
                    raise ValueError(f"grow='before_output' keeps one output head for every "
                                     f"layer, but layer {k}: {exc}") from None
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 7919 * k)
                try:
                    self.heads.append(make_head(head, shape, num_classes, hidden=head_hidden,
                                                dtype=self.dtype))
                except ValueError as exc:
                    raise ValueError(f"layer {k}: {exc}") from None
        self._names = {id(m): f"layers.{k}" for k, m in enumerate(self.layers)}
        self._names.update({id(h): f"heads.{k}" for k, h in enumerate(self.heads)})
        if data_comm is not None and data_comm.Get_size() > 1:
            ins = [tuple(in_shape), *self.shapes[:-1]]
            refuse_unsynchronized([self._sync([layer, self.heads[k if grow == "top" else 0]])
                                   for k, layer in enumerate(self.layers)], ins, self.dtype,
                                  data_comm)
        self.history: list[dict] = []
        #: the optimizer of the stage being trained (None between stages: a finished stage's
        #: optimizer state is dropped)
        self.optimizer: torch.optim.Optimizer | None = None
        self._epoch = 0

    @property
    def output_head(self) -> nn.Module:
        return self.heads[-1]

    @property
    def network(self) -> nn.Sequential:
        """The combined network: all layers then the output head (shares their parameters)."""
        return nn.Sequential(*self.layers, self.output_head)

    def state_dict(self) -> dict:
        return self.network.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.network.load_state_dict(state)

    # ------------------------------------------------------------------ helpers
    def _sync(self, modules: Sequence[nn.Module]) -> ReplicaSync:
        return ReplicaSync(modules, self.data_comm, names=[self._names[id(m)] for m in modules])

    def _cache_forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` in eval mode without a graph, ``cache_batch_size`` rows at a time."""
        training = module.training
        module.eval()
        with torch.no_grad():
            out = torch.cat([module(x[i:i + self.cache_batch_size])
                             for i in range(0, len(x), self.cache_batch_size)])
        module.train(training)
        return out

    def _train_epoch(self, modules: Sequence[nn.Module], opt: torch.optim.Optimizer,
                     feats: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        comm = self.data_comm
        D = comm.Get_size() if comm is not None else 1
        d = comm.Get_rank() if comm is not None else 0
        net = nn.Sequential(*modules)
        params = [p for p in net.parameters() if p.requires_grad]
        buckets = GradientBuckets(params, comm) if D > 1 else None  # persistent flat buffers
        sync = self._sync(modules) if D > 1 else None  # BatchNorm + buffer guard
        net.train()
        tot = np.zeros(3)
        with sync if sync is not None else nullcontext():
            for b in global_batches(len(y), self.batch_size, self.seed, self._epoch):
                idx = torch.as_tensor(shard(b, d, D))
                if sync is not None:
                    sync.begin_step()
                logits = net(feats[idx])
                loss = shard_loss(logits, y[idx], len(b), D)
                opt.zero_grad()
                loss.backward()
                if buckets is not None:
                    sync.end_step()
                    buckets.average()
                opt.step()
                scale = len(idx) if len(idx) * D == len(b) else len(b) / D  # loss -> summed loss
                tot += (float(loss.detach()) * scale, int((logits.argmax(1) == y[idx]).sum()),
                        len(idx))
        if D > 1:
            comm.Allreduce(MPI.IN_PLACE, [tot, MPI.DOUBLE], op=MPI.SUM)
        self._epoch += 1
        return tot[0] / max(tot[2], 1), tot[1] / max(tot[2], 1)

    def _test_acc(self, modules, feats, y) -> float | None:
        if feats is None:
            return None
        net = nn.Sequential(*modules)
        training = [m.training for m in modules]
        net.eval()
        with torch.no_grad():
            logits = torch.cat([net(feats[i:i + self.cache_batch_size])
                                for i in range(0, len(feats), self.cache_batch_size)])
        for m, t in zip(modules, training):
            m.train(t)
        return accuracy(logits, y)

    def _run(self, stage, modules, lr, epochs, feats, y, test_feats, test_y) -> None:
        """Train ``modules`` for ``epochs`` with a fresh optimizer; afterwards their gradients
        are released and the optimizer (its state) is dropped."""
        name, momentum, wd = self.opt_args
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(name, params, lr, momentum, wd)
        try:
            for _ in range(epochs):
                t0 = time.perf_counter()
                loss, acc = self._train_epoch(modules, self.optimizer, feats, y)
                rec = {"stage": stage, "epoch": self._epoch, "loss": loss, "train_acc": acc,
                       "test_acc": self._test_acc(modules, test_feats, test_y),
                       "time": time.perf_counter() - t0}
                self.history.append(rec)
                if self.log is not None:
                    self.log(rec)
        finally:
            self.optimizer = None
            release_gradients(modules)

    # ------------------------------------------------------------------ training
    def fit(self, x: torch.Tensor, y: torch.Tensor, test_x: torch.Tensor | None = None,
            test_y: torch.Tensor | None = None) -> list[dict]:
        """Train all stages, re-fit the head, optionally fine-tune.

        Args:
            x: training inputs ``(n, *in_shape)`` in the layers' dtype; y: int64 labels ``(n,)``.
            test_x, test_y: optional test set, evaluated after every epoch (on cached features).

        Returns:
            :attr:`history`: one dict per epoch ``{"stage": k | "head" | "finetune", "epoch",
            "loss", "train_acc", "test_acc" (None without a test set), "time" (seconds)}``.
        """
        flags = [[p.requires_grad for p in layer.parameters()] for layer in self.layers]
        feats, test_feats = x, test_x  # the cache: outputs of the frozen layers below
        try:
            for k, layer in enumerate(self.layers):
                head = self.heads[k if self.grow == "top" else 0]
                self._run(k, [layer, head], self.lr, self.epochs_per_layer[k], feats, y,
                          test_feats, test_y)
                for p in layer.parameters():
                    p.requires_grad_(False)
                feats = self._cache_forward(layer, feats)
                if test_feats is not None:
                    test_feats = self._cache_forward(layer, test_feats)
            self.cached_features = feats
            self._run("head", [self.output_head], self.lr, self.head_epochs, feats, y,
                      test_feats, test_y)
        finally:
            for layer, fl in zip(self.layers, flags):
                for p, f in zip(layer.parameters(), fl):
                    p.requires_grad_(f)
        if self.finetune_epochs:
            self._run("finetune", [*self.layers, self.output_head], self.finetune_lr,
                      self.finetune_epochs, x, y, test_x, test_y)
        return self.history

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """``{"loss", "acc"}`` of the combined network on ``x, y`` (recomputes all layers)."""
        logits = self._cache_forward(self.network, x)
        return {"loss": float(F.cross_entropy(logits, y)), "acc": accuracy(logits, y)}
