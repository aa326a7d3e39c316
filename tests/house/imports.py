"""The import graph of the project's packages, read from the source with :mod:`ast` (no module
is imported, no code runs), and the checks of the house rules on it (``tests/house/
test_architecture.py`` holds the floors table and runs them).

* :func:`scan` parses every ``.py`` under the given top-level packages and returns one
  :class:`Import` per import: ``import a.b``, ``from a import b`` (``a.b`` when ``a/b.py`` or
  ``a/b/`` exists, else ``a``), relative imports resolved against the importing module's
  package, and ``importlib.import_module("a.b")`` with a literal name. Imports inside
  functions and methods count (a lazy upward import is still upward); imports under
  ``if TYPE_CHECKING:`` do not (annotations only: nothing is imported when the code runs).
  Imports of anything outside the scanned packages (torch, numpy, ...) are dropped.
* A module's *package* is the directory it lives in, dotted (``mgrit/solver.py`` ->
  ``mgrit``, ``mgrit/nn/resnet.py`` -> ``mgrit.nn``, ``mgrit/nn/__init__.py`` -> ``mgrit.nn``).
* :func:`upward` -- imports whose target package sits on a higher floor than the importer's,
  and imports from or of a package that has no floor (a new package must be given one).
* :func:`circles` -- strongly connected components with more than one member (Tarjan) of the
  package graph, or of the module graph (``modules=True``; importing a package is importing its
  ``__init__``). A package's ``__init__.py`` re-exporting its own sub-modules and sub-packages
  is not an edge (``mgrit.nn`` gathering ``mgrit.nn.steps`` is aggregation, not a
  dependency); every other import is.
* :func:`unplaced` -- scanned packages without a floor.
* :func:`oversize` -- package directories with more than ``max_modules`` modules (``.py``
  files other than ``__init__.py``/``__main__.py``) and modules longer than ``max_lines``.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

__all__ = ["Import", "scan", "module_name", "package_of", "floor_of", "upward", "circles",
           "unplaced", "oversize"]


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``module`` (dotted) imports ``target`` (dotted, as
    written) at ``line`` of ``path``; ``target_module`` is the scanned module that runs (the
    package's ``__init__`` when ``target`` names a package or a name inside one);
    ``package`` / ``target_package`` are the rooms on both ends."""
    module: str
    package: str
    target: str
    target_module: str
    target_package: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.target}"


def module_name(root: Path, path: Path) -> str:
    """``mgrit/nn/resnet.py`` -> ``mgrit.nn.resnet``; ``mgrit/nn/__init__.py`` -> ``mgrit.nn``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(root: Path, path: Path) -> str:
    """The dotted directory a module file lives in (its room)."""
    return ".".join(path.relative_to(root).parent.parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (their ``else``
    branches run, so they are kept)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve_relative(base_package: str, level: int, module: str | None) -> str:
    parts = base_package.split(".") if base_package else []
    if level - 1 > len(parts):
        raise ValueError(f"relative import beyond the top level from {base_package!r}")
    parts = parts[:len(parts) - (level - 1)]
    if module:
        parts += module.split(".")
    return ".".join(parts)


def _targets(node: ast.AST, this_package: str, exists) -> list[str]:
    """Dotted names a node imports (empty for nodes that are not imports)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            # a module's relative base is its package; a package's __init__ is its own base
            base = _resolve_relative(this_package, node.level, node.module)
        else:
            base = node.module or ""
        out = []
        for a in node.names:
            sub = f"{base}.{a.name}" if base else a.name
            out.append(sub if a.name != "*" and exists(sub) else base)
        return out
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name == "import_module":
            return [node.args[0].value]
    return []


def scan(root: Path, tops: Sequence[str]) -> tuple[list[Import], dict[str, Path]]:
    """Parse every ``.py`` file under ``root/<top>`` for each of ``tops``. Returns the internal
    imports and every scanned module's file (dotted name -> path)."""
    root = Path(root)
    files = sorted(p for t in tops if (root / t).is_dir() for p in (root / t).rglob("*.py"))
    modules = {module_name(root, p): p for p in files}
    packages = {package_of(root, p) for p in files}

    def exists(dotted: str) -> bool:
        return dotted in modules or dotted in packages

    def target_package(dotted: str) -> str:
        if dotted in packages:  # the package itself (its __init__)
            return dotted
        if dotted in modules:
            return package_of(root, modules[dotted])
        # an unknown name under a scanned package (a typo, or a module not yet written):
        # its longest existing parent
        parts = dotted.split(".")
        while parts and ".".join(parts) not in packages:
            parts.pop()
        return ".".join(parts)

    edges = []
    for name, path in modules.items():
        pkg = package_of(root, path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _statements(tree):
            for t in _targets(node, pkg, exists):
                if t.split(".")[0] not in tops:
                    continue
                tp = target_package(t)
                edges.append(Import(name, pkg, t, t if exists(t) else tp, tp,
                                    str(path.relative_to(root)), node.lineno))
    return edges, modules


def floor_of(package: str, floors: Mapping[str, int]) -> int | None:
    """The floor of ``package``: an exact entry, or the nearest ``parent.*`` entry (a room whose
    sub-packages share its floor). None: the package has no floor."""
    if package in floors:
        return floors[package]
    parts = package.split(".")
    for i in range(len(parts) - 1, 0, -1):
        star = ".".join(parts[:i]) + ".*"
        if star in floors:
            return floors[star]
    return None


def upward(edges: Iterable[Import], floors: Mapping[str, int]) -> dict[str, str]:
    """Imports that go to a higher floor, or from or to a package with no floor:
    ``{"module -> target": message}`` (the message names the file and line)."""
    out = {}
    for e in edges:
        lo, hi = floor_of(e.package, floors), floor_of(e.target_package, floors)
        if lo is None:
            why = f"package {e.package} has no floor"
        elif hi is None:
            why = f"package {e.target_package} has no floor"
        elif hi > lo:
            why = f"{e.package} (floor {lo}) imports {e.target_package} (floor {hi})"
        else:
            continue
        out.setdefault(f"{e.module} -> {e.target}", f"{e}: {why}")
    return out


def _graph(edges: Iterable[Import], modules: bool) -> dict[str, dict[str, Import]]:
    """Package graph (``modules=False``) or module graph (a package's import is an import of
    its ``__init__``, named as the package). A package's ``__init__`` re-exporting its own
    sub-modules and sub-packages is not an edge."""
    graph: dict[str, dict[str, Import]] = {}
    for e in edges:
        if e.module == e.package and e.target_module.startswith(e.package + "."):
            continue  # an __init__ gathering its own room
        a, b = (e.module, e.target_module) if modules else (e.package, e.target_package)
        if a == b:
            continue
        graph.setdefault(a, {}).setdefault(b, e)
        graph.setdefault(b, {})
    return graph


def circles(edges: Iterable[Import], modules: bool = False) -> dict[str, str]:
    """Import circles between packages (``modules=True``: between modules):
    ``{"a <-> b <-> c": message}``, the message naming one import per edge of the circle."""
    graph = _graph(edges, modules)
    index, low, on, stack, comps = {}, {}, set(), [], []

    def visit(v):  # Tarjan's strongly connected components (graphs here are small)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = {}
    for comp in sorted(comps):
        why = [str(graph[a][b]) for a in comp for b in sorted(graph[a]) if b in comp]
        out[" <-> ".join(comp)] = "; ".join(why)
    return out


def unplaced(modules: Mapping[str, Path], root: Path, floors: Mapping[str, int]) -> list[str]:
    """Every scanned package that has no floor (also one that imports nothing and that no one
    imports yet)."""
    pkgs = {package_of(Path(root), p) for p in modules.values()}
    return sorted(p for p in pkgs if floor_of(p, floors) is None)


def oversize(modules: Mapping[str, Path], root: Path, max_modules: int = 15,
             max_lines: int = 400) -> dict[str, str]:
    """Package directories with more than ``max_modules`` modules and modules with more than
    ``max_lines`` lines: ``{"package p" or "module m": message}``."""
    count: dict[str, int] = {}
    out = {}
    for name, path in modules.items():
        if path.name not in ("__init__.py", "__main__.py"):
            pkg = package_of(Path(root), path)
            count[pkg] = count.get(pkg, 0) + 1
        n = len(path.read_text().splitlines())
        if n > max_lines:
            out[f"module {name}"] = f"{n} lines (> {max_lines})"
    out.update({f"package {p}": f"{n} modules (> {max_modules})" for p, n in count.items()
                if n > max_modules})
    return out
