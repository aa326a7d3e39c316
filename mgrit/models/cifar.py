"""The CIFAR-style ResNet of He et al. (2016, "Deep residual learning for image recognition",
Sec. 4.2) as a layer-parallel network, ``--model cifar-resnet``.

Stem ``conv3x3(C -> c) - BN - ReLU``; three stages of ``--layers`` basic blocks each, on ``c``,
``2c``, ``4c`` channels (``c = --channels``; He et al.'s ResNet-20/32/56 are ``c = 16`` and
3/5/9 blocks per stage); between stages a strided transition ``conv3x3(stride 2) - BN - ReLU``
halving the image side; head: global average pooling and a linear classifier. Each stage is one
MGRIT chain of ``x_{k+1} = x_k + h F_k(x_k)`` with ``h = 1`` (the ResNet itself, whatever
``--T``) and the basic block's branch ``F = BN - conv3x3 - ReLU - BN - conv3x3`` read left to
right as conv-BN-ReLU-conv-BN (:class:`BasicBlockStep`; convolutions without bias, as BN
follows). Differences from He et al.: the ReLU after the addition is left out (a forward-Euler
step has none; the state of the chain is the sum), and the transitions are single strided
convolutions rather than a block with a projection shortcut.

BatchNorm inside the chains follows :mod:`mgrit.nn.steps.batchnorm` (batch statistics in every MGRIT
application, running statistics once per training forward, the global batch over data-parallel
replicas); in inexact mode (``--tol 0``) the running statistics come from the approximate final
states. ``--step``, ``--kernel`` and ``--activation`` are not used. Seeds as in
:mod:`mgrit.models.transformer` (rank-count independent; the serial form has the same
state-dict keys).
"""
from __future__ import annotations

import copy

from torch import nn

from . import transformer as _tm  # its segment assembly helpers

__all__ = ["BasicBlockStep", "build_cifar_resnet", "STAGE_WIDTHS"]

#: channel multiplier of each stage (``--channels`` times these)
STAGE_WIDTHS = (1, 2, 4)


class BasicBlockStep(nn.Module):
    """``F(x) = BN2(conv2(ReLU(BN1(conv1(x)))))``, 3x3 convolutions without bias, ``channels``
    in and out; states ``(batch, channels, H, W)`` (He et al.'s basic block's branch).

    Args:
        channels: int >= 1.
    """

    def __init__(self, channels: int):
        super().__init__()
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
            raise ValueError(f"channels={channels!r} is not allowed: use an int >= 1")
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return self.bn2(self.conv2(nn.functional.relu(self.bn1(self.conv1(x)))))


def _conv_bn_relu(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU())


def build_cifar_resnet(cfg, in_shape, num_classes, comm=None, form="network"):
    """He et al.'s CIFAR ResNet (module doc): ``cfg.channels``, ``cfg.layers`` blocks per
    stage, ``h = 1``. Raises ValueError for non-image data or ``form="layers"``."""
    _tm._no_layers_form("cifar-resnet", form)
    C, H, W = _tm._image_shape("cifar-resnet", in_shape)
    widths = [cfg.channels * m for m in STAGE_WIDTHS]
    parts = [_tm._seeded(cfg, 0, lambda: _conv_bn_relu(C, widths[0], 1))]
    for s, c in enumerate(widths):
        if s:
            H, W = (H + 1) // 2, (W + 1) // 2
            parts.append(_tm._seeded(cfg, len(parts), lambda c=c: _conv_bn_relu(c // 2, c, 2)))
        parts.append(_tm._Segment(lambda k, c=c: BasicBlockStep(c), cfg.layers, (c, H, W),
                                  cfg.seed + _tm._SEED_STRIDE * (len(parts) + 1)))
    parts.append(_tm._seeded(cfg, len(parts), lambda: nn.Sequential(
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], num_classes))))
    unit = copy.copy(cfg)
    unit.T = float(cfg.layers)  # h = T / N = 1
    return _tm._assemble(parts, unit, comm)
