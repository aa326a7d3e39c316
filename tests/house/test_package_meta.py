"""Package metadata: LICENSE matches setup.cfg, one version everywhere, the PEP 561 marker is
shipped, and a user's ``data.py`` shadowing the ``data`` package is one clear line."""

import configparser
import re
import subprocess
import sys
from pathlib import Path

import data
import layerwise
import mgrit
from mgrit._version import __version__

ROOT = Path(__file__).resolve().parents[2]


def test_license_version_and_typed_marker():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    meta = cfg["metadata"]
    assert meta["license"] == "MIT" and meta["license_files"] == "LICENSE"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n") and "Copyright (c) 2026 the layerpar developers" in text
    assert meta["version"] == "attr: mgrit._version.__version__"
    assert mgrit.__version__ == layerwise.__version__ == __version__
    assert data.__version__ in (__version__, "unknown")  # the installed metadata, if installed
    shipped = {k: v.strip() for k, v in cfg["options.package_data"].items()}
    for pkg in ("mgrit", "data", "layerwise"):
        assert shipped[pkg] == "py.typed" and (ROOT / pkg / "py.typed").is_file()


def test_user_data_py_shadowing_the_data_package_is_one_line(tmp_path):
    """A data.py (or a data/ package of one's own) in the working folder of
    ``python -c 'from mgrit.training import Trainer'`` is named in a one-line ImportError."""
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "data.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "data").mkdir(parents=True)
    (tmp_path / "pkg" / "data" / "__init__.py").write_text("")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    code = ("import sys\ntry:\n    from mgrit.training import Trainer\nexcept ImportError as e:\n"
            "    print(e); sys.exit(3)\n")
    for cwd, shadow in ((tmp_path / "own", tmp_path / "own" / "data.py"),
                        (tmp_path / "pkg", tmp_path / "pkg" / "data" / "__init__.py")):
        r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 3, r.stderr
        assert r.stdout == (f"{shadow} shadows layerpar's 'data' package (imported instead of it); "
                            f"rename that file/folder or run from another folder\n")


def test_public_api_of_data_layerwise_parallel_is_annotated():
    """Every parameter and return of the public functions and methods exported by ``data``,
    ``layerwise`` and ``mgrit.parallel`` carries a type hint (the PEP 561 marker promises it)."""
    import importlib
    import inspect

    missing = []
    for name in ("data", "layerwise", "mgrit.parallel"):
        mod = importlib.import_module(name)
        for export in mod.__all__:
            obj = getattr(mod, export)
            if inspect.isclass(obj) and obj.__module__.split(".")[0] in ("data", "layerwise", "mgrit"):
                fns = [(f"{export}.{k}", v.__func__ if isinstance(v, (staticmethod, classmethod)) else v)
                       for k, v in vars(obj).items() if not k.startswith("_") or k == "__init__"]
            else:
                fns = [(export, obj)]
            for label, fn in fns:
                if not inspect.isfunction(fn):
                    continue
                sig = inspect.signature(fn)
                bare = [p.name for p in sig.parameters.values() if p.name not in ("self", "cls")
                        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.annotation is p.empty]
                if bare or (sig.return_annotation is sig.empty and not label.endswith("__init__")):
                    missing.append(f"{name}.{label}: {bare or 'return'}")
    assert not missing, missing


def test_torch_range_is_the_tested_one_in_both_places():
    """setup.cfg's torch requirement is :data:`mgrit._torchcheck.TESTED`, the installed torch is
    in it, and the README's install line pins its lowest version."""
    from mgrit import _torchcheck
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = [r.strip() for r in cfg["options"]["install_requires"].split("\n") if r.strip()]
    (lo, hi) = (f"{a}.{b}" for a, b in _torchcheck.TESTED)
    assert f"torch>={lo},<{hi}" in reqs, reqs
    import torch
    assert _torchcheck.tested(torch.__version__), torch.__version__
    assert f"pip install torch=={lo}.0 -e '.[mpich,dev]'" in (ROOT / "README.md").read_text()


def test_untested_torch_is_refused_with_the_versions_named(monkeypatch):
    import warnings

    import pytest

    from mgrit import _torchcheck
    monkeypatch.delenv(_torchcheck.ALLOW_ENV, raising=False)
    for v in ("2.12.1", "2.14.0+cpu", "3.0.0", "2.1.0"):
        with pytest.raises(ImportError, match=rf"torch>=2\.13,<2\.14; torch {re.escape(v)} is installed"):
            _torchcheck.check(v)
    for v in ("2.13.0", "2.13.0+cpu", "2.13.1", "2.13.0a0+git1234"):
        _torchcheck.check(v)  # no error
    monkeypatch.setenv(_torchcheck.ALLOW_ENV, "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _torchcheck.check("2.14.0")
    assert any(issubclass(w.category, RuntimeWarning) and "docs/torch_internals.rst"
               in str(w.message) for w in seen)
