"""layerpar's layer-parallel core: nonlinear MGRIT with FAS (:mod:`mgrit.solver`), adjoint
MGRIT for gradients, layer-parallel networks (:mod:`mgrit.nn`), data-parallel and hybrid grids
(:mod:`mgrit.parallel`), training (:mod:`mgrit.training`) and the performance model
(:mod:`mgrit.perf`). Importing ``mgrit`` alone imports nothing heavy; import the subpackages.
"""

from ._moved import install as _install_moved
from ._torchcheck import check as _check_torch
from ._version import __version__

_check_torch()  # an untested torch is refused (docs/torch_internals.rst)
_install_moved()  # old import paths of moved modules and names (mgrit/_moved.py)

__all__ = ["__version__"]
