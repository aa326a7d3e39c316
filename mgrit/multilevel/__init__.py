"""Multilevel optimization in depth: the network trained with coarser copies of itself (fewer
layers, larger step).

Modules: ``mgopt`` (:class:`MGOpt`, MG/Opt V-cycles, Nash 2000) + ``mgopt_options``
(:class:`MGOptOptions`, :class:`CycleRecord`), ``initialization`` (coarse-to-fine training in
depth of the main job's ``--multilevel-init``, Cyr, Guenther & Schroder 2019). The transfers in
depth they share (restriction, prolongation of weights) are :mod:`mgrit.nn.depth`.

Floor L4: imports the solver core, :mod:`mgrit.nn`, :mod:`mgrit.parallel` and the runtime
:mod:`mgrit.training` (records, metrics writer, faults); imported by the main job
(:mod:`layerpar`), experiments and tests.
"""
from .mgopt import MGOpt
from .mgopt_options import CycleRecord, MGOptOptions

__all__ = ["MGOpt", "MGOptOptions", "CycleRecord"]
