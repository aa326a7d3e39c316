"""Options of the MGRIT solver: one dataclass, each field with its default and advice.

The header is the manual (after XBraid's ``braid.h``). Validation happens in the constructor,
on every rank identically and before any communication, and raises ``ValueError`` naming the
value and what is allowed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence, Union

__all__ = ["MGRITOptions", "relaxation_sweeps", "NOT_CONVERGED_ACTIONS"]

#: Choices of ``MGRITOptions.on_not_converged``.
NOT_CONVERGED_ACTIONS = ("warn", "raise", "ignore")

Relax = Union[str, int]


def relaxation_sweeps(relax: Relax) -> int:
    """Number ``k`` of CF sweeps after the first F-sweep: ``"F"`` -> 0, ``"FCF"`` -> 1,
    ``"FCFCF"`` -> 2 (``F(CF)^k``), or ``k`` given as an int ``>= 0``.

    Raises:
        ValueError: any other string or a negative int.
    """
    if isinstance(relax, bool):
        raise ValueError(f"relaxation {relax!r} is not allowed: use 'F', 'FCF', 'FCFCF', ... or an int >= 0")
    if isinstance(relax, int):
        if relax < 0:
            raise ValueError(f"relaxation {relax} is not allowed: the number of CF sweeps must be >= 0")
        return relax
    if isinstance(relax, str):
        s = relax.upper()
        if s.startswith("F") and len(s) % 2 == 1 and all(s[i:i + 2] == "CF" for i in range(1, len(s), 2)):
            return (len(s) - 1) // 2
    raise ValueError(f"relaxation {relax!r} is not allowed: use 'F', 'FCF', 'FCFCF', ... (F(CF)^k) "
                     f"or the int k >= 0")


@dataclass
class MGRITOptions:
    """Settings of a nonlinear FAS-MGRIT solve.

    Attributes:
        max_levels: Maximum number of levels, >= 1 (default 2). 1 = sequential stepping (exact
            in one sweep, no parallelism across ranks). Two levels with a large ``cfactor`` suit
            few ranks and concurrent (batched) relaxation (Kirby et al. 2020: m = 64); more
            levels shorten the serial coarsest solve for many ranks.
        cfactor: Coarsening factor m >= 2, an int or a per-level list (default 2). Larger m:
            cheaper cycles, slower convergence; m*h*|lambda| should stay small (see notes).
        min_coarse: Stop coarsening when a level would have fewer intervals (default 2;
            Guenther et al. use 10).
        max_iter: Maximum number of MGRIT cycles, >= 1 (default 10). Inexact training uses a
            fixed small number (2 forward / 1 backward in TorchBraid) with ``tol = 0``.
        tol: Absolute tolerance on the C-point residual ``r = ||(||Phi(u_{c-1}) - u_c||_2)_c||``
            over fine C-points ``c > 0`` (outer norm: ``norm``), >= 0 (default 1e-9).
            Stopping rule (with ``rtol``): the solve ends after the first cycle with
            ``r < tol`` or ``r <= rtol * ||u_C||``, each test only when its tolerance is > 0;
            both 0 = a fixed-iteration solve of ``max_iter`` cycles (``converged`` stays
            False). With an initial guess (warm start) and a tolerance > 0, the F-relaxed guess
            is tested first: a converged guess costs 0 cycles (``iterations == 0``,
            ``residuals == []``, ``converged`` True; see :class:`mgrit.solver.MGRITResult`).
            Advice: the recommended criterion when the size of the states is known (as
            XBraid advises); float64 exact mode with states of order 1: 1e-10 .. 1e-12.
            Pitfalls: round-off keeps ``r`` above about ``eps * ||u_C||`` (eps = 2.2e-16 in
            float64, 1.2e-7 in float32), so a smaller ``tol`` is never met (``max_iter``
            cycles, ``converged`` False); ``tol`` is absolute, so rescaling the problem
            (larger activations, a summed instead of averaged loss for the adjoint) changes
            how tight it is -- ``rtol`` does not.
        rtol: Relative tolerance, >= 0 (default 0 = off): the solve also stops when
            ``r <= rtol * ||u_C||``, where ``||u_C|| = ||(||u_c||_2)_c||`` is the norm of the
            current C-point states ``c > 0`` in the same norm as ``r``, computed with ``r`` in
            the same allreduce (no extra cost; reported as ``MGRITResult.state_norm``). This
            scale does not depend on the initial guess, so cold and warm starts meet the same
            criterion: a warm start from a converged solve's states (the same batch solved
            again) needs 0 cycles, one from the states after ``j`` of a cold solve's ``K``
            cycles needs ``K - j`` (it continues the cold iteration). Unlike XBraid's and
            PyMGRIT's relative tolerance it is *not* relative to the initial residual, which
            makes a warm start from a converged guess (residual ~1e-16) chase an unreachable
            target and a zero guess with a zero residual meaningless. Advice: use it when the
            size of the states varies (activations from batch to batch; adjoints proportional
            to the loss gradient): 1e-10 .. 1e-12 in float64, >= 1e-6 in float32. Pitfalls: a
            solution near 0 (a strongly decaying chain, a zero loss gradient) makes ``||u_C||``
            ~ 0, so only an exact ``r == 0`` meets the relative test: add a small ``tol`` as
            an absolute floor; ``rtol`` below eps (see ``tol``) is never met.
        norm: ``"l2"`` (default; 2-norm over C-points of the per-point 2-norms, as PyMGRIT) or
            ``"inf"`` (maximum over C-points).
        cycle: ``"V"`` (default) or ``"F"`` (after each coarse correction an extra V-cycle on
            that level: costlier, converges faster on many levels).
        relax: Relaxation per level: ``"F"``, ``"FCF"`` (default), ``"FCFCF"``..., or the number
            of CF sweeps; a list gives one entry per level (last repeated). TorchBraid's MNIST
            setting is ``["F", "FCF"]`` (F on the fine level, FCF on coarse levels). FCF makes
            two coarse intervals exact per cycle (F: one).
        c_weight: Weight w of C-relaxation, ``u_c <- w*Phi(u_{c-1}) + (1-w)*u_c`` (default 1.0).
            XBraid suggests ~1.3 for diffusion and 1.4-1.8 for advection (saves 10-25% cycles).
            Must be > 0 and finite.
        skip_first_relaxation: XBraid's ``skip`` (``braid_SetSkip``; default False): the
            first down-cycle does no work. The fine level's C-point values are copied to every
            coarse level (XBraid's ``_braid_CopyFineToCoarse``) with a zero FAS right-hand
            side, the first cycle starts with the coarsest solve and goes up with the usual
            corrections and F-relaxations. The first cycle therefore costs a coarse solve plus
            one F-relaxation per level (no relaxation or restriction on the way down) and
            returns the coarse-grid solution, F-relaxed: a nested-iteration-like start.
            Because the coarse solve does not read the C-point values, an initial guess
            (warm start) is discarded by the first cycle (apart from the convergence test of
            the guess with a tolerance > 0, which may still stop after 0 cycles): use it with
            cold starts. Measured (``tests/nn/test_global_agreement.py``, dense tanh ResNet,
            cfactor 4, F/FCF, 2 forward / 1 adjoint cycles, float64, gradient error against
            serial backpropagation): N = 64, 2 levels: 0.081 with skip vs 0.077 without, 31%
            fewer forward steps; 3 levels: 0.15 vs 0.11 (output error 2.7e-2 vs 1.2e-2), 35%
            fewer steps; N = 256 and 1024 (3, 4 levels, measured once): 0.071 vs 0.064 and
            0.073 vs 0.066.
            Until issue 22 this option restricted the unrelaxed fine states instead (gradient
            errors 0.97 to 1.0 in the same runs).
        nested_iteration: Build the initial guess by solving the coarsest level and working up
            with V-cycles (PyMGRIT's default, True there; default False here: in training the
            warm start from the previous batch is cheaper). Cannot be combined with an
            explicit initial guess.
        batched: Use the propagator's ``step_batch`` to advance all intervals of a level on
            this rank at once (concurrent relaxation; default True). Falls back to single
            steps when the propagator has no batched kernel.
        check_finite: Raise ``FloatingPointError`` (on every rank) when the residual becomes
            NaN/Inf (default True). A NaN on any rank makes the residual NaN on every rank,
            for either ``norm``, so every rank reaches the same verdict.
        on_not_converged: What a solve with a tolerance (``tol`` or ``rtol`` > 0) does when
            ``max_iter`` cycles did not meet it (XBraid prints "Max. iterations reached" and
            returns): ``"warn"`` (default) issues one
            :class:`~mgrit.convergence.UnconvergedWarning` per solver object (the first time; on
            its communicator's rank 0) with the residual reached and the tolerances;
            ``"raise"`` raises :class:`~mgrit.convergence.UnconvergedError` on every rank (the
            verdict comes from the allreduced residual, so all ranks agree); ``"ignore"``
            returns silently (``MGRITResult.converged`` is False either way). A fixed-cycle
            solve (``tol = rtol = 0``, inexact training) never warns or raises. Advice:
            ``"raise"`` when exact gradients are required (tests, reference runs); a
            ``"warn"`` during training says the gradients are not exact: raise ``max_iter``
            or loosen ``tol`` (see its pitfalls: below ``eps * ||u_C||`` it is never met).
    """

    max_levels: int = 2
    cfactor: Union[int, Sequence[int]] = 2
    min_coarse: int = 2
    max_iter: int = 10
    tol: float = 1e-9
    rtol: float = 0.0
    norm: str = "l2"
    cycle: str = "V"
    relax: Union[Relax, Sequence[Relax]] = "FCF"
    c_weight: float = 1.0
    skip_first_relaxation: bool = False
    nested_iteration: bool = False
    batched: bool = True
    check_finite: bool = True
    on_not_converged: str = "warn"
    _sweeps: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_levels) or self.max_levels < 1:
            raise ValueError(f"max_levels={self.max_levels!r} is not allowed: use an int >= 1")
        if not is_int(self.min_coarse) or self.min_coarse < 1:
            raise ValueError(f"min_coarse={self.min_coarse!r} is not allowed: use an int >= 1")
        if not is_int(self.max_iter) or self.max_iter < 1:
            raise ValueError(f"max_iter={self.max_iter!r} is not allowed: use an int >= 1")
        facs = [self.cfactor] if is_int(self.cfactor) else self.cfactor
        if isinstance(facs, (str, bytes)) or not isinstance(facs, Sequence) or not facs:
            raise ValueError(f"cfactor={self.cfactor!r} is not allowed: use an int >= 2 or a list of ints >= 2")
        for f in facs:
            if not is_int(f) or f < 2:
                raise ValueError(f"cfactor={self.cfactor!r} is not allowed: every coarsening "
                                 f"factor must be an int >= 2")
        for name in ("tol", "rtol"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r} is not allowed: use a finite number >= 0")
        if self.norm not in ("l2", "inf"):
            raise ValueError(f"norm={self.norm!r} is not allowed: use 'l2' or 'inf'")
        if self.on_not_converged not in NOT_CONVERGED_ACTIONS:
            raise ValueError(f"on_not_converged={self.on_not_converged!r} is not allowed: use "
                             f"one of {list(NOT_CONVERGED_ACTIONS)}")
        if self.cycle not in ("V", "F"):
            raise ValueError(f"cycle={self.cycle!r} is not allowed: use 'V' or 'F'")
        w = self.c_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"c_weight={w!r} is not allowed: use a finite number > 0")
        relax = [self.relax] if isinstance(self.relax, (str, int)) else list(self.relax)
        if not relax:
            raise ValueError("relax=[] is not allowed: give 'F', 'FCF', ... or one entry per level")
        self._sweeps = [relaxation_sweeps(r) for r in relax]
        for name in ("skip_first_relaxation", "nested_iteration", "batched", "check_finite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed: use True or False")

    def sweeps(self, level: int) -> int:
        """CF sweeps on ``level`` (the last given entry repeats for deeper levels)."""
        return self._sweeps[min(level, len(self._sweeps) - 1)]
