"""The feature cache of sequential training (:class:`~layerwise.sequential.SequentialTrainer`):
the outputs of the frozen layers ``0..depth-1`` for an input tensor, computed once and advanced
one frozen layer at a time when a stage ends -- a frozen layer is never recomputed per epoch,
the compute and memory saving of the method."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
from torch import nn

__all__ = ["FeatureCache"]


class FeatureCache:
    """Outputs of the first ``depth`` layers of ``layers`` for up to ``capacity`` inputs
    (training set, test set, ...; least recently used dropped first), keyed by the input
    tensor's identity.

    Args:
        layers: the network's layers (the live modules: frozen ones do not change).
        chunk: rows per forward call when advancing (bounds the activation memory).
        capacity: inputs kept (default 4).
    """

    def __init__(self, layers: Sequence[nn.Module], chunk: int, capacity: int = 4):
        self.layers, self.chunk, self.capacity = layers, chunk, capacity
        self._entries: OrderedDict = OrderedDict()  # id(input) -> [input, features, depth]

    def clear(self) -> None:
        """Forget every input (e.g. when the layers train again: fine-tuning, a new fit)."""
        self._entries.clear()

    def features(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        """Outputs of layers ``0..depth-1`` for ``x`` ``(n, ...)`` (``x`` itself for depth
        0), advanced from the cached depth one layer at a time in eval mode without a graph
        (each layer's mode restored); recomputed from ``x`` if the cached depth is larger."""
        if depth == 0:
            return x
        entry = self._entries.pop(id(x), None)
        if entry is None or entry[2] > depth:
            entry = [x, x, 0]
        while entry[2] < depth:
            layer = self.layers[entry[2]]
            training = layer.training
            layer.eval()
            with torch.no_grad():
                feats = entry[1]
                entry[1] = torch.cat([layer(feats[i:i + self.chunk])
                                      for i in range(0, len(feats), self.chunk)])
            layer.train(training)
            entry[2] += 1
        self._entries[id(x)] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry[1]
