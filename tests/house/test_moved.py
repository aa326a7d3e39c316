"""Issue 26: the old import paths of modules that left ``mgrit.training`` still work (the same
module object as the new path, with a DeprecationWarning naming it), also ``python -m``."""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import mgrit.training  # noqa: F401  (installs the finder)
from mgrit.training._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module(old):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(MOVED[old])
    assert any(issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message)
               for w in seen), [str(w.message) for w in seen]


def test_old_module_runs_with_dash_m():
    p = subprocess.run([sys.executable, "-m", "mgrit.training.export", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "load_run(RUN_DIR)" in p.stdout, p.stdout + p.stderr


def test_unknown_names_are_still_errors():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mgrit.training.no_such_module")
