"""A GRU solved parallel in time by MGRIT (Moon & Cyr, ICLR 2022) (room ``gru`` of
:mod:`mgrit.nn`; imports the room ``chains`` (the backward agreement) and the solver core,
never ``steps``, ``resnet`` or the network modules).

* :mod:`mgrit.nn.gru.parallel`: :class:`ParallelGRU`, the hidden-state recurrence solved by
  MGRIT over the sequence dimension;
* :mod:`mgrit.nn.gru.chains`: the recurrence as forward and adjoint time chains;
* :mod:`mgrit.nn.gru.bridge`: the autograd node (adjoint solve and parameter gradients);
* :mod:`mgrit.nn.gru.classifier`: :class:`GRUSequenceClassifier`, a linear head on the last
  time rank, and :func:`image_rows`.
"""
from .classifier import GRUSequenceClassifier, image_rows
from .parallel import ParallelGRU

__all__ = ["ParallelGRU", "GRUSequenceClassifier", "image_rows"]
