"""Settings and per-cycle record of the MG/Opt driver (:mod:`mgrit.multilevel.mgopt`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..nn.depth import PROLONGATIONS, RESTRICTIONS

__all__ = ["MGOptOptions", "CycleRecord"]


@dataclass(frozen=True)
class MGOptOptions:
    """Settings of :class:`MGOpt` (defaults in brackets, advice after).

    Attributes:
        pre_smooth: inner-optimizer steps before the coarse correction [1].
        post_smooth: inner-optimizer steps after it [1]. With ``correction=False`` one cycle is
            ``pre_smooth + post_smooth`` plain optimizer steps.
        coarse_steps: inner-optimizer steps on the coarsest level [2]; more steps solve the
            coarse problem better at coarse cost (cheap: ``1/f`` of the layers per level).
        correction: compute and apply the coarse correction [True]; False reduces MG/Opt to the
            inner optimizer exactly (bitwise).
        prolong: ``"constant"`` [default] or ``"linear"`` (``P``).
        restrict: ``"average"`` [default] or ``"injection"`` (``R``; ``R_g = P^T`` always).
        line_search: Armijo backtracking on the prolonged correction [True]; False applies
            ``alpha0 * e`` unconditionally.
        alpha0, c1, shrink, max_backtracks: first trial step [1.0], Armijo constant [1e-4],
            step reduction per try [0.5], tries after the first [10].
        reset_coarse_optimizers: a fresh inner optimizer (no momentum/Adam moments/L-BFGS
            history) on every visit of a coarse level [True]; the coarse objective's shift and
            start point change every cycle. The fine level's optimizer always persists.
    """

    pre_smooth: int = 1
    post_smooth: int = 1
    coarse_steps: int = 2
    correction: bool = True
    prolong: str = "constant"
    restrict: str = "average"
    line_search: bool = True
    alpha0: float = 1.0
    c1: float = 1e-4
    shrink: float = 0.5
    max_backtracks: int = 10
    reset_coarse_optimizers: bool = True

    def __post_init__(self):
        for name, lo in (("pre_smooth", 0), ("post_smooth", 0), ("coarse_steps", 1),
                         ("max_backtracks", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} is not allowed: use an int >= {lo}")
        if self.prolong not in PROLONGATIONS:
            raise ValueError(f"prolong={self.prolong!r} is not allowed: use one of {PROLONGATIONS}")
        if self.restrict not in RESTRICTIONS:
            raise ValueError(f"restrict={self.restrict!r} is not allowed: use one of "
                             f"{RESTRICTIONS}")
        for name in ("c1", "shrink"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
                raise ValueError(f"{name}={v!r} is not allowed: use a number in (0, 1)")
        a = self.alpha0
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0 or a == float("inf"):
            raise ValueError(f"alpha0={a!r} is not allowed: use a finite number > 0")


@dataclass
class CycleRecord:
    """One :meth:`MGOpt.step`.

    Attributes:
        loss: the fine objective at the cycle's first evaluation (before any update; NaN if the
            cycle evaluated nothing on the fine level).
        alphas: ``alphas[l]``: the step taken along the correction of level ``l`` from level
            ``l+1``; ``0.0`` when rejected (no descent direction or no Armijo step); empty
            without correction.
        slopes: ``slopes[l] = <grad F_l, e_l>`` (negative: a descent direction).
        gradients, values: evaluations per level during this cycle.
    """

    loss: float = float("nan")
    alphas: list = field(default_factory=list)
    slopes: list = field(default_factory=list)
    gradients: list = field(default_factory=list)
    values: list = field(default_factory=list)
