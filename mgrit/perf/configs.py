"""MGRIT's coarsening factor and level count for one ``(N, P)`` at fixed iteration counts, by
predicted training-step time (:func:`mgrit.perf.steptime.training_times`). The full question --
MGRIT or data parallelism or pipelining, at which iteration counts for the user's network --
is :func:`mgrit.perf.planner.recommend`'s."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..options import MGRITOptions
from .model import CommCost, _posint, spatial_level_cost
from .steptime import TrainCosts, training_times

__all__ = ["Plan", "plan", "scaling_table"]


@dataclass
class Plan:
    """Recommended settings and predictions for one ``(N, P)``."""
    N: int
    P: int
    cfactor: int
    levels: int
    K_f: int
    K_b: int
    relax: str
    times: dict = field(default_factory=dict)

    @property
    def speedup_vs_layerwise(self) -> float:
        return self.times["layerwise"]["train"] / self.times["mgrit"]["train"]

    @property
    def speedup_vs_serial(self) -> float:
        return self.times["serial"]["train"] / self.times["mgrit"]["train"]


def plan(N: int, P: int, costs: TrainCosts, comm: CommCost = CommCost(), K_f: int = 2,
         K_b: int = 1, relax: str = "F", cfactors: Sequence[int] = (4, 8, 16, 32, 64, 128),
         max_levels: int = 4, spatial: tuple | None = None) -> Plan:
    """Choose ``m`` and ``L`` minimizing the predicted MGRIT training step at fixed iteration
    counts (TorchBraid defaults 2 forward / 1 backward; inexact training with warm start).
    (Convergence, i.e. ``m h |omega|`` small, is the user's check: restrict ``cfactors``.)
    ``spatial``: ``(shape, levels)`` -- the fine state's spatial sides and the spatially
    coarsened levels (``mgrit.spatial.SpatialCoarsening(levels=...)``); every level from 1
    up is coarsened when ``levels`` is ``"all"``; a level count that the levels do not fit is
    skipped; each level's step then costs its share of the fine points
    (:func:`mgrit.perf.model.spatial_level_cost`). The plan's ``times`` assume the same
    iteration counts with and without it: the slower convergence a coarse grid may bring is
    the user's check (``experiments/studies/study_spatial.py`` measures it).
    ValueError: ``N < P``, ``P < 1``, non-positive iteration counts or no admissible m."""
    _posint(N=N, P=P, K_f=K_f, K_b=K_b, max_levels=max_levels)
    if N < P:
        raise ValueError(f"N={N} < P={P}: every rank needs at least one layer")
    cands = [m for m in cfactors if N // m >= 2]
    if not cands:
        raise ValueError(f"no coarsening factor in {list(cfactors)} fits N={N}")
    best = None
    for m in cands:
        for L in range(2, max_levels + 1):
            if N // m ** (L - 1) < 2:
                break
            o = MGRITOptions(max_levels=L, cfactor=m, tol=0, max_iter=K_f, relax=relax)
            ob = MGRITOptions(max_levels=L, cfactor=m, tol=0, max_iter=K_b, relax=relax)
            lc = None
            if spatial is not None:
                shape, lv = spatial
                lv = tuple(range(1, L)) if lv == "all" else tuple(lv)
                if lv and max(lv) >= L:
                    continue
                lc = spatial_level_cost(shape, lv, L)
            t = training_times(N, P, costs, o, ob, K_f, K_b, comm, level_cost=lc)
            if best is None or t["mgrit"]["train"] < best.times["mgrit"]["train"]:
                best = Plan(N, P, m, L, K_f, K_b, relax, t)
    return best


def scaling_table(N: int, costs: TrainCosts, comm: CommCost = CommCost(),
                  ranks: Sequence[int] = tuple(2 ** k for k in range(11)), **kw) -> list[Plan]:
    """:func:`plan` for each ``P`` in ``ranks`` with ``P <= N``."""
    return [plan(N, P, costs, comm, **kw) for P in ranks if P <= N]
