"""Auxiliary (temporary) output heads for layer-wise training, and the residual-step wrapper.

A *head* maps a stage's output features of shape ``(batch, *in_shape)`` to class logits of
shape ``(batch, num_classes)``. Kinds (Belilovsky et al. 2019/2020 use small conv heads for
CNNs; Kim 2019 a plain output layer):

=============== ==================================================================== ===========
kind            layers                                                               input
=============== ==================================================================== ===========
``"linear"``    flatten -> Linear(prod(in_shape), C)                                  any shape
``"mlp"``       flatten -> Linear(prod(in_shape), hidden) -> ReLU -> Linear(hidden, C) any shape
``"pool"``      AdaptiveAvgPool2d(1) -> flatten -> Linear(channels, C)               (C_in, H, W)
``"conv"``      Conv3x3(C_in, hidden) -> ReLU -> AdaptiveAvgPool2d(2) -> flatten      (C_in, H, W)
                -> Linear(4*hidden, C)
=============== ==================================================================== ===========

``head`` arguments elsewhere in :mod:`layerwise` accept one of these names or a callable
``factory(in_shape, num_classes) -> nn.Module``; :func:`check_head_fits` verifies either with
one forward pass on zeros, so a head that does not fit the stage output is a clear
``ValueError`` at set-up time, not a shape error deep inside training.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence, Union

import torch
from torch import nn

__all__ = ["HEAD_KINDS", "make_head", "check_head_fits", "ResidualStep", "HeadSpec"]

#: Names accepted by :func:`make_head`.
HEAD_KINDS = ("linear", "mlp", "pool", "conv")

HeadSpec = Union[str, Callable[[tuple, int], nn.Module]]


def _shape(in_shape) -> tuple:
    try:
        shape = tuple(int(s) for s in in_shape)
    except TypeError:
        raise ValueError(f"in_shape={in_shape!r} is not allowed: use a tuple of positive ints "
                         f"(feature shape without the batch dimension)") from None
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"in_shape={in_shape!r} is not allowed: use a non-empty tuple of "
                         f"positive ints (feature shape without the batch dimension)")
    return shape


def make_head(kind: HeadSpec, in_shape: Sequence[int], num_classes: int, *, hidden: int = 64,
              dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> nn.Module:
    """Build an auxiliary head for features of shape ``(batch, *in_shape)``.

    Args:
        kind: one of :data:`HEAD_KINDS` or a callable ``(in_shape, num_classes) -> nn.Module``.
        in_shape: feature shape without the batch dimension, e.g. ``(64,)`` or ``(16, 8, 8)``.
        num_classes: number of output logits C >= 1.
        hidden: width of the hidden layer of ``"mlp"`` / channels of ``"conv"`` (default 64).
        dtype, device: of the parameters (default: torch's default dtype, CPU).

    Returns:
        the head, already checked with :func:`check_head_fits`.

    Raises:
        ValueError: unknown ``kind``; ``"pool"``/``"conv"`` on features that are not
            ``(channels, H, W)``; ``num_classes`` or ``hidden`` < 1; a callable whose module does
            not map ``in_shape`` to ``(num_classes,)``.
    """
    shape = _shape(in_shape)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r} is not allowed: use an int >= 1")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden={hidden!r} is not allowed: use an int >= 1")
    if callable(kind) and not isinstance(kind, str):
        head = kind(shape, num_classes)
        if not isinstance(head, nn.Module):
            raise ValueError(f"head factory {kind!r} returned {type(head).__name__}, "
                             f"expected an nn.Module")
    elif kind == "linear":
        head = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), num_classes))
    elif kind == "mlp":
        head = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), hidden), nn.ReLU(),
                             nn.Linear(hidden, num_classes))
    elif kind in ("pool", "conv"):
        if len(shape) != 3:
            raise ValueError(f"head {kind!r} does not fit the stage output shape {shape}: it needs "
                             f"image features (channels, H, W); use head='linear' or 'mlp' for "
                             f"flat features")
        if kind == "pool":
            head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(shape[0], num_classes))
        else:
            head = nn.Sequential(nn.Conv2d(shape[0], hidden, 3, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                 nn.Linear(4 * hidden, num_classes))
    else:
        raise ValueError(f"head={kind!r} is not allowed: use one of {', '.join(HEAD_KINDS)} or a "
                         f"callable (in_shape, num_classes) -> nn.Module")
    head = head.to(device=device, dtype=dtype or torch.get_default_dtype())
    check_head_fits(head, shape, num_classes, what=f"head {kind!r}")
    return head


def check_head_fits(head: nn.Module, in_shape: Sequence[int], num_classes: int,
                    what: str = "head") -> None:
    """Run ``head`` once on zeros ``(2, *in_shape)``; raise ``ValueError`` unless it returns
    ``(2, num_classes)``. Parameters and buffers are left untouched (``no_grad``, eval mode
    restored)."""
    shape = _shape(in_shape)
    p = next(head.parameters(), None)
    dtype = p.dtype if p is not None else torch.get_default_dtype()
    device = p.device if p is not None else None
    training = head.training
    head.eval()
    try:
        with torch.no_grad():
            out = head(torch.zeros((2, *shape), dtype=dtype, device=device))
    except Exception as exc:  # shape mismatch inside the head
        raise ValueError(f"{what} does not fit the stage output shape {shape}: {exc}") from None
    finally:
        head.train(training)
    if tuple(out.shape) != (2, num_classes):
        raise ValueError(f"{what} does not fit the stage output shape {shape}: it returns "
                         f"{tuple(out.shape[1:])} per sample, expected ({num_classes},)")


class ResidualStep(nn.Module):
    """Forward-Euler residual step ``x -> x + h * F(x)`` (the layer of the ResNet family that
    :mod:`mgrit` trains layer-parallel), so a stage can be a group of residual steps.

    Args:
        F: the step function (shape-preserving nn.Module).
        h: step size (default 1.0).
    """

    def __init__(self, F: nn.Module, h: float = 1.0):
        super().__init__()
        self.F = F
        self.h = float(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.h * self.F(x)

    def extra_repr(self) -> str:
        return f"h={self.h}"
