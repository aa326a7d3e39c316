"""Global state-dict keys of weight-tied layers: a network's ``tied_prefixes()`` maps the key
prefix of every tied layer that is not its group's first (``"3.F."``, a whole step) or the key
of a tied parameter (``"3.F.lin.weight"``) to the first layer's; checkpoints and state dicts
store one tensor per group (:mod:`mgrit.nn.resnet.tied`). Re-exported by :mod:`mgrit.nn.net`.
"""
from __future__ import annotations

import torch

__all__ = ["alias_tied", "tied_conflict", "tied_source"]


def tied_conflict(state: dict, prefixes: dict) -> str | None:
    """A message when ``state`` gives a weight-tied layer other values than its group's first
    layer (e.g. a state dict of an untied network: loading it would make the replicas differ),
    else ``None``. ``prefixes``: :meth:`LayerParallelNet.tied_prefixes`."""
    for key, t in state.items():
        src = tied_source(key, prefixes)
        ref = None if src is None else state.get(src)
        if ref is not None and t is not ref and not (
                torch.is_tensor(t) and torch.is_tensor(ref) and t.shape == ref.shape
                and torch.equal(t, ref)):
            return (f"{key!r} differs from {src!r}, but the two layers are weight-"
                    f"tied (one module): give every layer of a tie group the same values (a "
                    f"state dict of the untied network does not fit a tied one)")
    return None


def alias_tied(state: dict, prefixes: dict) -> dict:
    """``state`` with each tied layer's entries replaced by its group's first layer's tensor
    objects (``prefixes``: :meth:`LayerParallelNet.tied_prefixes`), so that saving it writes
    one copy; keys unchanged."""
    sources = {key: tied_source(key, prefixes) for key in state} if prefixes else {}
    state.update({key: state[src] for key, src in sources.items()
                  if src is not None and src in state})
    return state


def tied_source(key: str, prefixes: dict) -> str | None:
    """``key`` in its tie group's first layer if it is a tied parameter's key (an entry
    without the trailing ``"."``: ``"3.F.lin.weight"``) or under a tied prefix (a module path
    ending in ``"."``, also behind a wrapper's: ``"net.3.F."``; one look-up per dot), else
    ``None``."""
    exact = prefixes.get(key)
    if exact is not None:
        return exact
    ends = (i + 1 for i, ch in enumerate(key) if ch == ".")
    pre = next((key[:e] for e in ends if key[:e] in prefixes), None)
    return None if pre is None else prefixes[pre] + key[len(pre):]
