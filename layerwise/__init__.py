"""Decoupled layer-wise training (import layerwise).

* :mod:`layerwise.heads` -- auxiliary heads (``make_head``) and ``ResidualStep``.
* :mod:`layerwise.sequential` -- Kim 2019 sequential layer-by-layer training.
* :mod:`layerwise.decoupled` -- DGL stages (Belilovsky et al. 2020) and the single-process loop.
* :mod:`layerwise.pipeline` -- DGL pipelined over MPI ranks (stages x replicas).
* :mod:`layerwise.evaluate` -- combined-network evaluation and head ensembling.
* :func:`train_layerwise` -- entry function of the main job (``--method sequential|decoupled``).
"""
from .common import OPTIMIZERS, global_batches, shard, split_stages
from .decoupled import DecoupledModel, DecoupledTrainer, stage_step
from .evaluate import evaluate
from .heads import HEAD_KINDS, ResidualStep, check_head_fits, make_head
from .pipeline import DecoupledPipeline
from .sequential import GROW_MODES, SequentialTrainer
from .train import METHODS, train_layerwise

__all__ = ["OPTIMIZERS", "HEAD_KINDS", "GROW_MODES", "METHODS", "make_head", "check_head_fits",
           "ResidualStep", "split_stages", "global_batches", "shard", "DecoupledModel",
           "DecoupledTrainer", "stage_step", "DecoupledPipeline", "SequentialTrainer", "evaluate",
           "train_layerwise"]
