"""Entry function of the main job for ``--method sequential|decoupled``:
:func:`train_layerwise`."""
from __future__ import annotations

import time
from typing import Callable, Sequence

from torch import nn

from .common import (OPTIMIZERS, as_tensor, check_float, check_int, global_batches, module_dtype,
                     split_stages)
from .decoupled import DecoupledModel, DecoupledTrainer
from .heads import HEAD_KINDS, HeadSpec
from .pipeline import DecoupledPipeline
from .sequential import GROW_MODES, SequentialTrainer

__all__ = ["train_layerwise", "METHODS"]

#: Methods handled here (``serial``/``mgrit`` belong to the main job).
METHODS = ("sequential", "decoupled")


def train_layerwise(method: str, layers: Sequence[nn.Module], num_classes: int, train_x, train_y,
                    test_x=None, test_y=None, *, grid=None, epochs: int = 10,
                    batch_size: int = 64, optimizer: str = "sgd", lr: float = 0.05,
                    momentum: float = 0.9, weight_decay: float = 0.0, seed: int = 0,
                    head: HeadSpec = "linear", head_hidden: int = 64,
                    num_stages: int | None = None, stage_sizes: Sequence[int] | None = None,
                    stages_per_rank: int | None = None, asynchronous: bool = False,
                    buffer_size: int = 16, ensemble: bool = False, grow: str = "top",
                    head_epochs: int | None = None, finetune_epochs: int = 0,
                    finetune_lr: float | None = None, eval_batch_size: int = 1024,
                    progress: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Train ``layers`` layer-wise and return per-epoch metrics.

    Args:
        method: ``"sequential"`` (Kim 2019, :class:`~layerwise.sequential.SequentialTrainer`)
            or ``"decoupled"`` (DGL, Belilovsky et al. 2020; single-process
            :class:`~layerwise.decoupled.DecoupledTrainer` when ``grid`` is None, else the MPI
            :class:`~layerwise.pipeline.DecoupledPipeline`).
        layers: the network as a list of blocks (``nn.Module``; e.g. Linear+ReLU, conv blocks,
            :class:`~layerwise.heads.ResidualStep`), identical on every rank (same seed), all of
            one dtype (float32 or float64); trained in place.
        num_classes: C; the loss is cross-entropy on int64 labels.
        train_x, train_y, test_x, test_y: numpy arrays or tensors, ``(n, *in_shape)`` float and
            ``(n,)`` int labels; converted to the layers' dtype. The test set is optional.
        grid: :class:`mgrit.parallel.procgrid.ProcessGrid` (stages x replicas) or None (one process).
            ``sequential`` needs ``grid.layer_size == 1`` (replicas only).
        epochs: decoupled: epochs; sequential: epochs per layer (default 10).
        batch_size: global batch size, split over the replicas (equal shards give exactly the
            single-process updates; default 64).
        optimizer, lr, momentum, weight_decay: ``"sgd"`` (default) or ``"adam"``; one optimizer
            per stage.
        seed: batch order (``default_rng([seed, epoch])``, the ``data.GlobalBatchSampler``
            convention) and head initialisation. Layers must be seeded by the caller.
        head, head_hidden: auxiliary head kind (``linear``, ``mlp``, ``pool``, ``conv``) or factory.
        num_stages: decoupled: K (default: ``grid.layer_size * stages_per_rank``, or one stage per
            layer without a grid). stage_sizes: layers per stage (default: even split).
        stages_per_rank: with a grid, K must equal ``layer ranks * stages_per_rank`` (default 1),
            i.e. world size = K / stages_per_rank x replicas.
        asynchronous, buffer_size: DGL replay-buffer variant (default off; 16 items).
        ensemble: also report the accuracy of the ensemble of all stage heads (decoupled).
        grow, head_epochs, finetune_epochs, finetune_lr: sequential options (``"top"`` or
            ``"before_output"``; head re-fit epochs, default ``epochs``; end-to-end fine-tuning
            epochs, default 0; its lr, default ``lr``).
        eval_batch_size: chunk size for evaluation (default 1024).
        progress: print one line per epoch on world rank 0 (default True); ``log`` replaces
            ``print``.

    Returns:
        ``{"method", "epoch", "loss", "train_acc", "test_acc", "time"}`` (lists, one entry per
        epoch; ``test_acc`` None without a test set; ``time`` = seconds of training in the
        epoch on this rank), plus ``"stage"`` (sequential: layer index, ``"head"`` or
        ``"finetune"`` per epoch), ``"stage_train_acc"``/``"stage_test_acc"``/``"ensemble_acc"``
        (decoupled), ``"final"`` (metrics of the trained network on the test set), ``"model"``
        (:class:`DecoupledModel` or the combined ``nn.Sequential``; with a pipeline only this
        rank's stages are trained there), ``"trainer"`` and ``"state_dict"`` (the full trained
        model's state dict; with a pipeline on world rank 0 only, None elsewhere).

    Raises:
        ValueError: unknown method/head/optimizer/grow; non-positive epochs, lr or batch size;
            more stages than layers; world size != stages / stages_per_rank x replicas; a head
            not fitting a stage's output shape. All raised on every rank before communicating.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed here: use one of {', '.join(METHODS)} "
                         f"('serial' and 'mgrit' are handled by the main job)")
    epochs = check_int("epochs", epochs)
    batch_size = check_int("batch_size", batch_size)
    check_int("eval_batch_size", eval_batch_size)
    check_float("lr", lr)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not allowed: use one of {', '.join(OPTIMIZERS)}")
    if isinstance(head, str) and head not in HEAD_KINDS:
        raise ValueError(f"head={head!r} is not allowed: use one of {', '.join(HEAD_KINDS)} or a "
                         f"callable (in_shape, num_classes) -> nn.Module")
    layers = list(layers)
    if not layers or not all(isinstance(l, nn.Module) for l in layers):
        raise ValueError("layers must be a non-empty list of nn.Module")
    dtype = module_dtype(layers)
    x, y = as_tensor(train_x, dtype), as_tensor(train_y).long()
    tx = None if test_x is None else as_tensor(test_x, dtype)
    ty = None if test_y is None else as_tensor(test_y).long()
    if len(x) != len(y) or (tx is not None and (ty is None or len(tx) != len(ty))):
        raise ValueError(f"inputs and labels differ in length: train {len(x)} vs {len(y)}"
                         + ("" if tx is None else f", test {len(tx)} vs "
                            f"{None if ty is None else len(ty)}"))
    in_shape = tuple(x.shape[1:])
    rank0 = grid is None or grid.comm.Get_rank() == 0
    say = log or print

    def report(i, rec):
        if progress and rank0:
            ta = "-" if rec.get("test_acc") is None else f"{rec['test_acc']:.4f}"
            extra = f" stage={rec['stage']}" if "stage" in rec else ""
            say(f"[{method}] epoch {i + 1}{extra} loss={rec['loss']:.4f} "
                f"train_acc={rec['train_acc']:.4f} test_acc={ta} time={rec['time']:.2f}s")

    out = {"method": method, "epoch": [], "loss": [], "train_acc": [], "test_acc": [], "time": []}
    if method == "sequential":
        if grid is not None and grid.layer_size != 1:
            raise ValueError(f"sequential training runs its stages one after another: use a grid "
                             f"of replicas only (data_parallel = world size), got {grid!r}")
        if grow not in GROW_MODES:
            raise ValueError(f"grow={grow!r} is not allowed: use one of {', '.join(GROW_MODES)}")
        out["stage"] = []
        trainer = SequentialTrainer(
            layers, num_classes, in_shape, grow=grow, head=head, head_hidden=head_hidden,
            optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
            epochs_per_layer=epochs, head_epochs=head_epochs, finetune_epochs=finetune_epochs,
            finetune_lr=finetune_lr, batch_size=batch_size, seed=seed,
            data_comm=None if grid is None else grid.data_comm, cache_batch_size=eval_batch_size,
            log=lambda rec: report(len(trainer.history) - 1, rec))
        for i, rec in enumerate(trainer.fit(x, y, tx, ty)):
            out["epoch"].append(i + 1)
            for key in ("loss", "train_acc", "test_acc", "time", "stage"):
                out[key].append(rec[key])
        out["final"] = trainer.evaluate(tx, ty) if tx is not None else {}
        out.update(model=trainer.network, trainer=trainer, state_dict=trainer.state_dict())
        return out

    # ------------------------------------------------------------------ decoupled
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
                           stage_sizes=stage_sizes, head_hidden=head_hidden, seed=seed)
    opt_kw = dict(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay,
                  asynchronous=asynchronous, buffer_size=buffer_size, seed=seed)
    replicas = 1 if grid is None else grid.data_size
    if grid is None:
        trainer = DecoupledTrainer(model, **opt_kw)
        train_epoch = trainer.train_epoch
        evaluate = lambda a, b: model.evaluate(a, b, batch_size=eval_batch_size, ensemble=ensemble)
    else:
        trainer = DecoupledPipeline(model, grid, stages_per_rank=spr, **opt_kw)
        train_epoch = trainer.train_epoch
        evaluate = lambda a, b: trainer.evaluate(a, b, batch_size=eval_batch_size, ensemble=ensemble)
    for key in ("stage_train_acc", "stage_test_acc", "ensemble_acc"):
        out[key] = []
    for e in range(epochs):
        batches = global_batches(len(x), batch_size, seed, e, replicas)
        t0 = time.perf_counter()
        rec = train_epoch(x, y, batches)
        rec["time"] = time.perf_counter() - t0
        ev = evaluate(tx, ty) if tx is not None else {}
        rec["test_acc"] = ev.get("acc")
        out["epoch"].append(e + 1)
        for key in ("loss", "train_acc", "test_acc", "time", "stage_train_acc"):
            out[key].append(rec[key])
        out["stage_test_acc"].append(ev.get("stage_acc"))
        out["ensemble_acc"].append(ev.get("ensemble_acc"))
        report(e, rec)
    out["final"] = ev if tx is not None else {}
    out.update(model=model, trainer=trainer,
               state_dict=model.state_dict() if grid is None else trainer.state_dict())
    return out
