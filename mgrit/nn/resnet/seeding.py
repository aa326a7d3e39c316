"""Per-layer seeded construction of step modules: the weights of layer ``k`` depend on
``(seed, k)`` only, never on the number of ranks or on which layers a rank builds, and the
caller's RNG state is left as it was (so whatever a user creates afterwards does not depend on
the rank count either). Used by :meth:`LayerParallelResNet.build` and :func:`serial_resnet`.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable, Sequence

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from ..steps.basic import ResidualStep
from ..steps.stochastic import seed_serial
from ..chains.compiled import plain_module
from .tiespec import tie_groups

__all__ = ["layer_seed", "make_layers", "serial_resnet"]


def layer_seed(seed: int, k: int) -> int:
    """Seed of layer ``k``'s initialization, so every partition builds identical weights."""
    return (int(seed) * 1_000_003 + int(k)) % (2 ** 63)


@contextmanager
def _caller_rng_kept():
    """Run the block on torch's global generators and give the caller its states back, so
    that per-layer seeding inside leaves no trace (whatever the caller draws afterwards does
    not depend on which layers this rank built). CPU generator, plus every CUDA device's when
    CUDA is initialized."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
        yield


def _seed_layer(seed: int) -> None:
    """Seed the CPU generator (and CUDA's when initialized: no lazy seeding that would outlive
    :func:`_caller_rng_kept`) for one layer's construction."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def make_layers(make_step: Callable[[int], nn.Module], layers, seed: int, ties=None):
    """``make_step(k)`` for ``k`` in ``layers``, each seeded by :func:`layer_seed`; the
    caller's RNG states are unchanged afterwards. Returns ``(steps, foreign)``: ``foreign``
    lists ``(k, name)`` of parameters of layer ``k`` that ``make_step(k)`` did not create
    (shared with modules built elsewhere). ``ties``: the tie groups
    (:func:`mgrit.nn.resnet.tiespec.tie_groups`): a whole-step group's module is
    ``make_step(k0)`` seeded with ``layer_seed(seed, k0)`` (``k0`` its first layer), made once
    and used for its layers; a parameter group's parameter is the one of the first of its
    layers built here, put into the others' steps in place of theirs (a path that names no
    parameter is left to the constructor's check)."""
    steps, foreign, made = [], [], set()
    module, shared = {}, {}

    def record(module, name, param):
        if param is not None:
            made.add(id(param))

    handle = _torch_module.register_module_parameter_registration_hook(record)
    try:
        with _caller_rng_kept():
            for k in layers:
                g = None if ties is None else ties.module_group(k)
                if g is not None and g in module:
                    steps.append(module[g])
                    continue
                src = k if g is None else ties.first[g]
                made.clear()
                _seed_layer(layer_seed(seed, src))
                step = make_step(src)
                if g is not None:
                    module[g] = step
                steps.append(step)
                foreign += [(k, n) for n, p in step.named_parameters() if id(p) not in made]
                for path, pg in (() if ties is None else ties.layers[k]):
                    if path:
                        _share(plain_module(step), path, pg, shared)
    finally:
        handle.remove()
    return steps, foreign


def _share(step: nn.Module, path: str, group: int, shared: dict) -> None:
    """Make parameter ``path`` of ``step`` the group's (the first one seen is the group's)."""
    owner_path, _, leaf = path.rpartition(".")
    try:
        owner = step.get_submodule(owner_path)
    except AttributeError:
        return
    p = owner._parameters.get(leaf)
    if p is None:
        return
    if group in shared:
        setattr(owner, leaf, shared[group])
    else:
        shared[group] = p


def serial_resnet(make_step: Callable[[int], nn.Module], n_layers: int, T: float = 1.0,
                  seed: int = 0, tie: Callable[[int], Hashable] | Sequence[Hashable] | None = None
                  ) -> nn.Sequential:
    """The serial reference: ``nn.Sequential`` of ``ResidualStep(make_step(k), T/N)`` with the
    same per-layer seeds (and ``tie`` groups: one module or parameter per group) as
    :meth:`LayerParallelResNet.build` (the caller's RNG state is left unchanged)."""
    steps, _ = make_layers(make_step, range(n_layers), seed, tie_groups(tie, n_layers))
    layers = [ResidualStep(s, T / n_layers) for s in steps]
    seed_serial(layers)  # Dropout/DropPath: the segment's masks from the same seed
    return nn.Sequential(*layers)
