"""layerpar's layer-parallel core: nonlinear MGRIT with FAS (:mod:`mgrit.solver`), adjoint
MGRIT for gradients, layer-parallel networks (:mod:`mgrit.nn`), data-parallel and hybrid grids
(:mod:`mgrit.parallel`), training (:mod:`mgrit.training`) and the performance model
(:mod:`mgrit.perf`). Importing ``mgrit`` alone imports nothing heavy; import the subpackages.
"""

from ._version import __version__

__all__ = ["__version__"]
