"""The ``tie`` declaration of a :class:`~mgrit.nn.resnet.LayerParallelResNet`, normalized
(:func:`tie_groups`): which layers share which parameters, by **global** layer index (see
:mod:`mgrit.nn.resnet.tied` for what the library does with it).

Two forms, which may be mixed where they do not overlap:

* **whole steps**: ``tie`` a function ``k -> key`` or a sequence of ``N`` keys; the layers
  with one key use one step module (every parameter shared). In a dict: the path ``""``.
* **parameters**: ``tie={"lin.weight": lambda k: 0}``, a dict from the dotted path of a
  parameter inside the step module (a key of ``step.named_parameters()``) to a function or a
  sequence of keys; the layers with one key share that parameter and own the others (a
  time-invariant weight with a time-dependent bias). Several paths may be given, each with
  its own keys.

Keys are hashable; ``None`` (or a key used by one layer only) leaves the layer untied for that
path. A layer may be named by several paths only where they cannot cover one parameter
(``""`` covers all of them).
"""
from __future__ import annotations

from typing import Hashable, Mapping, Sequence

__all__ = ["Ties", "tie_groups"]


class Ties:
    """The normalized tie groups of ``N`` layers (the same on every rank).

    Attributes:
        paths: per group (numbered ``0, 1, ...`` in the order of the paths, then of each
            group's first layer): its path, ``""`` for a whole step.
        first: per group: its first (global) layer.
        members: per group: its layers, ascending.
        layers: per layer: ``((path, group), ...)``, the groups it belongs to.
        named: per layer: the paths whose key is not ``None`` there (also a key used by this
            layer only): each must name a parameter of the layer's step.
    """

    def __init__(self, n_layers: int):
        self.paths: list = []
        self.first: list = []
        self.members: list = []
        self.layers: list = [() for _ in range(n_layers)]
        self.named: list = [() for _ in range(n_layers)]

    def module_group(self, k: int) -> int | None:
        """The whole-step group of layer ``k`` (path ``""``), else ``None``."""
        return next((g for path, g in self.layers[k] if path == ""), None)

    def group_of(self, k: int, name: str) -> int | None:
        """The group that ties parameter ``name`` of layer ``k`` (``None``: not tied)."""
        return next((g for path, g in self.layers[k] if covers(path, name)), None)


def covers(path: str, name: str) -> bool:
    """Whether the tie path ``path`` covers the parameter ``name`` of a step."""
    return path == "" or name == path


def _keys(tie, n_layers: int, where: str) -> list:
    if callable(tie):
        try:
            keys = [tie(k) for k in range(n_layers)]
        except Exception as exc:  # noqa: BLE001  (named in the message)
            raise ValueError(f"{where}(k) raised {type(exc).__name__}: {exc}; use a function of "
                             f"the global layer index k = 0..N-1 returning a group key or "
                             f"None") from exc
    elif isinstance(tie, (str, bytes)) or not isinstance(tie, Sequence):
        raise ValueError(f"{where}={tie!r} is not allowed: use None, a function k -> group key, "
                         f"a sequence of N = {n_layers} group keys (None: untied), or a dict "
                         f"{{parameter path: one of these}}")
    else:
        keys = list(tie)
        if len(keys) != n_layers:
            raise ValueError(f"{where} has {len(keys)} entries: use one group key per layer "
                             f"(N = {n_layers})")
    for k, key in enumerate(keys):
        if not isinstance(key, Hashable):
            raise ValueError(f"{where} key {key!r} of layer {k} is not hashable: use ints or "
                             f"strings")
    return keys


def _path_error(path) -> str | None:
    if not isinstance(path, str):
        return (f"tie path {path!r} is not allowed: use a string, the dotted name of a parameter "
                f"inside the step module (a key of step.named_parameters(), e.g. 'lin.weight'), "
                f"or '' for the whole step")
    if path and any(not part for part in path.split(".")):
        return (f"tie path {path!r} is not allowed: use the dotted name of a parameter inside "
                f"the step module (e.g. 'lin.weight'), or '' for the whole step")
    return None


def tie_groups(tie, n_layers: int) -> Ties | None:
    """Normalize ``tie`` (see the module docstring) for ``n_layers`` layers; ``None`` when no
    two layers share anything.

    Raises:
        ValueError: a sequence of the wrong length, an unhashable key, a callable that raises,
            a path that is not a dotted name, two paths that cover one parameter of a layer.
    """
    if tie is None:
        return None
    if isinstance(tie, Mapping):
        for path in tie:
            error = _path_error(path)
            if error:
                raise ValueError(error)
        items = [(path, _keys(v, n_layers, f"tie[{path!r}]")) for path, v in tie.items()]
    else:
        items = [("", _keys(tie, n_layers, "tie"))]
    out = Ties(n_layers)
    for k in range(n_layers):
        named = [path for path, keys in items if keys[k] is not None]
        for i, a in enumerate(named):
            for b in named[i + 1:]:
                if a == "" or b == "" or a.startswith(b + ".") or b.startswith(a + "."):
                    raise ValueError(f"tie paths {a!r} and {b!r} both name parameters of layer "
                                     f"{k} ('' is the whole step): give layer {k} a key for one "
                                     f"of them only (None for the other)")
        out.named[k] = tuple(named)
    for path, keys in items:
        count: dict = {}
        for key in keys:
            if key is not None:
                count[key] = count.get(key, 0) + 1
        number: dict = {}
        for k, key in enumerate(keys):
            if key is None or count[key] < 2:
                continue
            if key not in number:
                number[key] = len(out.paths)
                out.paths.append(path)
                out.first.append(k)
                out.members.append([])
            g = number[key]
            out.members[g].append(k)
            out.layers[k] += ((path, g),)
    return out if out.paths else None
