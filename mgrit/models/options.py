"""The MGRIT options of a model builder, read from the main job's configuration (one place for
every layer-parallel model of :mod:`mgrit.models`)."""
from __future__ import annotations

from ..options import MGRITOptions

__all__ = ["mgrit_options", "spatial_option"]


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


def spatial_option(cfg):
    """The :class:`~mgrit.spatial.SpatialCoarsening` of ``cfg.spatial_coarsening`` (optional
    attribute: ``"1,2"`` or a tuple of levels; empty or absent: ``None``, time-only
    coarsening) with ``cfg.spatial_restrict`` (default ``"full_weighting"``) and
    ``cfg.spatial_prolong`` (default ``"linear"``); factor 2, the grid convention chosen from
    the state size (``grid="auto"``)."""
    levels = getattr(cfg, "spatial_coarsening", None) or ()
    if isinstance(levels, str):
        levels = tuple(int(t) for t in levels.split(",") if t.strip())
    if not levels:
        return None
    from ..spatial import SpatialCoarsening  # the solver's space-time option
    return SpatialCoarsening(levels=tuple(levels), factor=2,
                             restrict=getattr(cfg, "spatial_restrict", None) or "full_weighting",
                             prolong=getattr(cfg, "spatial_prolong", None) or "linear")
