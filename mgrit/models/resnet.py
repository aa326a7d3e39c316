"""The main job's ResNet (``--model resnet``): opening layer, a layer-parallel chain of residual
steps, closing layer; the serial equivalent and the layer-wise form from the same seeds.

Builder contract (every builder of :data:`mgrit.models.MODELS` follows it): see
:mod:`mgrit.models.registry`.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..nn import (LayerParallelNet, LayerParallelResNet, ResidualStep, layer_seed, make_step,
                  serial_resnet)
from ..nn.steps import activation
from .options import mgrit_options, spatial_option

__all__ = ["build_resnet", "CLOSING_SEED"]

#: Offset of the closing layer's seed (``manual_seed(seed + CLOSING_SEED)``), as before.
CLOSING_SEED = 7919


def _features(cfg) -> int:
    return cfg.width if cfg.step == "dense" else cfg.channels


def _opening_closing(cfg, in_shape, num_classes):
    """Opening and closing layers, seeded independently of the ranks: ``manual_seed(seed)``
    before the opening, ``manual_seed(seed + 7919)`` before the closing."""
    torch.manual_seed(cfg.seed)
    if cfg.step == "dense":
        opening = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(in_shape)), cfg.width),
                                activation(cfg.activation))
        state_shape = (cfg.width,)
    else:
        if len(in_shape) not in (3, 4):
            raise ValueError(f"--step {cfg.step} needs image data (C, H, W) or voxel data "
                             f"(C, D, H, W); the data set has samples of shape {in_shape}: use "
                             f"--step dense")
        conv = nn.Conv2d if len(in_shape) == 3 else nn.Conv3d
        opening = nn.Sequential(conv(in_shape[0], cfg.channels, 3, padding=1),
                                activation(cfg.activation))
        state_shape = (cfg.channels, *in_shape[1:])
    torch.manual_seed(cfg.seed + CLOSING_SEED)
    closing = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(state_shape)), num_classes))
    return opening, closing, state_shape


def build_resnet(cfg, in_shape, num_classes, comm=None, form="network"):
    """The main job's network: opening (``Linear`` + activation for ``--step dense``, a 3x3
    convolution + activation otherwise: ``Conv2d`` for images ``(C, H, W)``, ``Conv3d`` for
    voxels ``(C, D, H, W)``, whose steps are then 3-D) -> ``cfg.layers`` residual steps
    ``x + (T/N) F_k(x)`` (``make_step(cfg.step, features, cfg.activation, cfg.kernel)``, layer
    ``k`` seeded with :func:`~mgrit.nn.resnet.layer_seed`) -> flatten + ``Linear`` closing.
    Layer-parallel: MGRIT options from :func:`mgrit_options`, ``cfg.adjoint``,
    ``cfg.warm_start``, ``cfg.warm_start_adjoint``, spatial coarsening from
    :func:`~mgrit.models.options.spatial_option` (``cfg.spatial_coarsening``). ``cfg.tied`` (optional, default False):
    every layer uses one step module (``tie=lambda k: 0``; made as layer 0's), on every rank a
    replica kept identical (:mod:`mgrit.nn.resnet.tied`). ``form="layers"``: ``[opening,
    ResidualStep(F_0), ...]`` (no closing; layer-wise training adds heads)."""
    opening, closing, state_shape = _opening_closing(cfg, in_shape, num_classes)
    dims = len(state_shape) - 1 if cfg.step != "dense" else 2  # conv steps: 2-D or 3-D states
    make = lambda k: make_step(cfg.step, _features(cfg), cfg.activation, cfg.kernel,  # noqa: E731
                               dims=dims)
    tie = (lambda k: 0) if getattr(cfg, "tied", False) else None  # one module, layer 0's seed
    if form == "layers" and tie is not None:
        raise ValueError("--tied has no layer-wise form: use --method mgrit or serial")
    if form == "layers":
        layers = [opening]
        for k in range(cfg.layers):
            torch.manual_seed(layer_seed(cfg.seed, k))
            layers.append(ResidualStep(make(k), cfg.T / cfg.layers))
        return layers
    if comm is None:
        return nn.Sequential(opening, *serial_resnet(make, cfg.layers, T=cfg.T, seed=cfg.seed,
                                                     tie=tie), closing)
    fwd, bwd = mgrit_options(cfg)
    spatial = spatial_option(cfg)  # keyword only when set: time-only builds stay as they were
    resnet = LayerParallelResNet.build(make, cfg.layers, state_shape, comm=comm, seed=cfg.seed,
                                       T=cfg.T, forward=fwd, backward=bwd, adjoint=cfg.adjoint,
                                       warm_start=cfg.warm_start,
                                       warm_start_adjoint=cfg.warm_start_adjoint, tie=tie,
                                       **({} if spatial is None else {"spatial": spatial}))
    return LayerParallelNet(opening, resnet, closing)
