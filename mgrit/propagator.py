"""The propagator interface: what a user supplies to the MGRIT solver.

A chain ``u_{i+1} = Phi_i(u_i)``, ``i = 0..N-1``, is defined by one object that can advance a
state across one interval of any level of the multigrid hierarchy. The solver never sees time
points, only **integer fine-grid indices**: the interval of level ``l`` that starts at level
point ``j`` spans the fine indices ``[j*S_l, (j+1)*S_l]`` where ``S_l`` is the product of the
coarsening factors below level ``l`` (``S_0 = 1``). A propagator therefore receives
``start``/``stop`` fine indices; ``stop - start`` is the number of fine intervals covered.

Default coarse propagator (Guenther et al. 2020; TorchBraid; PyMGRIT's ``simple_setup_problem``):
rediscretize the same scheme with the step ``(stop - start) * h``, using whatever index-dependent
data the fine step at ``start`` uses (for a ResNet: the parameters of layer ``start``, the
C-point's layer).

Pattern of PyMGRIT's ``Application`` (one small interface, validation in constructors) and
XBraid's ``braid_PtFcnStep``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

__all__ = ["Propagator"]


class Propagator(ABC):
    """Advance states of one chain across intervals of a level of the MGRIT hierarchy.

    Subclasses implement :meth:`step`; they may override :meth:`step_batch` with a genuinely
    batched version (one tensor operation for many intervals), which the solver uses for
    concurrent relaxation: all intervals of a level owned by a rank are independent, so their
    ``k``-th steps are applied at once. The default :meth:`step_batch` loops over :meth:`step`.

    A propagator may define ``n_intervals`` (its number of fine intervals ``N``); the solver
    then checks it against its own ``n_intervals``.

    Contract:

    * ``step`` must not modify its input in place and must return a new tensor of the same
      shape, dtype and device as ``u``;
    * results must depend only on ``(u, start, stop, level)`` — the solver calls each step many
      times per solve and in any order;
    * ``step_batch(U, starts, stops, level)[b]`` must equal ``step(U[b], starts[b], stops[b],
      level)`` to round-off.
    """

    @abstractmethod
    def step(self, u: torch.Tensor, start: int, stop: int, level: int) -> torch.Tensor:
        """Return ``Phi(u)``: the state at fine index ``stop`` given the state ``u`` at ``start``.

        Args:
            u: state at fine index ``start``; any shape, float32 or float64, CPU or CUDA.
            start: fine-grid index the interval starts at, ``0 <= start < N``.
            stop: fine-grid index the interval ends at, ``start < stop <= N``;
                ``stop - start = S_level`` (the level's stride in fine intervals).
            level: multigrid level, 0 = finest. Informational for most propagators.

        Returns:
            A new tensor shaped like ``u``.
        """

    def step_batch(self, u: torch.Tensor, starts: Sequence[int], stops: Sequence[int],
                   level: int) -> torch.Tensor:
        """Apply :meth:`step` to ``B`` independent intervals at once.

        Args:
            u: stacked states, shape ``(B, *state_shape)``.
            starts, stops: fine indices of each interval (length ``B``); the solver passes
                ``range`` objects (arithmetic progressions) of equal interval lengths.
            level: multigrid level of all ``B`` intervals.

        Returns:
            Tensor of shape ``(B, *state_shape)``. The default loops over :meth:`step`;
            override with a batched kernel for concurrent relaxation.
        """
        return torch.stack([self.step(u[b], int(starts[b]), int(stops[b]), level)
                            for b in range(u.shape[0])])

    @property
    def batched(self) -> bool:
        """True when :meth:`step_batch` is overridden (counted as batched applications)."""
        return type(self).step_batch is not Propagator.step_batch
