"""Solver controls of :class:`mgrit.nn.LayerParallelResNet`: the public accessors the training
runtime, the cost model and the benchmarks use (the forward and adjoint solvers, the chain, the
latest states, the number of levels), the warm start, rebuilding the solvers with new options,
and the phase hook of the one-level exact path. A mixin: the ResNet owns the state
(``_fsolver``, ``_bsolver``, ``_chain``, ``_warm``, ``partition``, ...); this class only reads
and replaces it, without communication.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...options import MGRITOptions
from ...solver import MGRIT
from .spatial import spatial_error
from ..chains.propagators import ForwardChain

__all__ = ["SolverControls"]


class SolverControls:
    """Accessors and setters of a :class:`~mgrit.nn.LayerParallelResNet` (see there)."""

    @property
    def forward_solver(self) -> MGRIT:
        """The forward :class:`~mgrit.solver.MGRIT` solver (read-only; :meth:`set_options`
        replaces it). Its ``hierarchy`` gives this rank's fine points
        (``hierarchy.levels[0].lo/hi``), its ``stats`` the counters of all forwards."""
        return self._fsolver

    @property
    def backward_solver(self) -> MGRIT:
        """The adjoint :class:`~mgrit.solver.MGRIT` solver over the reversed chain (read-only;
        :meth:`set_options` replaces it). Its ``stats`` count all backwards."""
        return self._bsolver

    @property
    def chain(self) -> ForwardChain:
        """The forward propagator of this rank's layers (:class:`~mgrit.nn.chains.ForwardChain`:
        ``step``, ``step_batch``, ``refresh`` of the stacked-parameter snapshot)."""
        return self._chain

    @property
    def last_states(self) -> torch.Tensor | None:
        """This rank's states of the latest forward, ``(hi - lo, batch, *state_shape)`` (row
        ``i`` is the input of layer ``lo + i``; the last layer rank's last row is the output),
        or ``None`` before any forward. The tensor the forward produced, not a copy."""
        return None if self.last_forward is None else self.last_forward.states

    @property
    def n_levels(self) -> tuple[int, int]:
        """``(forward, adjoint)`` number of MGRIT levels on this rank's hierarchies (the same
        on every rank). ``(1, 1)``: training runs the one-level exact path
        (:mod:`mgrit.nn.resnet.pipelined`); a forward under ``torch.no_grad()`` does whenever the
        first entry is 1."""
        return self._fsolver.hierarchy.n_levels, self._bsolver.hierarchy.n_levels

    def warm_state(self) -> torch.Tensor | None:
        """The states the next training forward starts from (``(hi - lo, batch,
        *state_shape)``, this rank's fine points of :attr:`forward_solver`), or ``None`` (cold
        start; also when ``warm_start`` is off). The tensor itself, not a copy."""
        return self._warm

    def set_warm_state(self, states: torch.Tensor | None) -> None:
        """Set (``None``: clear) the forward warm start, e.g. from a checkpoint. ``states``:
        ``(hi - lo, batch, *state_shape)``, one row per fine point this rank owns; copied to
        the model's dtype and device. Local (no communication): call it on every rank with
        that rank's rows. Only an initial guess -- no gradient depends on it.

        Raises:
            ValueError: ``states`` is not a tensor of that shape (this rank only).
        """
        if states is None:
            self._warm = None
            return
        lv = self._fsolver.hierarchy.levels[0]
        rows = lv.hi - lv.lo
        if (not isinstance(states, torch.Tensor) or states.dim() != 2 + len(self.state_shape)
                or states.shape[0] != rows or states.shape[2:] != self.state_shape):
            got = tuple(states.shape) if isinstance(states, torch.Tensor) else type(states).__name__
            raise ValueError(f"warm state {got} is not allowed: use a tensor (rows {rows}, batch, "
                             f"*{tuple(self.state_shape)}) with one row per fine point "
                             f"{lv.lo}..{lv.hi - 1} of this rank, or None")
        self._warm = states.detach().to(device=self.device, dtype=self.dtype)

    def set_options(self, forward: MGRITOptions | None = None,
                    backward: MGRITOptions | None = None) -> None:
        """Rebuild the forward and/or adjoint solver with new :class:`~mgrit.options.MGRITOptions`
        (``None``: keep that one). No communication (only this rank's level hierarchy is
        recomputed): call it with the same options on every rank, between a backward and the
        next forward. The new solver keeps the old one's accumulated ``stats``; warm starts
        are kept (the fine points do not change). Changing levels switches between MGRIT and
        the one-level exact path (:attr:`n_levels`) from the next forward on. Phase tags set
        on a solver instance from outside are not carried over
        (:func:`mgrit.training.support.solvers.replace_solver` re-applies them).

        Raises:
            ValueError: an option set that is not ``MGRITOptions``, or a multilevel backward
                with ``adjoint="serial"`` (whose adjoint is a one-level sweep by definition).
        """
        for name, o in (("forward", forward), ("backward", backward)):
            if o is not None and not isinstance(o, MGRITOptions):
                raise ValueError(f"{name}={o!r} is not allowed: use MGRITOptions or None")
        if backward is not None and self.adjoint == "serial" and backward.max_levels != 1:
            raise ValueError(f"backward max_levels={backward.max_levels} is not allowed with "
                             f"adjoint='serial' (a one-level adjoint sweep): use max_levels=1, "
                             f"or build the model with adjoint='mgrit'")
        kw = dict(dtype=self.dtype, device=self.device, comm=self.comm)
        if forward is not None:
            new = MGRIT(self._chain, self.n_layers, options=forward, partition=self.partition,
                        spatial=self.spatial, **kw)
            new.stats, self._fsolver, self.fwd_opts = self._fsolver.stats, new, forward
        if backward is not None:
            sp = None if self.spatial is None else self.spatial.transposed()
            new = MGRIT(self._chain, self.n_layers, options=backward,
                        partition=self.partition.reversed(), spatial=sp, **kw)
            new.stats, self._bsolver, self.bwd_opts = self._bsolver.stats, new, backward
        error = spatial_error(self)  # new levels: their coarse sizes and the layers' probes
        if error is not None:
            raise ValueError(error)

    @property
    def phase_hook(self) -> Callable | None:
        """``hook(name)`` -> a context manager around the one-level exact path's work
        (:mod:`mgrit.nn.resnet.pipelined`), ``name`` ``"pipelined forward"`` (the forward sweep of
        this rank's layers and its messages) or ``"pipelined adjoint"`` (the backward's checks,
        agreement and gradient messages); default ``None``. The training runtime sets it to
        :class:`mgrit.training.support.faults.phase`, so that a failure there names its phase."""
        return vars(self).get("_phase_hook")

    @phase_hook.setter
    def phase_hook(self, hook: Callable | None) -> None:
        if hook is not None and not callable(hook):
            raise ValueError(f"phase_hook={hook!r} is not allowed: use a callable name -> "
                             f"context manager, or None")
        vars(self)["_phase_hook"] = hook

