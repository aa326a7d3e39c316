"""Layer-wise training through the library's training loop: :func:`build_method` (the
:class:`~mgrit.training.method.TrainingMethod` of ``--method sequential|decoupled``: a
:class:`~layerwise.sequential.SequentialTrainer` or a
:class:`~layerwise.pipeline.DecoupledPipeline`) and :func:`train_layerwise` (that method in
:class:`mgrit.training.Trainer`, results as a dict). The main job calls :func:`build_method`
and the Trainer with its own callbacks."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from mgrit.parallel.procgrid import ProcessGrid
from mgrit.training.callbacks import ConsoleLog
from mgrit.training.method import TrainingMethod
from mgrit.training.trainer import Trainer

from .common import (OPTIMIZERS, as_targets, as_tensor, check_float, check_int, check_loss,
                     module_dtype, no_nan, split_stages)
from .decoupled import DecoupledModel
from .heads import HEAD_KINDS, HeadSpec
from .pipeline import DecoupledPipeline
from .sequential import GROW_MODES, SequentialTrainer

__all__ = ["train_layerwise", "build_method", "METHODS"]

#: Methods handled here (``serial``/``mgrit`` belong to the main job).
METHODS = ("sequential", "decoupled")


def build_method(method: str, layers: Sequence[nn.Module], num_classes: int,
                 in_shape: Sequence[int], *, grid: ProcessGrid | None = None, epochs: int = 10,
                 optimizer: str = "sgd", lr: float = 0.05, momentum: float = 0.9,
                 weight_decay: float = 0.0, seed: int = 0, head: HeadSpec = "linear",
                 head_hidden: int = 64, num_stages: int | None = None,
                 stage_sizes: Sequence[int] | None = None, stages_per_rank: int | None = None,
                 asynchronous: bool = False, buffer_size: int = 16, grow: str = "top",
                 head_epochs: int | None = None, finetune_epochs: int = 0,
                 finetune_lr: float | None = None, cache_batch_size: int = 1024,
                 loss: str = "cross_entropy") -> TrainingMethod:
    """The training method of ``method`` for :class:`mgrit.training.Trainer` (arguments as
    in :func:`train_layerwise`; ``epochs``: per layer for ``sequential``, unused for
    ``decoupled``). Train it with ``Trainer(m, None, grid).fit(train, epochs=E, ...)`` where
    ``E = len(m.plan)`` for sequential training and the number of epochs for DGL; pass
    ``loss=m.loss_function`` to the Trainer so that its evaluation uses the method's loss
    (needed for ``loss="mse"``).

    Raises:
        ValueError: as :func:`train_layerwise` (every rank, before communicating).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed here: use one of {', '.join(METHODS)} "
                         f"('serial' and 'mgrit' are handled by the main job)")
    check_loss(loss)
    check_float("lr", lr)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not allowed: use one of {', '.join(OPTIMIZERS)}")
    if isinstance(head, str) and head not in HEAD_KINDS:
        raise ValueError(f"head={head!r} is not allowed: use one of {', '.join(HEAD_KINDS)} or a "
                         f"callable (in_shape, num_classes) -> nn.Module")
    layers = list(layers)
    if not layers or not all(isinstance(l, nn.Module) for l in layers):
        raise ValueError("layers must be a non-empty list of nn.Module")
    in_shape = tuple(in_shape)
    opt = dict(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if method == "sequential":
        if grid is not None and grid.layer_size != 1:
            raise ValueError(f"sequential training runs its stages one after another: use a grid "
                             f"of replicas only (data_parallel = world size), got {grid!r}")
        if grow not in GROW_MODES:
            raise ValueError(f"grow={grow!r} is not allowed: use one of {', '.join(GROW_MODES)}")
        return SequentialTrainer(
            layers, num_classes, in_shape, grow=grow, head=head, head_hidden=head_hidden,
            epochs_per_layer=check_int("epochs", epochs), head_epochs=head_epochs,
            finetune_epochs=finetune_epochs, finetune_lr=finetune_lr, seed=seed,
            data_comm=None if grid is None else grid.data_comm,
            cache_batch_size=cache_batch_size, loss=loss, **opt)
    spr = 1 if stages_per_rank is None else check_int("stages_per_rank", stages_per_rank)
    if grid is None:
        K = len(layers) if num_stages is None else check_int("num_stages", num_stages)
    else:
        K = grid.layer_size * spr if num_stages is None else check_int("num_stages", num_stages)
        split_stages(len(layers), K, stage_sizes)  # more stages than layers: say so first
        size = grid.comm.Get_size()
        if K % spr or (K // spr) * grid.data_size != size:
            raise ValueError(f"{size} ranks do not match num_stages={K} / stages_per_rank={spr} x "
                             f"replicas={grid.data_size}: need K divisible by stages_per_rank and "
                             f"world size = {K / spr:g} x {grid.data_size}")
    model = DecoupledModel(layers, num_classes, in_shape, num_stages=K, head=head,
                           stage_sizes=stage_sizes, head_hidden=head_hidden, seed=seed, loss=loss)
    return DecoupledPipeline(model, grid, stages_per_rank=None if grid is None else spr,
                             asynchronous=asynchronous, buffer_size=buffer_size, seed=seed, **opt)


class _Collect:
    """Trainer callback gathering :func:`train_layerwise`'s per-epoch lists."""

    def __init__(self, out: dict, method: TrainingMethod, test, eval_batch_size: int,
                 ensemble: bool):
        self.out, self.method, self.test = out, method, test
        self.eval_batch_size, self.ensemble = eval_batch_size, ensemble

    def on_epoch_end(self, trainer, rec) -> None:
        out, m = self.out, self.method
        out["epoch"].append(rec.epoch)
        out["loss"].append(rec.loss)
        out["train_acc"].append(rec.train_acc)
        out["test_acc"].append(no_nan(rec.test_acc))
        out["test_loss"].append(rec.test_loss)
        out["time"].append(rec.epoch_time)
        if isinstance(m, SequentialTrainer):
            out["stage"].append(m.plan[rec.epoch - 1])
            return
        out["stage_train_acc"].append(m.epoch_metrics["stage_train_acc"])
        ev = {}
        if self.ensemble and self.test is not None:  # one more pass: every head's accuracy
            ev = m.evaluate(*self.test, batch_size=self.eval_batch_size, ensemble=True)
        out["stage_test_acc"].append(ev.get("stage_acc"))
        out["ensemble_acc"].append(ev.get("ensemble_acc"))
        out["ensemble_loss"].append(ev.get("ensemble_loss"))


def train_layerwise(method: str, layers: Sequence[nn.Module], num_classes: int,
                    train_x: torch.Tensor | np.ndarray, train_y: torch.Tensor | np.ndarray,
                    test_x: torch.Tensor | np.ndarray | None = None,
                    test_y: torch.Tensor | np.ndarray | None = None, *,
                    grid: ProcessGrid | None = None, epochs: int = 10,
                    batch_size: int = 64, optimizer: str = "sgd", lr: float = 0.05,
                    momentum: float = 0.9, weight_decay: float = 0.0, seed: int = 0,
                    head: HeadSpec = "linear", head_hidden: int = 64,
                    num_stages: int | None = None, stage_sizes: Sequence[int] | None = None,
                    stages_per_rank: int | None = None, asynchronous: bool = False,
                    buffer_size: int = 16, ensemble: bool = False, grow: str = "top",
                    head_epochs: int | None = None, finetune_epochs: int = 0,
                    finetune_lr: float | None = None, eval_batch_size: int = 1024,
                    progress: bool = True, log: Callable[[str], None] | None = None,
                    loss: str = "cross_entropy") -> dict:
    """Train ``layers`` layer-wise in :class:`mgrit.training.Trainer` and return per-epoch
    metrics.

    Args:
        method: ``"sequential"`` (Kim 2019, :class:`~layerwise.sequential.SequentialTrainer`)
            or ``"decoupled"`` (DGL, Belilovsky et al. 2020,
            :class:`~layerwise.pipeline.DecoupledPipeline`; one process when ``grid`` is None).
        layers: the network as a list of blocks (``nn.Module``; e.g. Linear+ReLU, conv blocks,
            :class:`~layerwise.heads.ResidualStep`), identical on every rank (same seed), all of
            one dtype (float32 or float64); trained in place.
        num_classes: C, the number of classes; with ``loss="mse"`` the output dimension D.
        train_x, train_y, test_x, test_y: numpy arrays or tensors, ``(n, *in_shape)`` float and
            ``(n,)`` int labels (``loss="mse"``: float targets ``(n, D)``); inputs and float
            targets converted to the layers' dtype. The test set is optional.
        grid: :class:`mgrit.parallel.procgrid.ProcessGrid` (stages x replicas) or None (one process).
            ``sequential`` needs ``grid.layer_size == 1`` (replicas only).
        epochs: decoupled: epochs; sequential: epochs per layer (default 10).
        batch_size: global batch size, split over the replicas (default 64); every sample of
            every epoch is used.
        optimizer, lr, momentum, weight_decay: ``"sgd"`` (default) or ``"adam"``; one optimizer
            per stage.
        seed: batch order (``default_rng([seed, epoch])``, the ``data.GlobalBatchSampler``
            convention, epoch counted over the whole schedule) and head initialisation. Layers
            must be seeded by the caller.
        head, head_hidden: auxiliary head kind (``linear``, ``mlp``, ``pool``, ``conv``) or factory.
        num_stages: decoupled: K (default: ``grid.layer_size * stages_per_rank``, or one stage per
            layer without a grid). stage_sizes: layers per stage (default: even split).
        stages_per_rank: with a grid, K must equal ``layer ranks * stages_per_rank`` (default 1),
            i.e. world size = K / stages_per_rank x replicas.
        asynchronous, buffer_size: DGL replay-buffer variant (default off; 16 items).
        ensemble: decoupled: also evaluate every head and the ensemble of all heads after every
            epoch (one more pass over the test set per epoch).
        grow, head_epochs, finetune_epochs, finetune_lr: sequential options (``"top"`` or
            ``"before_output"``; head re-fit epochs, default ``epochs``; end-to-end fine-tuning
            epochs, default 0; its lr, default ``lr``).
        eval_batch_size: chunk size for evaluation and the feature cache (default 1024).
        progress: the loop's console line per epoch on rank 0 (default True); ``log``
            replaces ``print``.
        loss: every stage's loss (:data:`layerwise.common.LOSSES`): ``"cross_entropy"``
            (default; classification) or ``"mse"`` (regression: ``F.mse_loss``, the mean
            over samples and the D outputs; with replicas and unequal shards each replica's
            loss is its share ``F.mse_loss(out, y, reduction="sum") / D * R / global batch``,
            so the averaged gradients are the single-process ones). With ``"mse"`` every
            accuracy entry is None.

    Returns:
        ``{"method", "epoch", "loss", "train_acc", "test_acc", "test_loss", "time"}`` (lists,
        one entry per epoch of the loop; ``test_acc``/``test_loss`` None without a test set,
        accuracies None for MSE; ``time`` = seconds of
        training in the epoch, the slowest rank's), ``"result"`` (the Trainer's
        :class:`~mgrit.training.FitResult`), plus ``"stage"`` (sequential: layer index,
        ``"head"`` or ``"finetune"`` per epoch), ``"stage_train_acc"`` (decoupled; and with
        ``ensemble`` ``"stage_test_acc"``/``"ensemble_acc"``/``"ensemble_loss"`` (the last
        for MSE), else None entries), ``"final"`` (test-set metrics of the trained network:
        ``loss`` (the test MSE for ``"mse"``), ``acc`` (None for MSE); decoupled also
        ``stage_loss``/``stage_acc`` and with ``ensemble`` the ensemble's), ``"model"
        (:class:`DecoupledModel` or the combined ``nn.Sequential``; with a pipeline only this
        rank's stages are trained there), ``"trainer"`` (the method) and ``"state_dict"`` (the
        full trained model's state dict; with a pipeline on world rank 0 only, None elsewhere).

    Raises:
        ValueError: unknown method/head/optimizer/grow/loss; targets not of the loss (int64
            labels ``(n,)``; MSE: floats ``(n, num_classes)``); non-positive epochs, lr or
            batch size; more stages than layers; world size != stages / stages_per_rank x
            replicas; a head not fitting a stage's output shape. All raised on every rank
            before communicating.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed here: use one of {', '.join(METHODS)} "
                         f"('serial' and 'mgrit' are handled by the main job)")
    epochs = check_int("epochs", epochs)
    batch_size = check_int("batch_size", batch_size)
    check_int("eval_batch_size", eval_batch_size)
    layers = list(layers)
    if not layers or not all(isinstance(l, nn.Module) for l in layers):
        raise ValueError("layers must be a non-empty list of nn.Module")
    check_loss(loss)
    dtype = module_dtype(layers)
    x, y = as_tensor(train_x, dtype), as_targets(train_y, loss, num_classes, dtype, "train_y")
    test = None if test_x is None else \
        (as_tensor(test_x, dtype), as_targets(test_y, loss, num_classes, dtype, "test_y"))
    m = build_method(method, layers, num_classes, tuple(x.shape[1:]), grid=grid, epochs=epochs,
                     optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
                     seed=seed, head=head, head_hidden=head_hidden, num_stages=num_stages,
                     stage_sizes=stage_sizes, stages_per_rank=stages_per_rank,
                     asynchronous=asynchronous, buffer_size=buffer_size, grow=grow,
                     head_epochs=head_epochs, finetune_epochs=finetune_epochs,
                     finetune_lr=finetune_lr, cache_batch_size=eval_batch_size, loss=loss)
    sequential = isinstance(m, SequentialTrainer)
    out = {"method": method, "epoch": [], "loss": [], "train_acc": [], "test_acc": [],
           "test_loss": [], "time": []}
    out.update({"stage": []} if sequential else
               {"stage_train_acc": [], "stage_test_acc": [], "ensemble_acc": [],
                "ensemble_loss": []})
    own = grid is None and sequential  # a pipeline made its own 1 x 1 grid: m.grid
    if sequential:
        loop_grid = ProcessGrid(MPI.COMM_SELF) if own else grid
    else:
        loop_grid = m.grid
    callbacks = [_Collect(out, m, test, eval_batch_size, ensemble)]
    if progress:
        callbacks.append(ConsoleLog(prefix=f"[{method}]", print_fn=log))
    try:
        trainer = Trainer(m, None, loop_grid, callbacks=callbacks, eval_batch_size=eval_batch_size,
                          loss=m.loss_function)
        out["result"] = trainer.fit((x, y), epochs=len(m.plan) if sequential else epochs,
                                    batch_size=batch_size, seed=seed, test=test)
        if sequential:
            out["final"] = m.evaluate(*test) if test is not None else {}
            out.update(model=m.network, trainer=m, state_dict=m.network.state_dict())
        else:
            out["final"] = m.evaluate(*test, batch_size=eval_batch_size, ensemble=ensemble) \
                if test is not None else {}
            out.update(model=m.model, trainer=m, state_dict=m.full_state_dict())
    finally:
        if own:
            loop_grid.free()
    return out
