"""A whole classifier around a layer-parallel ResNet: opening layer -> MGRIT ResNet -> closing layer.

The opening module (e.g. a lift ``Linear(d, width)`` or a convolution) lives on the first layer
rank, the closing module (pool/flatten + linear) and the loss on the last. Every rank of the
layer communicator calls :meth:`LayerParallelNet.forward` with the same input batch (only its
size is used away from the first rank), then ``net.loss(out, y).backward()``.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from .resnet import LayerParallelResNet

__all__ = ["LayerParallelNet"]


class LayerParallelNet(nn.Module):
    """``closing(resnet(opening(x)))`` with the three parts on their ranks.

    Args:
        opening: module applied on the first layer rank (``None`` for the identity); ignored
            (not registered) on other ranks.
        resnet: this rank's :class:`~mgrit.nn.resnet.LayerParallelResNet`.
        closing: module applied on the last layer rank (``None`` for the identity); ignored
            elsewhere.
    """

    def __init__(self, opening: nn.Module | None, resnet: LayerParallelResNet,
                 closing: nn.Module | None):
        super().__init__()
        self.resnet = resnet
        self.opening = (opening or nn.Identity()) if resnet.is_first else None
        self.closing = (closing or nn.Identity()) if resnet.is_last else None
        self.comm = resnet.comm
        self.last_rank = resnet.partition.owner(resnet.n_layers - 1)
        self.first_rank = resnet.partition.owner(0)

    @property
    def is_last(self) -> bool:
        return self.resnet.is_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the input batch ``(batch, ...)`` on every rank. Returns the closing layer's
        output on the last layer rank and an empty placeholder elsewhere."""
        x0 = self.opening(x) if self.resnet.is_first else None
        y = self.resnet(x0, batch_size=x.shape[0])
        return self.closing(y) if self.resnet.is_last else y

    def loss(self, out: torch.Tensor, target: torch.Tensor,
             fn: Callable = F.cross_entropy) -> torch.Tensor:
        """``fn(out, target)`` on the last layer rank; a zero placeholder connected to the
        parameters elsewhere. Call ``.backward()`` on it on every rank."""
        return fn(out, target) if self.resnet.is_last else out.sum()

    def from_last(self, value):
        """Broadcast a Python value (a loss, predictions) from the last layer rank."""
        return self.comm.bcast(value, root=self.last_rank)

    def to_serial(self) -> nn.Sequential:
        """``nn.Sequential(opening, *residual layers, closing)`` with copies of the current
        weights on every rank (collective)."""
        opening = self.comm.bcast(self.opening, root=self.first_rank)
        closing = self.comm.bcast(self.closing, root=self.last_rank)
        return nn.Sequential(copy.deepcopy(opening), *self.resnet.to_serial(), copy.deepcopy(closing))
