"""Parallel machinery shared by both training families: the process grid (layer-parallel x
data-parallel ranks) and data-parallel gradient averaging in persistent flat buffers.

Public names: :class:`ProcessGrid`, :func:`device_for_rank`, :class:`GradientBuckets`,
:func:`average_gradients`, :func:`broadcast_parameters`, :func:`check_replicas_consistent`,
:class:`ReplicaSync` (BatchNorm statistics over the global batch of all replicas) and
:func:`refuse_unsynchronized` (a clear error for other modules whose buffers change in forward).

Depends on torch, mpi4py and :mod:`mgrit.comm` only; never on the MGRIT solver, :mod:`mgrit.nn`
or :mod:`mgrit.training` (layer-wise training uses it without MGRIT). Communicates only on the
communicators passed in (the grid splits the one it is given).
"""
from .dataparallel import (GradientBuckets, average_gradients, broadcast_parameters,
                           check_replicas_consistent)
from .procgrid import ProcessGrid, device_for_rank
from .replicas import ReplicaSync, refuse_unsynchronized

__all__ = ["ProcessGrid", "device_for_rank", "GradientBuckets", "average_gradients",
           "broadcast_parameters", "check_replicas_consistent", "ReplicaSync",
           "refuse_unsynchronized"]
