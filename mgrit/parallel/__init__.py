"""Parallel machinery shared by both training families: the process grid (layer-parallel x
data-parallel ranks) and data-parallel gradient averaging in persistent flat buffers.

Public names: :class:`ProcessGrid`, :func:`device_for_rank`, :class:`GradientBuckets`,
:func:`average_gradients`, :func:`broadcast_parameters`, :func:`check_replicas_consistent`,
:class:`ReplicaSync` (BatchNorm statistics over the global batch of all replicas),
:func:`refuse_unsynchronized` (a clear error for other modules whose buffers change in forward)
and :func:`clip_grad_norm_` (global-norm gradient clipping over the layer x data grid).

Depends on torch, mpi4py and :mod:`mgrit.comm` only; never on the MGRIT solver, :mod:`mgrit.nn`
or :mod:`mgrit.training` (layer-wise training uses it without MGRIT). Communicates only on the
communicators passed in (the grid splits the one it is given).
"""
from .dataparallel import (GradientBuckets, average_gradients, broadcast_parameters,
                           check_replicas_consistent)
from .clipping import clip_grad_norm_
from .procgrid import ProcessGrid, device_for_rank
from .replicas import ReplicaSync, refuse_unsynchronized

__all__ = ["ProcessGrid", "device_for_rank", "GradientBuckets", "average_gradients",
           "broadcast_parameters", "check_replicas_consistent", "ReplicaSync",
           "refuse_unsynchronized", "clip_grad_norm_"]
