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

Every stage minimizes ``loss``: cross-entropy on class labels (default) or, with
``loss="mse"``, the mean squared error on float regression targets ``(n, D)`` (the heads then
output ``D`` values and no accuracy is recorded).

Afterwards layer ``k`` is frozen (``requires_grad = False``, parameters bitwise unchanged from
then on). Finally the output head is re-fitted on the cached top features for ``head_epochs``
and, optionally, the whole network is fine-tuned end to end for ``finetune_epochs``. The
layers' original ``requires_grad`` flags are restored when :meth:`SequentialTrainer.fit` ends.

Data parallelism: pass the data-parallel communicator; each replica trains on its shard of every
global batch (every sample is used; a replica whose shard is empty contributes zero) and the
gradients are averaged, every replica holding the full feature cache. BatchNorm layers use the
statistics of the global batch and update their running statistics identically on every
replica; any other module whose buffers change in a training forward is refused with a
``ValueError`` on every rank before its first step (:mod:`mgrit.parallel.replicas`). So ``R``
replicas give the single-process result up to rounding.

Memory: when a stage ends, the gradients of everything it trained are released (``.grad =
None``; a frozen layer never needs them again) and its optimizer (momentum/Adam state) is
dropped, so memory does not grow with the number of stages.

The trainer is a :class:`~mgrit.training.method.TrainingMethod`: its schedule (the stages'
epochs one after another, :attr:`SequentialTrainer.plan`) runs in the library's training loop,
``Trainer(sequential, None, grid).fit(train, epochs=len(sequential.plan), ...)``, with the
loop's batch schedule (epoch ``e`` of the whole schedule draws ``default_rng([seed, e])``),
evaluation (of the stage's network on the cached test features), metrics and checkpoints
(keys ``layers.{k}.*`` and ``heads.{k}.*``; a checkpoint taken inside a stage restores that
stage's optimizer state when training resumes). :meth:`SequentialTrainer.fit` does this for
you.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from mgrit.parallel.dataparallel import GradientBuckets
from mgrit.parallel.procgrid import ProcessGrid
from mgrit.parallel.replicas import refuse_unsynchronized
from mgrit.training.support.faults import phase
from mgrit.training.method import MethodOptimizer, TrainingMethod
from mgrit.training.trainer import Trainer

from .common import (check_float, check_int, check_loss, check_targets, correct_count,
                     eval_loss, make_optimizer, module_dtype, output_shapes, shard_loss)
from .evaluate import accuracy
from .features import FeatureCache
from .heads import HeadSpec, check_head_fits, make_head
from .stages import SequentialStages, StageLog

__all__ = ["SequentialTrainer", "GROW_MODES"]

#: Values of ``grow``.
GROW_MODES = ("top", "before_output")


class SequentialTrainer(SequentialStages, TrainingMethod):
    """Sequential layer-by-layer trainer (our reading of Kim 2019; see the module doc).

    Args:
        layers: the network's layers (trained in place), applied in order; one stage per layer.
        num_classes: C, the number of classes (logits per head); with ``loss="mse"`` the output
            dimension D of the heads (targets ``(n, D)``).
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
        batch_size: global batch size (split over replicas; used by :meth:`fit`).
        seed: batch order (``default_rng([seed, epoch])``, used by :meth:`fit`) and head
            initialisation.
        data_comm: data-parallel communicator (default: none); in a
            :class:`~mgrit.training.Trainer` the grid's ``data_comm``.
        cache_batch_size: chunk size when advancing the feature cache (default 1024).
        log: called with every epoch's metrics dict by :meth:`fit` (default: nothing).
        loss: ``"cross_entropy"`` (default; int64 labels ``(n,)``) or ``"mse"`` (float targets
            ``(n, D)``; accuracies None), see :data:`layerwise.common.LOSSES`.

    Attributes:
        layers: ``nn.ModuleList``; ``heads`` too.
        plan: the stage of every epoch: ``k``, ``"head"`` or ``"finetune"``.
        history: :meth:`fit`'s per-epoch dicts.
        stage_optimizer: the optimizer of the stage being trained (None between stages).
        optimizer: its checkpoint view.
        loss: the loss name.
        loss_function: the per-sample loss ``fn(out, y, reduction)`` for the Trainer's
            evaluation: ``Trainer(seq, None, grid, loss=seq.loss_function)``.

    Raises:
        ValueError: unknown ``grow``/``head``/``optimizer``/``loss``; non-positive epochs, lr or
            batch size; a head that does not fit a layer's output shape; with replicas, a
            module other than BatchNorm whose buffers change in a training forward (on every
            rank, :func:`mgrit.parallel.replicas.refuse_unsynchronized`).
    """

    def __init__(self, layers: Sequence[nn.Module], num_classes: int, in_shape: Sequence[int], *,
                 grow: str = "top", head: HeadSpec = "linear", head_hidden: int = 64,
                 optimizer: str = "sgd", lr: float = 0.05, momentum: float = 0.9,
                 weight_decay: float = 0.0, epochs_per_layer: int | Sequence[int] = 5,
                 head_epochs: int | None = None, finetune_epochs: int = 0,
                 finetune_lr: float | None = None, batch_size: int = 64, seed: int = 0,
                 data_comm: MPI.Comm | None = None, cache_batch_size: int = 1024,
                 log: Callable[[dict], None] | None = None, loss: str = "cross_entropy"):
        super().__init__(MPI.COMM_SELF)
        self.loss = check_loss(loss)
        self.loss_function = eval_loss(loss)
        layers = list(layers)
        L = len(layers)
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
        self.dtype = module_dtype(layers)
        self.shapes = output_shapes(layers, tuple(in_shape), self.dtype)
        heads = []
        for k, shape in enumerate(self.shapes):
            if grow == "before_output" and k > 0:
                try:
                    check_head_fits(heads[0], shape, num_classes, what="the output head")
                except ValueError as exc:
                    raise ValueError(f"grow='before_output' keeps one output head for every "
                                     f"layer, but layer {k}: {exc}") from None
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 7919 * k)
                try:
                    heads.append(make_head(head, shape, num_classes, hidden=head_hidden,
                                           dtype=self.dtype))
                except ValueError as exc:
                    raise ValueError(f"layer {k}: {exc}") from None
        self.layers, self.heads = nn.ModuleList(layers), nn.ModuleList(heads)
        self._names = {id(m): f"layers.{k}" for k, m in enumerate(self.layers)}
        self._names.update({id(h): f"heads.{k}" for k, h in enumerate(self.heads)})
        if data_comm is not None and data_comm.Get_size() > 1:
            ins = [tuple(in_shape), *self.shapes[:-1]]
            refuse_unsynchronized([self._sync([layer, self.heads[k if grow == "top" else 0]])
                                   for k, layer in enumerate(self.layers)], ins, self.dtype,
                                  data_comm)
        self.plan = [k for k in range(L) for _ in range(self.epochs_per_layer[k])] \
            + ["head"] * self.head_epochs + ["finetune"] * self.finetune_epochs
        self.history: list[dict] = []
        #: the optimizer of the stage being trained (None between stages: a finished stage's
        #: optimizer state is dropped)
        self.stage_optimizer: torch.optim.Optimizer | None = None
        self.optimizer = MethodOptimizer(
            self.parameters(), lambda: [] if self.stage_optimizer is None else [self.stage_optimizer])
        self._stage = self._sync_now = self._buckets = self._flags = None
        self._mods: list = []  # the stage's modules (a list: not submodules of this one)
        self._depth, self._epoch, self._train_ref = 0, 0, None
        self._cache = FeatureCache(self.layers, self.cache_batch_size)  # frozen layers' outputs

    def describe_epoch(self, epoch: int) -> str | None:
        """``"trains layer k/L (epoch i/n of it)"``, ``"trains the output head"`` or
        ``"fine-tunes every layer"`` for the 0-based ``epoch`` of :attr:`plan`."""
        if not 0 <= epoch < len(self.plan):
            return None
        stage = self.plan[epoch]
        if stage == "head":
            return "trains the output head"
        if stage == "finetune":
            return "fine-tunes every layer"
        first = self.plan.index(stage)
        return (f"trains layer {stage + 1}/{len(self.layers)} (epoch {epoch - first + 1}/"
                f"{self.epochs_per_layer[stage]} of it)")

    @property
    def output_head(self) -> nn.Module:
        return self.heads[-1]

    @property
    def network(self) -> nn.Sequential:
        """The combined network: all layers then the output head (shares their parameters)."""
        return nn.Sequential(*self.layers, self.output_head)

    @property
    def cached_features(self) -> torch.Tensor | None:
        """Outputs of all layers for the training inputs of the latest fit (cached)."""
        if self._train_ref is None:
            return None
        return self._cache.features(self._train_ref, len(self.layers))

    # ------------------------------------------------------------------ stages (layerwise.stages)
    def _enter(self, stage) -> None:
        """Start ``stage``: freeze the layers below it (original flags for fine-tuning), a
        fresh optimizer (given a resumed checkpoint's state for it), gradient buffers and the
        replica synchronization."""
        self._finish()
        if stage == "finetune":  # every layer trains again: cached features go stale
            self._cache.clear()
        if self._flags is None:
            self._flags = [[p.requires_grad for p in layer.parameters()] for layer in self.layers]
        self._select(stage)
        for k, (layer, flags) in enumerate(zip(self.layers, self._flags)):
            for p, f in zip(layer.parameters(), flags):
                p.requires_grad_(f and (stage == "finetune" or k >= self._depth))
        name, momentum, wd = self.opt_args
        params = [p for m in self._mods for p in m.parameters() if p.requires_grad]
        self.stage_optimizer = make_optimizer(name, params, self.finetune_lr if stage ==
                                              "finetune" else self.lr, momentum, wd)
        self.optimizer.adopt(self.stage_optimizer)
        if self._replicas > 1:  # persistent flat buffers; BatchNorm + buffer guard
            self._buckets = GradientBuckets(params, self.data_comm)
            self._sync_now = self._sync(self._mods)

    # ------------------------------------------------------------------ the Trainer's hooks
    def begin_epoch(self, epoch: int, epochs: int, shards: Sequence[int] = ()) -> None:
        """Enter the stage of ``epoch`` (``plan[epoch]``) if it is not the one in training.

        Raises:
            ValueError: ``epochs`` is not the length of :attr:`plan` (every rank)."""
        if epochs != len(self.plan):
            raise ValueError(f"sequential training runs its whole schedule: {len(self.plan)} "
                             f"epochs ({len(self.layers)} layers x epochs per layer "
                             f"{self.epochs_per_layer}, head re-fit {self.head_epochs}, "
                             f"fine-tuning {self.finetune_epochs}), got epochs={epochs}")
        stage = self.plan[epoch]
        if epoch == 0:  # a new fit: features of earlier fits are stale
            self._cache.clear()
        if stage != self._stage or self.stage_optimizer is None:
            self._enter(stage)
        self._epoch, self._train_ref = epoch, None

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The input of the current stage's modules: the cached outputs of the frozen layers
        below it (``x`` itself for the first layer and for fine-tuning)."""
        if self._stage is None:
            self._select(self.plan[0])
        if self._train_ref is None and self.stage_optimizer is not None:
            self._train_ref = x  # the loop asks for the training inputs first
        return self._cache.features(x, self._depth)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, weight: float,
                   after_backward: Callable[[], None]) -> tuple:
        """One step of the current stage on this replica's shard (rows of :meth:`inputs`):
        the shard's share of the global mean loss, backward, gradient averaging over the
        replicas, optimizer step. Returns ``(mean loss, correct)`` of the shard (``(None,
        None)`` if empty; ``correct`` None for MSE).

        Raises:
            ValueError: ``y`` not targets of :attr:`loss` (the same on every replica given
                the same data, before any collective)."""
        if self.stage_optimizer is None:
            raise RuntimeError("train_step outside a stage: call begin_epoch first")
        check_targets(y, self.loss, self.num_classes)
        n, D = len(y), self._replicas
        gb = round(n / weight) if n else 1
        with self._sync_now if self._sync_now is not None else nullcontext():
            if self._sync_now is not None:
                self._sync_now.begin_step()
            logits = self._apply(x)
            loss = shard_loss(logits, y, gb, D, self.loss)
            self.stage_optimizer.zero_grad()
            loss.backward()
            after_backward()
            if self._buckets is not None:
                self._sync_now.end_step()
                with phase("gradient averaging"):
                    self._buckets.average()
        self.stage_optimizer.step()
        if not n:
            return None, None
        value = float(loss.detach())
        if n * D != gb:  # the shard's share of the global loss -> its mean
            value = value * (gb / D) / n
        return value, correct_count(logits, y, self.loss)

    def end_epoch(self) -> None:
        """After a stage's last epoch: release its gradients and optimizer and freeze its
        layer; after the schedule's last epoch: restore the layers' ``requires_grad``."""
        nxt = self._epoch + 1
        if nxt == len(self.plan) or self.plan[nxt] != self.plan[self._epoch]:
            self._finish()
            if isinstance(self._stage, int):
                for p in self.layers[self._stage].parameters():
                    p.requires_grad_(False)
        if nxt == len(self.plan):
            self._restore_flags()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the current stage's network (its modules) on rows of :meth:`inputs`."""
        if self._stage is None:
            self._select(self.plan[0])
        return self._apply(x)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        for m in self._mods:
            x = m(x)
        return x

    # ------------------------------------------------------------------ standalone use
    def fit(self, x: torch.Tensor, y: torch.Tensor, test_x: torch.Tensor | None = None,
            test_y: torch.Tensor | None = None) -> list[dict]:
        """Train all stages, re-fit the head, optionally fine-tune: :class:`mgrit.training.Trainer`
        over :attr:`plan` (global batches of ``batch_size`` drawn with ``seed``; the replicas
        of ``data_comm``).

        Args:
            x: training inputs ``(n, *in_shape)`` in the layers' dtype; y: int64 labels ``(n,)``
                (float targets ``(n, D)`` with ``loss="mse"``, cast to the layers' dtype).
            test_x, test_y: optional test set, evaluated after every epoch (on cached features).

        Returns:
            :attr:`history`: one dict per epoch ``{"stage": k | "head" | "finetune", "epoch",
            "loss", "train_acc", "test_acc", "test_loss" (None without a test set), "time"
            (seconds)}``; accuracies are None for MSE.

        Raises:
            ValueError: targets of the wrong dtype or shape for :attr:`loss` (before any
                communication).
        """
        y = self._checked(y, "y")
        test_y = None if test_y is None else self._checked(test_y, "test_y")
        comm = MPI.COMM_SELF if self.data_comm is None else self.data_comm
        grid = ProcessGrid(comm, data_parallel=comm.Get_size())
        try:
            trainer = Trainer(self, None, grid, callbacks=[StageLog(self)],
                              eval_batch_size=self.cache_batch_size, loss=self.loss_function)
            trainer.fit((x, y), epochs=len(self.plan), batch_size=self.batch_size,
                        seed=self.seed, test=None if test_x is None else (test_x, test_y))
        finally:
            grid.free()
        return self.history

    def _checked(self, y, what: str) -> torch.Tensor:
        y = torch.as_tensor(y)
        check_targets(y, self.loss, self.num_classes, what)
        return y.to(self.dtype) if self.loss == "mse" else y

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """``{"loss", "acc"}`` of the combined network on ``x, y`` (recomputes all layers):
        cross-entropy and accuracy, or with ``loss="mse"`` the MSE (over samples and outputs)
        and ``acc`` None.

        Raises:
            ValueError: ``y`` not targets of :attr:`loss`."""
        y = self._checked(y, "y")
        net = self.network
        training = net.training
        net.eval()
        with torch.no_grad():
            logits = torch.cat([net(x[i:i + self.cache_batch_size])
                                for i in range(0, len(x), self.cache_batch_size)])
        net.train(training)
        if self.loss == "mse":
            return {"loss": float(F.mse_loss(logits, y)), "acc": None}
        return {"loss": float(F.cross_entropy(logits, y)), "acc": accuracy(logits, y)}
