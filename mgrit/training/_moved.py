"""The old import paths of modules that left :mod:`mgrit.training` in issue 26 (the house's
second step), kept working: ``import mgrit.training.export`` (and ``python -m
mgrit.training.export``) gives the module at its new path with a ``DeprecationWarning``.

No module of the library imports through these names (``tests/house`` checks the imports
from the source); the finder only answers a user's old import, so the runtime does not depend
on the packages above it. :data:`MOVED` is the one table, old path -> new path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "install"]

#: old path -> new path (modules that were documented or imported by users' scripts)
MOVED = {
    "mgrit.training.export": "layerpar.export",
    "mgrit.training.job": "layerpar.job",
    "mgrit.training.jobconfig": "layerpar.jobconfig",
    "mgrit.training.flags": "layerpar.flags",
    "mgrit.training.cli": "layerpar.cli",
    "mgrit.training.runfolder": "layerpar.runfolder",
    "mgrit.training.models": "mgrit.models",
    "mgrit.training.cifar_models": "mgrit.models.cifar",
    "mgrit.training.transformer_models": "mgrit.models.transformer",
    "mgrit.training.transformer_parts": "mgrit.models.transformer_parts",
    "mgrit.training.recurrent_models": "mgrit.models.recurrent",
    "mgrit.training.lm": "mgrit.models.lm",
    "mgrit.training.mgopt": "mgrit.multilevel.mgopt",
    "mgrit.training.mgopt_options": "mgrit.multilevel.mgopt_options",
    "mgrit.training.multilevel_init": "mgrit.multilevel.initialization",
    "mgrit.training.checkpoint_io": "mgrit.training.checkpoint.io",
    "mgrit.training.ckpt_match": "mgrit.training.checkpoint.match",
    "mgrit.training.bias_estimate": "mgrit.training.bias.estimate",
    "mgrit.training.faults": "mgrit.training.support.faults",
    "mgrit.training.nets": "mgrit.training.support.nets",
    "mgrit.training.solvers": "mgrit.training.support.solvers",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        warnings.warn(f"{self.old} moved to {self.new} (issue 26); import it from there",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        pass

    def get_code(self, fullname):
        """For ``python -m <old path>``: run the new module as ``__main__``."""
        return compile(f"import runpy; runpy.run_module({self.new!r}, run_name='__main__', "
                       f"alter_sys=True)", f"<{self.old} -> {self.new}>", "exec")

    def is_package(self, fullname) -> bool:
        return False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        new = MOVED.get(name)
        return None if new is None else importlib.util.spec_from_loader(name, _Alias(name, new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
