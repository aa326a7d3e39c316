"""Old import paths kept working for one deprecation period (until 0.3.0): :data:`MODULES` (a
module that moved: old path -> new path) and :data:`NAMES` (a name that left its module: old
module -> {name: new module}) are the one table of every move since 0.1.0 (``CHANGELOG.md``
lists them with the removals). Each old import works and warns with a ``DeprecationWarning``
naming the new home; ``python -m <old module>`` runs the new one.

* an old module path gives the new module itself, or, when names also left it, a view of the
  new module that also answers those names;
* a module that still exists but lost names answers them through a module ``__getattr__``
  (PEP 562) added when it is imported (``layerwise`` sets it itself: it is imported before this
  finder is installed).

No library module imports through these paths (``tests/house`` reads the imports from the
source); the finder only answers a user's old import. Installed by ``import mgrit``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

__all__ = ["MODULES", "NAMES", "MOVED", "install", "module_getattr"]

#: old module path -> new module path
MODULES = {
    # 0.1.0 rounds, house step 1 (80393df): sub-packages parallel, training, perf
    "mgrit.procgrid": "mgrit.parallel.procgrid",
    "mgrit.dataparallel": "mgrit.parallel.dataparallel",
    "mgrit.gradbuckets": "mgrit.parallel.gradbuckets",
    "mgrit.checkpoint": "mgrit.training.checkpoint",
    "mgrit.faults": "mgrit.training.support.faults",
    "mgrit.guard": "mgrit.training.guard",
    # layer-wise training in the one Trainer loop (76e86c8)
    "layerwise.replicas": "mgrit.parallel.replicas",
    # issue 26 (7b3fd62): model zoo, multilevel algorithms, the main job's package layerpar
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
    # mgrit.nn in rooms (bfadd33); steps, chains, resnet and gru became packages that
    # re-export what their old modules exported
    "mgrit.nn.agreement": "mgrit.nn.chains.agreement",
    "mgrit.nn.compiled": "mgrit.nn.chains.compiled",
    "mgrit.nn.contract": "mgrit.nn.chains.contract",
    "mgrit.nn.stacking": "mgrit.nn.chains.stacking",
    "mgrit.nn.gru_bridge": "mgrit.nn.gru.bridge",
    "mgrit.nn.gru_chains": "mgrit.nn.gru.chains",
    "mgrit.nn.gru_classifier": "mgrit.nn.gru.classifier",
    "mgrit.nn.bridge": "mgrit.nn.resnet.bridge",
    "mgrit.nn.controls": "mgrit.nn.resnet.controls",
    "mgrit.nn.pipelined": "mgrit.nn.resnet.pipelined",
    "mgrit.nn.seeding": "mgrit.nn.resnet.seeding",
    "mgrit.nn.tied": "mgrit.nn.resnet.tied",
    "mgrit.nn.batchnorm": "mgrit.nn.steps.batchnorm",
    "mgrit.nn.stochastic": "mgrit.nn.steps.stochastic",
    "mgrit.nn.transformer": "mgrit.nn.steps.transformer",
    # issue 26, house step 2 (30a42b4): mgrit.training's sub-rooms
    "mgrit.training.checkpoint_io": "mgrit.training.checkpoint.io",
    "mgrit.training.ckpt_match": "mgrit.training.checkpoint.match",
    "mgrit.training.bias_estimate": "mgrit.training.bias.estimate",
    "mgrit.training.faults": "mgrit.training.support.faults",
    "mgrit.training.nets": "mgrit.training.support.nets",
    "mgrit.training.solvers": "mgrit.training.support.solvers",
    # issue 39: the results writers go to the reporting floor
    "mgrit.training.report": "mgrit.reporting.writers",
}

_STEPTIME = "mgrit.perf.steptime"
_INSTRUMENT = {"instrument_resnet": "mgrit.training.support.solvers",
               "instrument_solver": "mgrit.training.support.solvers"}
#: old module path -> {name: new module path} (names that left a module that was, or still is,
#: importable under the old path)
NAMES = {
    "layerwise": {"ReplicaSync": "mgrit.parallel.replicas",
                  "SYNC_TYPES": "mgrit.parallel.replicas"},
    "mgrit.training": {"EpochRecord": "mgrit.training.records",
                       "FitPlan": "mgrit.training.records"},
    "mgrit.faults": dict(_INSTRUMENT),
    "mgrit.training.faults": dict(_INSTRUMENT),
    "mgrit.training.nets": {"instrument": "mgrit.training.support.solvers",
                            "replace_solver": "mgrit.training.support.solvers",
                            "solver_states": "mgrit.training.support.solvers"},
    "mgrit.training.transformer_models": {"LANGUAGE_MODELS": "mgrit.models.registry"},
    "mgrit.nn.resnet.segment": {"layer_seed": "mgrit.nn.resnet.seeding",
                                "serial_resnet": "mgrit.nn.resnet.seeding"},
    "mgrit.perf.model": {"Plan": "mgrit.perf.configs", "plan": "mgrit.perf.configs",
                         "scaling_table": "mgrit.perf.configs", "TrainCosts": _STEPTIME,
                         "n_levels": _STEPTIME, "one_level_exact": _STEPTIME,
                         "resnet_times": _STEPTIME, "training_times": _STEPTIME},
}

#: the module table under its issue-26 name
MOVED = MODULES


def _internal(filename: str) -> bool:
    return (filename == __file__ or filename.startswith("<frozen importlib")
            or filename.replace("\\", "/").endswith(("importlib/__init__.py",
                                                      "importlib/_bootstrap.py",
                                                      "importlib/_bootstrap_external.py")))


def _bootstrap(filename: str) -> bool:
    return "importlib" in filename and "_bootstrap" in filename


def _warn(old: str, new: str) -> None:
    """The DeprecationWarning, attributed to the user's import line (the first frame outside
    this module and the import machinery), so Python's default filters show it in a script."""
    frame, level = sys._getframe(0), 1
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
        if frame is not None and not _bootstrap(frame.f_code.co_filename):
            level += 1  # warnings.warn itself skips the import machinery's frames
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes in 0.3.0)",
                  DeprecationWarning, stacklevel=level)


def _moved_name(modname: str, name: str):
    new = NAMES.get(modname, {}).get(name)
    if new is None:
        return None
    _warn(f"{modname}.{name}", f"{new}.{name}")
    return getattr(importlib.import_module(new), name)


def module_getattr(modname: str, fallback=None):
    """A PEP 562 ``__getattr__`` for module ``modname`` answering its moved names (then
    ``fallback``, else ``AttributeError``)."""
    def __getattr__(name: str):
        if name in NAMES.get(modname, {}):
            return _moved_name(modname, name)
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {modname!r} has no attribute {name!r}")
    return __getattr__


class _View(types.ModuleType):
    """An old module path whose module moved and lost names: the new module's attributes, and
    the moved names."""

    def __init__(self, old: str, new: types.ModuleType):
        super().__init__(old, new.__doc__)
        object.__setattr__(self, "_new", new)

    def __getattr__(self, name):
        new = object.__getattribute__(self, "_new")
        if name in NAMES.get(self.__name__, {}):
            return _moved_name(self.__name__, name)
        return getattr(new, name)

    def __setattr__(self, name, value):  # monkeypatching reaches the real module
        if name.startswith("__") and name.endswith("__"):
            object.__setattr__(self, name, value)
        else:
            setattr(object.__getattribute__(self, "_new"), name, value)

    def __dir__(self):
        return sorted(set(dir(object.__getattribute__(self, "_new")))
                      | set(NAMES.get(self.__name__, {})))


class _Alias(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        _warn(self.old, self.new)
        mod = importlib.import_module(self.new)
        return _View(self.old, mod) if self.old in NAMES else mod

    def exec_module(self, module) -> None:
        pass

    def get_code(self, fullname):
        """For ``python -m <old path>``: run the new module as ``__main__``."""
        return compile(f"import runpy; runpy.run_module({self.new!r}, run_name='__main__', "
                       f"alter_sys=True)", f"<{self.old} -> {self.new}>", "exec")

    def is_package(self, fullname) -> bool:
        return False


class _AddNames(importlib.abc.Loader):
    """Loads a module that still exists as usual, then gives it the ``__getattr__`` of its
    moved names."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__getattr__ = module_getattr(self._name, module.__dict__.get("__getattr__"))

    def __getattr__(self, name):  # get_code, get_source, is_package, ... of the real loader
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        new = MODULES.get(name)
        if new is not None:
            return importlib.util.spec_from_loader(name, _Alias(name, new))
        if name in NAMES:
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _AddNames(spec.loader, name)
            return spec
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
