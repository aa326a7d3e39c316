"""Spatial coarsening of the coarse MGRIT levels (space-time multigrid) for feature-map
states ``(batch, C, *spatial)``: :class:`SpatialCoarsening`; the built-in transfer matrices in
:mod:`mgrit.spatial.grids`. Solver level: imports nothing of :mod:`mgrit.nn`."""
from .coarsening import SpatialCoarsening, TransposedCoarsening, level_shapes

__all__ = ["SpatialCoarsening", "TransposedCoarsening", "level_shapes"]
