"""The network of a :class:`~mgrit.nn.resnet.LayerParallelResNet` seen as a whole from every
rank: the equivalent serial ``nn.Sequential`` (``to_serial``), the weight-tie sources, and the
global state dict (``gather_state_dict`` / ``load_global_state_dict``, keys ``"{k}.{name}"``
for global layer ``k``). Every method is collective over the layer communicator except
``tied_sources``. A mixin: the ResNet owns ``steps``, ``first``, ``h``, ``comm`` and ``_groups``.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ..chains.compiled import plain_module, share_parameter
from ..steps import stochastic
from ..steps.basic import ResidualStep

__all__ = ["GlobalView"]


class GlobalView:
    """The global views of a :class:`~mgrit.nn.LayerParallelResNet` (see there)."""

    def to_serial(self) -> nn.Sequential:
        """An equivalent plain ``nn.Sequential`` of all ``N`` residual layers with copies of
        the current weights (shared parameters stay shared), on every rank (collective;
        usable without MPI afterwards)."""
        with self._materialized():
            pieces = self.comm.allgather([(self.first + j, plain_module(s))
                                          for j, s in enumerate(self.steps)])
        layers = dict(sorted(((k, s) for piece in pieces for k, s in piece), key=lambda ks: ks[0]))
        for k, k0 in self.tied_sources().items():  # one module per tie group, as in serial
            layers[k] = layers[k0]
        copies = copy.deepcopy(list(layers.values()))  # one memo: ties are kept
        for k, path, k0 in self.tied_entries():  # one Parameter per parameter group
            if path:
                share_parameter(copies[k], copies[k0], path)
        layers = [ResidualStep(s, self.h) for s in copies]
        stochastic.seed_serial(layers)  # Dropout/DropPath: the same masks from the same seed
        return nn.Sequential(*layers)

    def tied_sources(self) -> dict:
        """``{k: k0}`` for every layer ``k`` tied as a whole step (``tie`` path ``""``) that
        is not its group's first layer ``k0`` (global; empty without such ties)."""
        return {k: k0 for k, path, k0 in self.tied_entries() if path == ""}

    def tied_entries(self) -> list:
        """``[(k, path, k0)]``: every layer ``k`` of a tie group (``path``: ``""`` for the
        whole step, else the tied parameter's name) that is not the group's first layer
        ``k0`` (global, local: no communication; empty without ``tie``)."""
        ties = self._groups
        if ties is None:
            return []
        return sorted((k, path, ties.first[g]) for k in range(len(ties.layers))
                      for path, g in ties.layers[k] if ties.first[g] != k)

    def gather_state_dict(self, root: int = 0) -> dict | None:
        """All layers' weights under global keys ``"{k}.{name}"`` on ``root`` (collective).
        Tied layers' keys map to one tensor object (their group's first layer's)."""
        with self._materialized():
            local = {f"{self.first + j}.{n}": t.detach().cpu().clone()
                     for j, s in enumerate(self.steps)
                     for n, t in plain_module(s).state_dict().items()}
        parts = self.comm.gather(local, root=root)
        if parts is None:
            return None
        state = {k: v for p in parts for k, v in p.items()}
        for key, src in self._tied_keys(state).items():
            state[key] = state[src]
        return state

    def _tied_keys(self, state: dict) -> dict:
        """``{key: key0}`` for the keys of ``state`` a tie group's first layer holds."""
        out = {}
        for k, path, k0 in self.tied_entries():
            if path:
                out[f"{k}.{path}"] = f"{k0}.{path}"
            else:
                out.update({x: f"{k0}.{x[len(str(k)) + 1:]}" for x in state
                            if x.startswith(f"{k}.")})
        return out

    def load_global_state_dict(self, state: dict | None, root: int = 0) -> None:
        """Inverse of :meth:`gather_state_dict`: ``state`` on ``root`` is scattered and each
        rank loads its layers (collective). Raises KeyError naming a missing layer; ValueError
        (every rank) when weight-tied layers get different values."""
        state = self.comm.bcast(state, root=root)
        for key, src in self._tied_keys(state).items():  # the same verdict on every rank
            a, b = state.get(key), state.get(src)
            if a is not None and b is not None and a is not b and not torch.equal(a, b):
                raise ValueError(f"state entry {key!r} differs from {src!r}, but the two are "
                                 f"weight-tied (one module or parameter): give every layer of "
                                 f"a tie group the same values")
        with self._materialized():  # stacked leaves: loaded through aliases of their rows
            for j, s in enumerate(self.steps):
                k, s = self.first + j, plain_module(s)
                mine = {n: state[f"{k}.{n}"] for n in s.state_dict()}
                s.load_state_dict(mine)

    def _materialized(self):
        """Steps with ordinary parameters inside (stacked_parameters=True: aliases of the
        stacked leaves' rows, :meth:`StackedLeaves.materialized`); else nothing changes."""
        leaves = getattr(self, "_leaves", None)
        return leaves.materialized() if leaves is not None else contextlib.nullcontext()
