"""Decoupled layer-wise training (import layerwise).

* :mod:`layerwise.heads` -- auxiliary heads (``make_head``) and ``ResidualStep``.
* :mod:`layerwise.sequential` -- Kim 2019 sequential layer-by-layer training.
* :mod:`layerwise.decoupled` -- DGL stages (Belilovsky et al. 2020) and the single-process loop.
* :mod:`layerwise.pipeline` -- DGL pipelined over MPI ranks (stages x replicas).
* :mod:`layerwise.evaluate` -- combined-network evaluation and head ensembling.
* :mod:`layerwise.replicas` -- data-parallel replicas: BatchNorm over the global batch
  (``ReplicaSync``), refusal of other modules whose buffers change in forward.
* :func:`train_layerwise` -- entry function of the main job (``--method sequential|decoupled``).
"""
from .common import OPTIMIZERS, global_batches, shard, shard_loss, split_stages
from .decoupled import DecoupledModel, DecoupledTrainer, stage_step
from .evaluate import evaluate
from .heads import HEAD_KINDS, ResidualStep, check_head_fits, make_head
from .pipeline import DecoupledPipeline
from .replicas import SYNC_TYPES, ReplicaSync
from .sequential import GROW_MODES, SequentialTrainer
from .train import METHODS, train_layerwise

__all__ = ["OPTIMIZERS", "HEAD_KINDS", "GROW_MODES", "METHODS", "make_head", "check_head_fits",
           "ResidualStep", "split_stages", "global_batches", "shard", "shard_loss",
           "ReplicaSync", "SYNC_TYPES", "DecoupledModel",
           "DecoupledTrainer", "stage_step", "DecoupledPipeline", "SequentialTrainer", "evaluate",
           "train_layerwise"]
