"""Package structure of data/: imports run one way (no circle, counting imports inside
functions too), and a module imports inside a function only a heavy optional package, with a
comment saying so."""

import ast
from pathlib import Path

import data

DATA = Path(data.__file__).parent
#: packages data/ may import lazily (heavy, needed by one data set each)
LAZY_OK = {"sklearn", "mlxtend"}


def _imports(path: Path):
    """``(lineno, target, local)`` for every import in ``path``; ``target`` is a data module
    name (``"datasets"``) for relative imports, else the top-level package."""
    tree = ast.parse(path.read_text())
    local_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                targets = [node.module] if node.module else [a.name for a in node.names]
                targets = ["data." + t.split(".")[0] for t in targets]
            else:
                targets = [node.module.split(".")[0]]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[0] for a in node.names]
        else:
            continue
        out.extend((node.lineno, t, id(node) in local_nodes) for t in targets)
    return out


def test_data_modules_import_one_way_without_circles():
    graph = {f"data.{p.stem}": {t for _, t, _ in _imports(p) if t.startswith("data.")}
             for p in DATA.glob("*.py") if p.stem != "__init__"}
    graph = {m: {t for t in deps if t in graph and t != m} for m, deps in graph.items()}
    order, state = [], {}

    def visit(m, stack):
        if state.get(m) == "done":
            return
        assert state.get(m) != "active", f"import circle: {' -> '.join(stack + [m])}"
        state[m] = "active"
        for d in sorted(graph[m]):
            visit(d, stack + [m])
        state[m] = "done"
        order.append(m)

    for m in sorted(graph):
        visit(m, [])
    assert {"data.h5format", "data.h5reader", "data.h5cache", "data.datasets"} <= set(order)


def test_function_local_imports_only_for_heavy_optional_packages_with_a_comment():
    for p in DATA.glob("*.py"):
        lines = p.read_text().splitlines()
        for lineno, target, local in _imports(p):
            if not local:
                continue
            where = f"{p.name}:{lineno} imports {target} inside a function"
            assert target in LAZY_OK, where + f"; only {sorted(LAZY_OK)} may be imported lazily"
            context = " ".join(lines[max(0, lineno - 3):lineno])
            assert "lazy" in context, where + " without a comment saying why (mention 'lazy')"
