"""State-dict keys that do not depend on ``torch.compile``.

``torch.compile(module)`` returns a wrapper (``OptimizedModule``) that holds the module as its
submodule ``_orig_mod``, so every key of its state dict gains an ``_orig_mod.`` component and a
checkpoint of a compiled run refuses to load into a plain one (and back). The networks of
:mod:`mgrit.nn` name their tensors as the plain modules do, whatever is compiled:

* :func:`plain_module` unwraps a compiled module; the global views
  (``gather_state_dict``, ``load_global_state_dict``, ``named_global_modules``, ``to_serial``)
  use it;
* :func:`compile_neutral_keys` makes ``state_dict()`` of a module drop ``_orig_mod.`` from the
  keys of the compiled modules inside it, and ``load_state_dict()`` accept plain keys and
  compiled ones (a compiled run's checkpoint saved before this rule) alike.
"""
from __future__ import annotations

from torch import nn

__all__ = ["plain_module", "compile_neutral_keys"]

_ORIG = "_orig_mod"


def _is_compiled(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and _ORIG in module._modules


def plain_module(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper holds (unwrapped repeatedly), else ``module``:
    the same parameters and buffers, state-dict keys without ``_orig_mod.``."""
    while _is_compiled(module):
        module = module._modules[_ORIG]
    return module


def share_parameter(module: nn.Module, source: nn.Module, name: str) -> None:
    """Put ``source``'s parameter ``name`` (dotted) into ``module`` in place of its own (the
    two modules of one structure; a weight-tied parameter of serial copies)."""
    owner_path, _, leaf = name.rpartition(".")
    setattr(plain_module(module).get_submodule(owner_path), leaf,
            plain_module(source).get_parameter(name))


def _plain_key(key: str) -> str:
    parts = key.split(".")
    return ".".join(p for p in parts if p != _ORIG)


def _strip(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post hook: this module's keys without ``_orig_mod.`` (in place, order kept:
    this module's entries are the last ones when its hook runs)."""
    mine = [k for k in state_dict if k.startswith(prefix) and f"{_ORIG}." in k[len(prefix):]]
    if not mine:
        return
    tail = [k for k in state_dict if k.startswith(prefix)]
    items = [(k, state_dict.pop(k)) for k in tail]
    for k, v in items:
        state_dict[prefix + _plain_key(k[len(prefix):])] = v


def _accept(module, state_dict, prefix, *args) -> None:
    """Load pre-hook: plain keys of compiled submodules renamed to the real ones."""
    real = {}
    for name, m in module.named_modules():
        if _is_compiled(m):
            real[_plain_key(name)] = name
    if not real:
        return
    for k in [k for k in state_dict if k.startswith(prefix)]:
        rest = k[len(prefix):]
        plain = _plain_key(rest)
        if plain != rest:
            continue  # already a compiled key
        # the deepest compiled module whose plain name prefixes the key
        owner = max((p for p in real if plain == p or plain.startswith(p + ".") or not p),
                    key=len, default=None)
        if owner is None:
            continue
        target = dict(module.named_modules())[real[owner]]
        inner = plain[len(owner) + 1:] if owner else plain
        path = real[owner] + ("." if real[owner] else "")
        while _is_compiled(target):
            path += _ORIG + "."
            target = target._modules[_ORIG]
        state_dict[prefix + path + inner] = state_dict.pop(k)


def compile_neutral_keys(module: nn.Module) -> None:
    """Register the two hooks of the module docstring on ``module`` (once)."""
    if getattr(module, "_compile_neutral", False):
        return
    module.register_state_dict_post_hook(_strip)
    module.register_load_state_dict_pre_hook(_accept)
    module._compile_neutral = True
