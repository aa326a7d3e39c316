"""The runtime's hands on the MGRIT solvers of a network's segments: phase tags on the solves
(so a failure report names the phase: ``"forward relaxation"``, ``"coarse solve"``,
``"adjoint"``, see :mod:`mgrit.training.support.faults`), rebuilding a solver with new options (the
guard, the bias monitor, a checkpoint's saved options) and the states of a failed solve (the
guard names the non-finite layer from them).

The segments come from the network protocol (``net.solver_segments()``,
:mod:`mgrit.nn.protocol`); only public accessors of :class:`~mgrit.nn.LayerParallelResNet`
are used, except the two private reads named below.

Depends on :mod:`mgrit.training.support.faults` (``phase``).
"""
from __future__ import annotations

from .faults import phase

__all__ = ["instrument_solver", "instrument_resnet", "instrument", "replace_solver",
           "solver_states"]


def instrument_solver(solver, relax_phase: str, coarse_phase: str | None = None) -> None:
    """Wrap ``solver.solve`` and its recursive ``_cycle`` (instance attributes, the class is
    untouched) so that work on the coarsest level runs in ``coarse_phase`` and everything else
    in ``relax_phase``. Idempotent. (The one patch of a private method left: the solver has no
    public per-level hook yet.)"""
    if getattr(solver, "_layerpar_phases", None) == (relax_phase, coarse_phase):
        return
    cls = type(solver)
    coarse_phase = coarse_phase or relax_phase

    def solve(*args, **kwargs):
        with phase(relax_phase):
            return cls.solve(solver, *args, **kwargs)

    def _cycle(l, *args, **kwargs):
        name = coarse_phase if solver.hierarchy.levels[l].is_coarsest else relax_phase
        with phase(name):
            return cls._cycle(solver, l, *args, **kwargs)

    solver.solve, solver._cycle = solve, _cycle
    solver._layerpar_phases = (relax_phase, coarse_phase)


def instrument_resnet(resnet) -> None:
    """Tag the forward solve of a :class:`~mgrit.nn.LayerParallelResNet` as
    ``"forward relaxation"`` / ``"coarse solve"`` and the backward solve as ``"adjoint"``;
    the one-level exact path (no solve) as ``"pipelined forward"`` / ``"pipelined adjoint"``
    through the model's public ``phase_hook``. Re-applied automatically by
    :func:`replace_solver` after it rebuilds a solver. Idempotent."""
    instrument_solver(resnet.forward_solver, "forward relaxation", "coarse solve")
    instrument_solver(resnet.backward_solver, "adjoint", "adjoint")
    resnet.phase_hook = phase


def instrument(net) -> None:
    """:func:`instrument_resnet` on every MGRIT segment of ``net`` (a
    :class:`~mgrit.nn.protocol.TrainableNet`); no-op for serial networks."""
    for seg in net.solver_segments():
        instrument_resnet(seg)


def replace_solver(resnet, which: str, options) -> None:
    """Rebuild the ``"forward"`` or ``"backward"`` MGRIT solver of ``resnet`` (a
    :class:`~mgrit.nn.LayerParallelResNet`) with ``options`` (no communication: only the local
    hierarchy is recomputed). Keeps the accumulated counters and the phase tags
    (:meth:`LayerParallelResNet.set_options`, then :func:`instrument_solver` again where the
    old solver had tags). Raises ValueError for another ``which``."""
    if which not in ("forward", "backward"):
        raise ValueError(f"which={which!r} is not allowed: use 'forward' or 'backward'")
    attr = "forward_solver" if which == "forward" else "backward_solver"
    old = getattr(resnet, attr)
    resnet.set_options(**{which: options})
    phases = getattr(old, "_layerpar_phases", None)
    if phases is not None:
        instrument_solver(getattr(resnet, attr), *phases)


def solver_states(seg, which: str) -> tuple | None:
    """``(states, lo)``: the current fine-level states of ``seg``'s ``"forward"`` or
    ``"backward"`` solver, also after the solve raised (NaN/Inf residual); None before any
    solve. Reads the solver's private state arrays: wanted instead a public
    ``MGRIT.current_states()`` (or the partial MGRITResult attached to its exception)."""
    st = getattr(seg.forward_solver if which == "forward" else seg.backward_solver, "_st", None)
    return (st[0].u, st[0].lv.lo) if st else None
