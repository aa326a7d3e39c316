"""Spatial coarsening of the coarse MGRIT levels (space-time multigrid; TorchBraid's
``coarsen``/``refine`` per level, Cyr et al. 2025): the states of a listed level live on a
coarser grid than those of the level above.

Semantics in the solver (:mod:`mgrit.levelops`): the FAS coarse approximation is
``v = R(u_C)`` (C-point injection in time, then the spatial restriction ``R``), the
right-hand side ``g^c = R(r_C) + v - Phi^c(v)``, the correction
``u_C <- u_C + P(u^c - v)`` (prolonged in space, then in time by the F-relaxation). The fixed
point -- the fine chain's solution -- does not depend on ``R`` and ``P``. The adjoint solve
uses :meth:`SpatialCoarsening.transposed`: restriction ``P^T``, prolongation ``R^T``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import grids

__all__ = ["SpatialCoarsening", "TransposedCoarsening", "level_shapes"]

_RESTRICT = ("full_weighting", "injection")
_PROLONG = ("linear", "constant")
_GRIDS = ("auto", "vertex", "cell")


def _positive_ints(value, name: str) -> tuple:
    vals = value if isinstance(value, (tuple, list)) else (value,)
    if not vals or any(isinstance(v, bool) or not isinstance(v, int) for v in vals):
        raise ValueError(f"{name}={value!r} is not allowed: use an int or a tuple of ints")
    return tuple(vals)


class SpatialCoarsening:
    """Which MGRIT levels coarsen their states in space, and how.

    States are feature maps ``(batch, C, *spatial)`` with 1, 2 or 3 spatial dims (per sample
    ``(C, L)``, ``(C, H, W)``, ``(C, D, H, W)``); the operators act on the spatial dims.

    Args:
        levels: the MGRIT levels whose states are coarsened relative to the level above
            (default ``(1,)``, the first coarse level; ints >= 1; a later listed level
            coarsens again). Levels the hierarchy does not have are ignored.
        factor: coarsening factor, an int >= 2 (every spatial dim) or a tuple per dim.
        restrict: ``"full_weighting"`` (default; the scaled transpose of the grid's natural
            interpolation: linear on vertex grids, constant on cell grids, i.e. ``2 x 2``
            averaging) or ``"injection"``.
        prolong: ``"linear"`` (default: bi-/trilinear interpolation) or ``"constant"``.
        grid: ``"vertex"`` (``f k - 1`` points per side, e.g. ``2^k - 1``), ``"cell"`` (sizes
            divisible by ``f``, e.g. 28) or ``"auto"`` (default: per dim and level, odd sizes
            vertex, even sizes cell). Formulas in :mod:`mgrit.spatial.grids`.
        operators: a user object with ``restrict(x, level)``, ``prolong(x, level)`` and
            ``coarse_shape(shape, level)`` replacing the built-in ones (``restrict``,
            ``prolong``, ``grid`` and ``factor`` are then unused): ``x`` ``(n, C, *spatial)``
            on level ``level - 1`` (restrict) or ``level`` (prolong), ``shape`` a per-sample
            shape ``(C, *spatial)`` of level ``level - 1``. They must be linear (the adjoint
            uses their transposes, formed by autograd) and keep dtype and device.

    Raises:
        ValueError: a value not allowed (naming it and what is allowed); from
            :meth:`check`: a size that does not coarsen, user operators that fail the
            round-trip test.
    """

    def __init__(self, levels: Sequence[int] = (1,), factor: int | Sequence[int] = 2,
                 restrict: str = "full_weighting", prolong: str = "linear", grid: str = "auto",
                 operators=None):
        lv = _positive_ints(levels, "levels")
        if any(v < 1 for v in lv):
            raise ValueError(f"levels={levels!r} is not allowed: use MGRIT levels >= 1 "
                             f"(1 = the first coarse level)")
        f = _positive_ints(factor, "factor")
        if any(v < 2 for v in f) or len(f) > 3:
            raise ValueError(f"factor={factor!r} is not allowed: use an int >= 2 or a tuple of "
                             f"1 to 3 ints >= 2 (one per spatial dim)")
        for name, value, allowed in (("restrict", restrict, _RESTRICT),
                                     ("prolong", prolong, _PROLONG), ("grid", grid, _GRIDS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not allowed: use one of {allowed}")
        if operators is not None and not all(callable(getattr(operators, m, None)) for m in
                                             ("restrict", "prolong", "coarse_shape")):
            raise ValueError(f"operators={operators!r} is not allowed: use an object with "
                             f"restrict(x, level), prolong(x, level), coarse_shape(shape, level)")
        self.levels = tuple(sorted(set(lv)))
        self.factor = f if isinstance(factor, (tuple, list)) else f[0]
        self.restrict_kind, self.prolong_kind, self.grid = restrict, prolong, grid
        self.operators = operators
        self._mats: dict = {}

    def __repr__(self) -> str:
        if self.operators is not None:
            return f"SpatialCoarsening(levels={self.levels}, operators={self.operators!r})"
        return (f"SpatialCoarsening(levels={self.levels}, factor={self.factor}, restrict="
                f"{self.restrict_kind!r}, prolong={self.prolong_kind!r}, grid={self.grid!r})")

    # -- shapes ----------------------------------------------------------------------------
    def coarsens(self, level: int) -> bool:
        return level in self.levels

    def depth(self, level: int) -> int:
        """How many times the states of ``level`` are coarsened (listed levels ``<= level``)."""
        return sum(1 for v in self.levels if v <= level)

    def _plan(self, shape: torch.Size):
        """Per spatial dim ``(n, f, grid)`` of one coarsening of per-sample ``shape``."""
        spatial = tuple(shape[1:])
        f = self.factor if isinstance(self.factor, tuple) else (self.factor,) * len(spatial)
        if not 1 <= len(spatial) <= 3 or len(f) != len(spatial):
            raise ValueError(f"spatial coarsening of states {tuple(shape)} with factor="
                             f"{self.factor!r}: use states (C, L), (C, H, W) or (C, D, H, W) and "
                             f"one factor per spatial dim")
        plan = []
        for n, fd in zip(spatial, f):
            g = self.grid if self.grid != "auto" else ("vertex" if n % 2 else "cell")
            if grids.coarse_size(n, fd, g) is None:
                need = f"n + 1 divisible by {fd}" if g == "vertex" else f"n divisible by {fd}"
                raise ValueError(f"spatial size {n} of states {tuple(shape)} does not coarsen by "
                                 f"{fd} on a {g}-centred grid ({need}, at least one coarse point)")
            plan.append((n, fd, g))
        return plan

    def coarse_shape(self, shape, level: int) -> torch.Size:
        """Per-sample shape on ``level`` given ``shape`` ``(C, *spatial)`` on ``level - 1``."""
        shape = torch.Size(shape)
        if self.operators is not None:
            return torch.Size(self.operators.coarse_shape(shape, level))
        return torch.Size((shape[0], *(grids.coarse_size(n, f, g)
                                       for n, f, g in self._plan(shape))))

    def level_shapes(self, shape, n_levels: int) -> list:
        """Per-sample state shapes of levels ``0 .. n_levels - 1`` (level 0: ``shape``)."""
        out = [torch.Size(shape)]
        for level in range(1, n_levels):
            prev = out[-1]
            out.append(self.coarse_shape(prev, level) if self.coarsens(level) else prev)
        return out

    # -- operators -------------------------------------------------------------------------
    def _matrices(self, shape, which: str, like: torch.Tensor) -> list:
        """The 1-D matrices of ``R`` or ``P`` for fine per-sample ``shape``, in ``like``'s
        dtype and device (cached)."""
        key = (tuple(shape), which, like.dtype, like.device)
        if key not in self._mats:
            make, kind = ((grids.restriction, self.restrict_kind) if which == "R"
                          else (grids.prolongation, self.prolong_kind))
            self._mats[key] = [make(n, f, g, kind).to(like.dtype).to(like.device)
                               for n, f, g in self._plan(torch.Size(shape))]
        return self._mats[key]

    def restrict(self, x: torch.Tensor, level: int, fine_shape) -> torch.Tensor:
        """``x`` ``(..., C, *spatial)`` on level ``level - 1``, whose per-sample shape is
        ``fine_shape``, restricted to ``level``."""
        fine = torch.Size(fine_shape)
        if self.operators is not None:
            lead = x.shape[:x.dim() - len(fine)]
            y = self.operators.restrict(x.reshape(-1, *fine), level)
            return y.reshape(*lead, *y.shape[1:])
        return grids.apply(x, self._matrices(fine, "R", x))

    def prolong(self, x: torch.Tensor, level: int, fine_shape) -> torch.Tensor:
        """``x`` on ``level`` prolonged to level ``level - 1``, whose per-sample shape is
        ``fine_shape``."""
        fine = torch.Size(fine_shape)
        if self.operators is not None:
            lead = x.shape[:x.dim() - len(fine)]
            y = self.operators.prolong(x.reshape(-1, *x.shape[len(lead):]), level)
            return y.reshape(*lead, *y.shape[1:])
        return grids.apply(x, self._matrices(fine, "P", x))

    def transposed(self) -> "TransposedCoarsening":
        """The adjoint solve's operators: restriction ``P^T``, prolongation ``R^T``."""
        return TransposedCoarsening(self)

    # -- checks ----------------------------------------------------------------------------
    def check(self, shape, n_levels: int, dtype=torch.float64, device="cpu") -> list:
        """Validate for per-sample ``shape`` and ``n_levels`` levels: the shapes of every
        coarsened level, and for user operators a round trip (restrict then prolong of a
        random batch of two gives the fine shape back, dtype and device kept). Returns the
        level shapes.

        Raises:
            ValueError: naming the level, the shapes and what is wrong.
        """
        try:
            shapes = self.level_shapes(shape, n_levels)
        except ValueError:
            raise
        except Exception as exc:  # a user coarse_shape that fails
            raise ValueError(f"operators.coarse_shape failed for states {tuple(shape)}: "
                             f"{type(exc).__name__}: {exc}") from exc
        for level in range(1, len(shapes)):
            if not self.coarsens(level):
                continue
            fine, coarse = shapes[level - 1], shapes[level]
            if len(coarse) != len(fine) or coarse[0] != fine[0] or any(c < 1 for c in coarse):
                raise ValueError(f"coarse_shape({tuple(fine)}, {level}) = {tuple(coarse)}: a "
                                 f"coarse state must keep the channels and the number of dims")
            if self.operators is None:
                continue
            x = torch.randn(2, *fine, dtype=dtype, device=device)
            what = f"the user operators at MGRIT level {level} (states {tuple(fine)} -> " \
                   f"{tuple(coarse)})"
            try:
                y = self.restrict(x, level, fine)
                z = self.prolong(y, level, fine)
            except Exception as exc:
                raise ValueError(f"{what} raised {type(exc).__name__}: {exc}") from exc
            for name, t, want in (("restrict", y, coarse), ("prolong", z, fine)):
                if not isinstance(t, torch.Tensor) or t.shape != (2, *want) \
                        or t.dtype != x.dtype or t.device != x.device:
                    got = (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) \
                        else type(t).__name__
                    raise ValueError(f"{what}: {name} returned {got}; expected shape "
                                     f"{(2, *want)}, dtype {x.dtype}, device {x.device}")
        return shapes


class TransposedCoarsening:
    """The transposed operators of a :class:`SpatialCoarsening` (the adjoint solve's):
    ``restrict = P^T``, ``prolong = R^T``; shapes as the original's."""

    def __init__(self, base: SpatialCoarsening):
        self.base = base
        self.levels = base.levels

    def coarsens(self, level: int) -> bool:
        return self.base.coarsens(level)

    def depth(self, level: int) -> int:
        return self.base.depth(level)

    def level_shapes(self, shape, n_levels: int) -> list:
        return self.base.level_shapes(shape, n_levels)

    def transposed(self) -> SpatialCoarsening:
        return self.base

    def restrict(self, x, level, fine_shape):
        b = self.base
        if b.operators is None:
            return grids.apply(x, [m.T for m in b._matrices(fine_shape, "P", x)])
        coarse = b.coarse_shape(fine_shape, level)
        lead = x.shape[:x.dim() - len(coarse)]
        return _vjp(lambda z: b.prolong(z, level, fine_shape), x, (*lead, *coarse))

    def prolong(self, x, level, fine_shape):
        b = self.base
        if b.operators is None:
            return grids.apply(x, [m.T for m in b._matrices(fine_shape, "R", x)])
        fine = torch.Size(fine_shape)
        lead = x.shape[:x.dim() - len(fine)]
        return _vjp(lambda z: b.restrict(z, level, fine), x, (*lead, *fine))


def _vjp(op, y: torch.Tensor, in_shape) -> torch.Tensor:
    """``op^T y`` for a linear ``op`` whose input has ``in_shape`` (autograd at zero)."""
    with torch.enable_grad():
        z = torch.zeros(in_shape, dtype=y.dtype, device=y.device, requires_grad=True)
        (g,) = torch.autograd.grad(op(z), z, y)
    return g


def level_shapes(spatial, shape, n_levels: int) -> list | None:
    """Per-sample state shapes of ``n_levels`` levels for solver states ``shape``
    ``(batch, C, *spatial)``, or ``None`` when ``spatial`` is ``None`` or coarsens none of
    them (every level then has ``shape``).

    Raises:
        ValueError: ``shape`` has no spatial dim, or a size does not coarsen.
    """
    if spatial is None or not any(spatial.coarsens(k) for k in range(1, n_levels)):
        return None
    if len(shape) < 3:
        raise ValueError(f"spatial coarsening needs states (batch, C, *spatial), got "
                         f"{tuple(shape)}")
    return spatial.level_shapes(torch.Size(shape[1:]), n_levels)
