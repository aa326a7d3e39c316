"""Old import paths (issues 26 and 39): every module and every public name that moved since
0.1.0 imports from its old path, with a DeprecationWarning naming its new home; names still at
home do not warn; ``python -m`` of an old module runs the new one. The table is
:mod:`mgrit._moved` (``MODULES``, ``NAMES``)."""
from __future__ import annotations

import importlib
import json
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import mgrit  # noqa: F401  (installs the finder)
from mgrit._moved import MODULES, NAMES

ROOT = Path(__file__).resolve().parents[2]


def _fresh(name: str) -> None:
    """Forget ``name`` so that its import runs (and warns) again."""
    sys.modules.pop(name, None)


def _import_warned(name: str):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mod = importlib.import_module(name)
    return mod, [w for w in seen if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(MODULES))
def test_old_module_path_imports_with_a_warning(old):
    _fresh(old)
    mod, warned = _import_warned(old)
    new = importlib.import_module(MODULES[old])
    assert any(MODULES[old] in str(w.message) and old in str(w.message) for w in warned), \
        [str(w.message) for w in warned]
    if old in NAMES:
        assert mod is not new and mod.__doc__ == new.__doc__
    else:
        assert mod is new
    public = getattr(new, "__all__", [n for n in vars(new) if not n.startswith("_")])
    for name in public:  # every public name of the new home, through the old path
        assert getattr(mod, name) is getattr(new, name), name


@pytest.mark.parametrize("old,name", sorted((m, n) for m, names in NAMES.items()
                                            for n in names))
def test_moved_name_imports_from_its_old_path(old, name):
    home = NAMES[old][name]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(old), name)  # `from old import name`
    assert value is getattr(importlib.import_module(home), name)
    assert any(issubclass(w.category, DeprecationWarning) and f"{home}.{name}" in str(w.message)
               for w in seen), [str(w.message) for w in seen]


def test_from_import_statement_of_a_moved_name():
    with pytest.warns(DeprecationWarning, match=r"mgrit\.training\.support\.solvers"):
        from mgrit.training.faults import instrument_resnet
    from mgrit.training.support.solvers import instrument_resnet as new
    assert instrument_resnet is new


def test_names_at_home_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from mgrit.training import Trainer  # noqa: F401
        from mgrit.parallel.replicas import ReplicaSync  # noqa: F401
        import layerwise
        assert layerwise.build_method


def test_old_paths_are_not_real_modules_and_new_ones_are():
    """An old module path is answered by the table only (a file there would shadow nothing:
    the finder comes first, so it would never load), and every target exists."""
    for old, new in MODULES.items():
        rel = Path(*old.split("."))
        assert not (ROOT / rel).with_suffix(".py").exists() and not (ROOT / rel).is_dir(), old
        assert importlib.util.find_spec(new) is not None, new
    for old, names in NAMES.items():
        for home in set(names.values()):
            assert importlib.util.find_spec(home) is not None, home


def test_old_module_runs_with_dash_m():
    p = subprocess.run([sys.executable, "-m", "mgrit.training.export", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "load_run(RUN_DIR)" in p.stdout, p.stdout + p.stderr


def test_unknown_names_are_still_errors():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mgrit.training.no_such_module")
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(importlib.import_module("mgrit.training.faults"), "no_such_name")
    with pytest.raises(AttributeError, match="no_such_name"):
        import layerwise
        getattr(layerwise, "no_such_name")


#: Public names that left the library (CHANGELOG.md, "Removed"): old module -> names.
REMOVED = {
    "mgrit.training.nets": {"blocks", "describe_solvers", "exact_tolerance", "net_meta",
                            "owned_points", "replicated_parameters", "segments",
                            "set_warm_states", "solver_options", "solver_results",
                            "solver_summary", "warm_states"},
    "mgrit.training.guenther": {"Problem", "lbfgs_armijo"},
    "mgrit.comm": {"abort_on_exception"},
    "mgrit.training.models": {"register"},
    "mgrit.perf.calibration": {"model_section"},
}
#: every public name (``__all__``, else the public top-level definitions) of every version of
#: every public library module in git since 0.1.0, by module path (generated once from
#: ``git log`` of mgrit/, layerwise/, layerpar/, data/; add a module's names when it moves)
HISTORY = Path(__file__).with_name("public_names_history.json")


def test_every_public_name_of_history_imports_from_its_path():
    """``from <module> import <name>`` works for every public name any version of the library
    had (through the table where it moved), unless the name was removed (REMOVED)."""
    history = json.loads(HISTORY.read_text())
    failed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for module, names in sorted(history.items()):
            gone = REMOVED.get(module, set())
            if set(names) <= gone:
                continue
            mod = importlib.import_module(module)
            failed += [f"{module}.{n}" for n in names if n not in gone and not hasattr(mod, n)]
    assert failed == [], failed
    stale = [f"{m}.{n}" for m, ns in REMOVED.items() for n in ns if n not in history.get(m, [])]
    assert stale == [], f"REMOVED names no module had: {stale}"


def test_warning_points_at_the_users_import_and_shows_by_default():
    """Attributed to the line of the user's script (``__main__``), so Python's default filters
    print it; also for a moved name."""
    code = ("import mgrit.training.report\n"
            "from mgrit.perf.model import Plan\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert ("<string>:1: DeprecationWarning: mgrit.training.report moved to "
            "mgrit.reporting.writers") in p.stderr, p.stderr
    assert ("<string>:2: DeprecationWarning: mgrit.perf.model.Plan moved to "
            "mgrit.perf.configs.Plan") in p.stderr, p.stderr
