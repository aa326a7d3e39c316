"""The house rules, checked from the source (``ast``: nothing is imported): no module imports a
package on a higher floor, no import circle between packages or between modules, every
package has a floor, no package directory above 15 modules, no module above 400 lines.

:data:`FLOORS` is the one table of the rooms (``docs/architecture.rst`` explains it). A new
package fails :func:`test_every_package_has_a_floor` until it is given a floor here.
:data:`KNOWN` lists the violations of the tree as it stands, each to be deleted by the change
that fixes it; an entry that no longer occurs fails too, so the list only shrinks.

The checks themselves are proven on synthetic trees (``tmp_path``): an upward import (at
module level, inside a function, relative), a circle, a package without a floor and an
oversized room each fail; ``if TYPE_CHECKING:`` imports and an ``__init__`` gathering its own
sub-packages do not.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.house import imports as house

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("data", "mgrit", "layerwise", "layerpar")

#: The floors, low to high: a package may import its own floor and the floors below, never a
#: floor above. ``room.*``: every sub-package of ``room`` sits on its floor (circles between
#: them still fail). Packages on one floor may import each other one way.
FLOORS = {
    "data": 0,               # data sets, readers, HDF5 cache, sharding
    "mgrit": 0,              # the solver core: modules directly in mgrit/
    "mgrit.reporting": 0,
    "mgrit.spatial": 0,      # spatial coarsening of the coarse MGRIT levels (solver level)    # results writers shared by the metrics and the experiments
    "mgrit.nn": 1,           # layer-parallel modules (steps, ResNet, nets, GRU, transformer)
    "mgrit.nn.*": 1,         # ... and its sub-rooms
    "mgrit.parallel": 2,     # process grid, gradient buckets, replica BatchNorm
    "mgrit.perf": 2,         # cost model, calibration, planner, baselines
    "mgrit.perf.*": 2,       # ... and its sub-rooms (trace: recording and replay of real runs)
    "mgrit.training": 3,     # the runtime: Trainer, callbacks, checkpoints, faults, guard, bias
    "mgrit.training.*": 3,   # ... and its sub-rooms (support, checkpoint, bias)
    "mgrit.models": 4,       # the model zoo (one registry table)
    "mgrit.multilevel": 4,   # MG/Opt, multilevel initialization
    "layerwise": 5,          # the layer-wise training family (a TrainingMethod of the runtime)
    "layerpar": 6,           # the main job's composition root: config, flags, run folder, wiring
}

#: The violations of the tree as it stands (none since issue 26; an entry must name a real one):
#: kind -> keys as the checks report them.
KNOWN: dict = {"upward": set(), "package circles": set(), "module circles": set(),
               "oversize": set()}


@pytest.fixture(scope="module")
def tree():
    return house.scan(ROOT, TOPS)


def _against_known(kind: str, found: dict) -> None:
    new = {k: v for k, v in found.items() if k not in KNOWN[kind]}
    gone = sorted(KNOWN[kind] - set(found))
    assert not new, f"{kind}:\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(new.items()))
    assert not gone, f"{kind} fixed: delete from KNOWN[{kind!r}]: {gone}"


def test_the_scan_sees_the_packages(tree):
    edges, modules = tree
    assert {"mgrit.solver", "mgrit.nn", "mgrit.training", "layerwise", "data"} <= set(modules)
    assert any(e.package == "layerwise" and e.target_package == "mgrit.training" for e in edges)


def test_every_package_has_a_floor(tree):
    assert house.unplaced(tree[1], ROOT, FLOORS) == []


def test_no_import_runs_upward(tree):
    _against_known("upward", house.upward(tree[0], FLOORS))


def test_no_circle_between_packages(tree):
    _against_known("package circles", house.circles(tree[0]))


def test_no_circle_between_modules(tree):
    _against_known("module circles", house.circles(tree[0], modules=True))


def test_rooms_and_modules_stay_small(tree):
    _against_known("oversize", house.oversize(tree[1], ROOT, max_modules=15, max_lines=400))


# -- the checks fail when they should: synthetic trees --------------------------------------
def _write(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


SYNTH_FLOORS = {"low": 0, "low.sub.*": 0, "low.sub": 0, "high": 1}


def _synth(tmp_path, files):
    base = {"low/__init__.py": "", "low/core.py": "import os\n", "high/__init__.py": "",
            "high/user.py": "from low import core\nfrom low.core import thing\n"}
    return house.scan(_write(tmp_path, {**base, **files}), ("low", "high"))


def test_synthetic_clean_tree_passes(tmp_path):
    edges, modules = _synth(tmp_path, {
        "low/typed.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:  # annotations only: not an import at run time
                from high.user import X
            """,
        "low/sub/__init__.py": "from low.sub.a import f  # gathering its own room\n",
        "low/sub/a.py": "from low import core\n"})
    assert {(e.module, e.target_package) for e in edges} >= {("high.user", "low"),
                                                            ("low.sub", "low.sub"),
                                                            ("low.sub.a", "low")}
    assert house.upward(edges, SYNTH_FLOORS) == {}
    assert house.circles(edges) == {} and house.circles(edges, modules=True) == {}
    assert house.unplaced(modules, tmp_path, SYNTH_FLOORS) == []


@pytest.mark.parametrize("source", [
    "import high.user\n",                                  # module level
    "def f():\n    from high import user\n    return user\n",  # lazy, inside a function
    "import importlib\nmod = importlib.import_module('high.user')\n",
])
def test_synthetic_upward_import_fails(tmp_path, source):
    edges, _ = _synth(tmp_path, {"low/bad.py": source})
    found = house.upward(edges, SYNTH_FLOORS)
    assert list(found) == ["low.bad -> high.user"] or list(found) == ["low.bad -> high"], found
    assert "low (floor 0) imports high (floor 1)" in next(iter(found.values()))
    # the same import is a package circle (high imports low)
    assert list(house.circles(edges)) == ["high <-> low"]


def test_synthetic_relative_upward_import_fails(tmp_path):
    edges, _ = _synth(tmp_path, {
        "low/sub/__init__.py": "", "low/sub/a.py": "from ... import high\n",
        "high/deep/__init__.py": "", "high/deep/b.py": "from ..user import x\n"})
    assert [(e.module, e.target, e.target_package) for e in edges
            if e.module in ("low.sub.a", "high.deep.b")] == [
        ("high.deep.b", "high.user", "high"), ("low.sub.a", "high", "high")]
    found = house.upward(edges, SYNTH_FLOORS)
    assert "low.sub.a -> high" in found
    assert "high.deep.b -> high.user" in found  # high.deep has no floor: it fails too


def test_synthetic_circles_fail(tmp_path):
    edges, _ = _synth(tmp_path, {
        "low/sub/__init__.py": "", "low/sub/a.py": "from low.sub2 import b\n",
        "low/sub2/__init__.py": "", "low/sub2/b.py": "def g():\n    import low.sub.a\n",
        "high/m1.py": "from high import m2\n", "high/m2.py": "from . import m1\n"})
    assert list(house.circles(edges)) == ["low.sub <-> low.sub2"]
    mods = house.circles(edges, modules=True)
    assert set(mods) == {"high.m1 <-> high.m2", "low.sub.a <-> low.sub2.b"}
    assert "high/m2.py:1: high.m2 imports high.m1" in mods["high.m1 <-> high.m2"]


def test_synthetic_unknown_package_fails(tmp_path):
    edges, modules = _synth(tmp_path, {"low/new/__init__.py": "", "low/new/x.py": "import os\n"})
    assert house.unplaced(modules, tmp_path, SYNTH_FLOORS) == ["low.new"]


def test_synthetic_oversize_fails(tmp_path):
    files = {f"high/m{i}.py": "x = 1\n" for i in range(4)}
    files["low/long.py"] = "x = 1\n" * 11
    _, modules = _synth(tmp_path, files)
    found = house.oversize(modules, tmp_path, max_modules=4, max_lines=10)
    assert found == {"package high": "5 modules (> 4)", "module low.long": "11 lines (> 10)"}
