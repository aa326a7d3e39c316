"""Decoupled layer-wise training (import layerwise), run by the library's training loop
(:class:`mgrit.training.Trainer`): both methods are
:class:`~mgrit.training.method.TrainingMethod` objects.

* :mod:`layerwise.heads` -- auxiliary heads (``make_head``) and ``ResidualStep``.
* :mod:`layerwise.sequential` -- sequential layer-by-layer training, our reading of Kim 2019
  (``SequentialTrainer``: the schedule of stages), with :mod:`layerwise.stages` (entering and
  finishing a stage) and :mod:`layerwise.features` (the cached outputs of its frozen layers).
* :mod:`layerwise.decoupled` -- DGL stages (Belilovsky et al. 2020) and the single-process
  reference loop (``DecoupledTrainer``).
* :mod:`layerwise.pipeline` -- DGL pipelined over MPI ranks (stages x replicas;
  ``DecoupledPipeline``), with :mod:`layerwise.messages` (its point-to-point messages) and
  :mod:`layerwise.pipeline_eval` (its evaluation).
* :mod:`layerwise.evaluate` -- combined-network evaluation and head ensembling.
* :mod:`layerwise.train` -- :func:`build_method` (the method of ``--method
  sequential|decoupled``) and :func:`train_layerwise` (it in the Trainer, results as a dict).

Both methods train classification (``loss="cross_entropy"``, int64 labels) or regression
(``loss="mse"``, float targets ``(n, D)``; :data:`LOSSES`).

Data-parallel replicas use the shared pieces of :mod:`mgrit.parallel`: gradient averaging
(``GradientBuckets``) and BatchNorm over the global batch with a guard against other
buffer-changing modules (:mod:`mgrit.parallel.replicas`). Nothing here uses the MGRIT solver.
"""
from mgrit._version import __version__

from .common import LOSSES, OPTIMIZERS, global_batches, shard, shard_loss, split_stages
from .decoupled import DecoupledModel, DecoupledTrainer, stage_step
from .evaluate import evaluate
from .heads import HEAD_KINDS, ResidualStep, check_head_fits, make_head
from .pipeline import DecoupledPipeline
from .sequential import GROW_MODES, SequentialTrainer
from .train import METHODS, build_method, train_layerwise

__all__ = ["LOSSES", "OPTIMIZERS", "HEAD_KINDS", "GROW_MODES", "METHODS", "make_head",
           "check_head_fits",
           "ResidualStep", "split_stages", "global_batches", "shard", "shard_loss",
           "DecoupledModel", "DecoupledTrainer", "stage_step", "DecoupledPipeline",
           "SequentialTrainer", "evaluate", "build_method", "train_layerwise"]

from mgrit._moved import module_getattr  # noqa: E402

__getattr__ = module_getattr(__name__)  # ReplicaSync, SYNC_TYPES: now in mgrit.parallel.replicas
