"""Built-in one-dimensional transfer matrices of spatial coarsening, applied dimension by
dimension (tensor products) to feature maps ``(..., C, *spatial)``.

Vertex-centred grid of ``n`` points (``n + 1`` divisible by the factor ``f``; TorchBraid's
``2^k - 1`` points with ``f = 2``): coarse point ``i`` sits on fine point ``f (i + 1) - 1``,
``nc = (n + 1) / f - 1``; zero values outside the grid (Dirichlet boundary).

* linear prolongation ``P[j, i] = max(0, 1 - |j - f (i + 1) + 1| / f)``;
* full weighting ``R = P^T / f`` (per dimension; ``[1, 2, 1] / 4`` for ``f = 2``);
* injection ``R[i, f (i + 1) - 1] = 1`` (``x[1::2]`` for ``f = 2``);
* constant prolongation: fine point ``j`` takes coarse point ``min(j // f, nc - 1)``.

Cell-centred grid of ``n`` cells (``n`` divisible by ``f``, e.g. 28 x 28): coarse cell ``i``
covers fine cells ``f i .. f i + f - 1``, ``nc = n / f``.

* constant prolongation ``P[j, i] = 1`` for ``j // f == i``;
* full weighting ``R = P^T / f``: the average of the ``f`` cells (``2 x 2`` averaging in 2-D);
* injection ``R[i, f i] = 1``;
* linear prolongation: interpolation between cell centres ``f i + (f - 1) / 2``, constant
  beyond the first and last centres (``F.interpolate(..., align_corners=False)``).
"""
from __future__ import annotations

import torch

__all__ = ["coarse_size", "restriction", "prolongation", "apply"]


def coarse_size(n: int, f: int, grid: str) -> int | None:
    """The coarse size of ``n`` points by factor ``f`` on ``grid`` (``vertex``/``cell``), or
    ``None`` when ``n`` does not coarsen."""
    if grid == "vertex":
        return (n + 1) // f - 1 if (n + 1) % f == 0 and (n + 1) // f >= 2 else None
    return n // f if n % f == 0 and n >= f else None


def _centres(nc: int, f: int, grid: str) -> torch.Tensor:
    i = torch.arange(nc, dtype=torch.float64)
    return f * (i + 1) - 1 if grid == "vertex" else f * i + (f - 1) / 2


def prolongation(n: int, f: int, grid: str, kind: str) -> torch.Tensor:
    """``P`` ``(n, nc)`` in float64: ``kind`` ``linear`` or ``constant``."""
    nc = coarse_size(n, f, grid)
    j = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    if kind == "constant":
        owner = torch.clamp(torch.arange(n) // f, max=nc - 1)
        return torch.nn.functional.one_hot(owner, nc).to(torch.float64)
    c = _centres(nc, f, grid)
    if grid == "cell":
        j = torch.clamp(j, min=float(c[0]), max=float(c[-1]))  # constant beyond the centres
    return torch.clamp(1 - (j - c).abs() / f, min=0)


def restriction(n: int, f: int, grid: str, kind: str) -> torch.Tensor:
    """``R`` ``(nc, n)`` in float64: ``kind`` ``full_weighting`` or ``injection``."""
    nc = coarse_size(n, f, grid)
    if kind == "injection":
        pos = torch.arange(nc) * f + (f - 1 if grid == "vertex" else 0)
        return torch.nn.functional.one_hot(pos, n).to(torch.float64)
    natural = "linear" if grid == "vertex" else "constant"
    return prolongation(n, f, grid, natural).T / f


def apply(x: torch.Tensor, mats) -> torch.Tensor:
    """``x`` ``(..., *spatial)`` with ``mats[d]`` applied along the ``d``-th of the last
    ``len(mats)`` dims (``(out, in)`` each, in ``x``'s dtype and device)."""
    nd = len(mats)
    for d, m in enumerate(mats):
        dim = x.dim() - nd + d
        x = torch.movedim(torch.matmul(m, torch.movedim(x, dim, -2)), -2, dim)
    return x.contiguous()
