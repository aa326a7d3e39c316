"""Build-time checks of a :class:`~mgrit.nn.resnet.LayerParallelResNet` with spatial
coarsening (:mod:`mgrit.spatial`): the coarse sizes exist, user operators round-trip, every
local layer runs at every coarse size (a probe batch of two in eval mode, no gradient,
module state restored), and the forward chain's batched kernel is probed there too
(:func:`mgrit.nn.chains.stacking.probe_shapes`)."""
from __future__ import annotations

import torch

from ...spatial import SpatialCoarsening
from ..chains.contract import hooks_suspended

__all__ = ["spatial_error"]


def _probe(step, k: int, shape, level: int, dtype, device) -> str | None:
    modes = [(m, m.training) for m in step.modules()]
    try:
        step.eval()
        x = torch.zeros((2, *shape), dtype=dtype, device=device)
        with torch.no_grad(), hooks_suspended(step):
            y = step(x)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            return f"returns {got} for input {tuple(x.shape)}"
    except Exception as exc:  # noqa: BLE001 - reported, naming the layer
        return f"raises {type(exc).__name__}: {exc}"
    finally:
        for m, mode in modes:
            m.training = mode
    return None


def spatial_error(model) -> str | None:
    """This rank's finding on ``model.spatial`` (a message, or ``None``); sets the forward
    chain's ``coarse_shapes`` (the batched kernel's probe) when all is well."""
    sp = model.spatial
    if sp is None:
        return None
    if not isinstance(sp, SpatialCoarsening):
        return f"spatial={sp!r} is not allowed: use a mgrit.spatial.SpatialCoarsening or None"
    n = max(model._fsolver.hierarchy.n_levels, model._bsolver.hierarchy.n_levels)
    try:
        shapes = sp.check(model.state_shape, n, model.dtype, model.device)
    except ValueError as exc:
        return f"spatial coarsening: {exc}"
    coarse = {}
    for level, s in enumerate(shapes):
        if s != shapes[0]:
            coarse.setdefault(tuple(s), level)
    for shape, level in coarse.items():
        for j, step in enumerate(model.steps):
            why = _probe(step, model.first + j, shape, level, model.dtype, model.device)
            if why is not None:
                return (f"layer {model.first + j} ({type(step).__name__}) cannot run at the "
                        f"coarse spatial size {shape} of MGRIT level {level} (spatial "
                        f"coarsening): it {why}; use steps that work at any size "
                        f"(convolutions with padding) or spatial=None")
    model._chain.coarse_shapes = list(coarse)
    model._chain.rebuild()
    return None
