"""Registry of the networks the main job builds from its flags.

Adding a model is one function and one registry entry::

    @register("mymodel")
    def build_mymodel(cfg, in_shape, num_classes, comm=None, form="network"):
        ...

A builder reads the attributes it needs from ``cfg`` (the main job's
:class:`~mgrit.training.jobconfig.JobConfig`, or any object with those attributes), seeds
every weight from ``cfg.seed`` independently of the rank count, and returns for

* ``form="network"``: a :class:`~mgrit.nn.LayerParallelNet` on the layer communicator
  ``comm``, or the equivalent serial ``nn.Module`` (same initial weights) when ``comm`` is None;
* ``form="layers"``: a list of blocks for layer-wise training (``layerwise``), or
  ``ValueError`` if the model has no such form.

Builders raise ``ValueError`` (naming the flag) for configurations that do not fit the data.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from ..nn import (LayerParallelNet, LayerParallelResNet, ResidualStep, layer_seed, make_step,
                  serial_resnet)
from ..nn.steps import activation
from ..options import MGRITOptions

__all__ = ["MODELS", "register", "build_model", "mgrit_options", "FORMS"]

#: name -> builder ``(cfg, in_shape, num_classes, comm=None, form="network")``.
MODELS: dict[str, Callable] = {}
FORMS = ("network", "layers")

#: Offset of the closing layer's seed (``manual_seed(seed + CLOSING_SEED)``), as before.
CLOSING_SEED = 7919


def register(name: str) -> Callable:
    """Decorator adding a builder to :data:`MODELS` under ``name`` (ValueError if taken)."""
    def add(fn):
        if name in MODELS:
            raise ValueError(f"model {name!r} is registered already")
        MODELS[name] = fn
        return fn
    return add


def build_model(name: str, cfg, in_shape, num_classes: int, comm: MPI.Comm | None = None,
                form: str = "network"):
    """Build model ``name`` (see module doc). Raises ValueError for an unknown name or form."""
    if name not in MODELS:
        raise ValueError(f"model {name!r} is unknown: use one of {sorted(MODELS)}")
    if form not in FORMS:
        raise ValueError(f"form={form!r} is not allowed: use one of {list(FORMS)}")
    return MODELS[name](cfg, tuple(in_shape), int(num_classes), comm=comm, form=form)


def mgrit_options(cfg) -> tuple:
    """Forward and adjoint :class:`MGRITOptions` from ``levels``, ``cfactor``, ``relax``,
    ``skip_first_relaxation``, ``nested_iteration`` (optional attribute, default False),
    ``tol``, ``fwd_iters``, ``bwd_iters``: ``tol = 0`` gives
    exactly ``fwd_iters``/``bwd_iters`` cycles (inexact training), ``tol > 0`` iterates to
    that tolerance with at most ``max(iters, 50)`` cycles (exact mode)."""
    relax = cfg.relax if isinstance(cfg.relax, (list, tuple)) else \
        [r.strip() for r in str(cfg.relax).split(",")]
    common = dict(max_levels=cfg.levels, cfactor=cfg.cfactor, relax=list(relax),
                  skip_first_relaxation=cfg.skip_first_relaxation,
                  nested_iteration=bool(getattr(cfg, "nested_iteration", False)))
    if cfg.tol > 0:
        return (MGRITOptions(tol=cfg.tol, max_iter=max(cfg.fwd_iters, 50), **common),
                MGRITOptions(tol=cfg.tol, max_iter=max(cfg.bwd_iters, 50), **common))
    return (MGRITOptions(tol=0, max_iter=cfg.fwd_iters, **common),
            MGRITOptions(tol=0, max_iter=cfg.bwd_iters, **common))


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
        if len(in_shape) != 3:
            raise ValueError(f"--step {cfg.step} needs image data (C, H, W); the data set has "
                             f"samples of shape {in_shape}: use --step dense")
        opening = nn.Sequential(nn.Conv2d(in_shape[0], cfg.channels, 3, padding=1),
                                activation(cfg.activation))
        state_shape = (cfg.channels, *in_shape[1:])
    torch.manual_seed(cfg.seed + CLOSING_SEED)
    closing = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(state_shape)), num_classes))
    return opening, closing, state_shape


@register("resnet")
def build_resnet(cfg, in_shape, num_classes, comm=None, form="network"):
    """The main job's network: opening (``Linear`` + activation for ``--step dense``, a 3x3
    convolution + activation otherwise) -> ``cfg.layers`` residual steps
    ``x + (T/N) F_k(x)`` (``make_step(cfg.step, features, cfg.activation, cfg.kernel)``, layer
    ``k`` seeded with :func:`~mgrit.nn.resnet.layer_seed`) -> flatten + ``Linear`` closing.
    Layer-parallel: MGRIT options from :func:`mgrit_options`, ``cfg.adjoint``,
    ``cfg.warm_start``, ``cfg.warm_start_adjoint``. ``cfg.tied`` (optional, default False):
    every layer uses one step module (``tie=lambda k: 0``; made as layer 0's), on every rank a
    replica kept identical (:mod:`mgrit.nn.resnet.tied`). ``form="layers"``: ``[opening,
    ResidualStep(F_0), ...]`` (no closing; layer-wise training adds heads)."""
    opening, closing, state_shape = _opening_closing(cfg, in_shape, num_classes)
    make = lambda k: make_step(cfg.step, _features(cfg), cfg.activation, cfg.kernel)  # noqa: E731
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
    resnet = LayerParallelResNet.build(make, cfg.layers, state_shape, comm=comm, seed=cfg.seed,
                                       T=cfg.T, forward=fwd, backward=bwd, adjoint=cfg.adjoint,
                                       warm_start=cfg.warm_start,
                                       warm_start_adjoint=cfg.warm_start_adjoint, tie=tie)
    return LayerParallelNet(opening, resnet, closing)


# the staged ResNet and the transformers register themselves (imported last: they import
# register and mgrit_options from this module)
from . import transformer_models  # noqa: E402,F401
from . import recurrent_models  # noqa: E402,F401  (--model gru)
from . import cifar_models  # noqa: E402,F401  (--model cifar-resnet)
