"""Nonlinear multigrid reduction in time (MGRIT) with FAS coarse grids, over MPI.

Solves the chain ``u_{i+1} = Phi_i(u_i)``, ``i = 0..N-1``, for all states at once, in parallel
over the index ``i`` distributed over the ranks of a communicator. The algorithm follows
Falgout et al. 2014 ("Parallel time integration with multigrid", SISC) and Falgout, Manteuffel,
Southworth, Schroder 2017 (nonlinear FAS MGRIT), in the exact cycle structure of PyMGRIT 1.0.6
(Hahne & Friedhoff), so that residual histories agree with it to round-off:

* V-cycle on level ``l``: [F-relax on the first cycle or on coarse levels] ``(CF)^k`` -> FAS
  restriction (injection) -> recurse -> correction at C-points -> F-relax; F-cycle: after that,
  one more V-cycle on level ``l > 0`` without the leading F-relaxation.
* coarsest level: a sequential sweep, pipelined across ranks (each rank waits for its left
  neighbour), instead of PyMGRIT's gather to rank 0;
* nested iteration: solve the coarsest level, then inject and V-cycle upwards;
* residual after each cycle: ``||(||Phi(u_{c-1}) - u_c||_2)_c||`` over fine C-points ``c > 0``
  (2-norm or inf-norm over points), identical on every rank (a NaN on any rank is NaN on
  every rank); computed in the same allreduce as the norm ``||(||u_c||_2)_c||`` of those
  C-point states, the scale of ``rtol``;
* stopping: after the first cycle whose residual ``r`` meets ``r < tol`` or ``r <= rtol *
  ||u_C||`` (see :class:`~mgrit.options.MGRITOptions`); with an initial guess (warm start) the
  guess is F-relaxed and checked first, so a converged guess costs no cycle; ``max_iter``
  cycles without meeting a tolerance warn once per solver or raise on every rank
  (``MGRITOptions.on_not_converged``);
* XBraid's skip (``skip_first_relaxation``): the first down-cycle copies the fine C-values
  down with zero FAS right-hand sides and starts with the coarse solve.

The FAS right-hand side and the coarse-grid correction are evaluated in PyMGRIT's operation
order, so residual histories agree with PyMGRIT's to the last bits when the propagator computes
its step sizes the same way (PyMGRIT: differences of ``np.linspace`` time points, ``t[stop] -
t[start]``, rather than ``(stop - start) * h``).

Public surface: :class:`MGRIT`, :class:`MGRITResult` (defined in :mod:`mgrit.result`) and,
from :mod:`mgrit.convergence`, :class:`UnconvergedWarning`, :class:`UnconvergedError`; options
in :mod:`mgrit.options`.
"""
from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np
import torch
from mpi4py import MPI

from .collective import guarded
from .comm import Exchanger, raise_agreed
from .convergence import UnconvergedError, UnconvergedWarning, met, not_converged
from .grid import Hierarchy, Partition, warn_single_level
from .levelops import LevelOps, LevelState
from .options import MGRITOptions
from .propagator import Propagator
from .result import MGRITResult
from .spatial import level_shapes
from .stats import SolverStats

__all__ = ["MGRIT", "MGRITResult", "UnconvergedWarning", "UnconvergedError"]

class MGRIT:
    """FAS-MGRIT solver for one chain, distributed over the ranks of ``comm``.

    Args:
        propagator: the chain's :class:`~mgrit.propagator.Propagator` (every level).
        n_intervals: ``N >= 1`` fine intervals (chain points ``0..N``); ``N >= P``.
        state_shape: shape of one state (default ``()``, a scalar). May be overridden per solve
            (e.g. a smaller last mini-batch).
        dtype: ``torch.float32`` or ``torch.float64`` (default), also bfloat16/float16.
        device: device of the states (default CPU). CUDA states are staged through the host
            for messages unless MPI is CUDA-aware (see :mod:`mgrit.comm`).
        options: :class:`~mgrit.options.MGRITOptions` (default ``MGRITOptions()``).
        comm: mpi4py communicator over which the chain is distributed (default
            ``MPI.COMM_SELF``: serial). The solver communicates on nothing else.
        partition: ownership of fine points (default :meth:`Partition.even`). Every rank
            must pass an identical partition.
        spatial: ``None`` (default) or a :class:`~mgrit.spatial.SpatialCoarsening` (or its
            :meth:`~mgrit.spatial.SpatialCoarsening.transposed`): the states of its levels live
            on coarser grids; states are then ``(batch, C, *spatial)`` and the propagator's
            coarse steps receive coarse states. The fixed point does not change.

    Raises:
        ValueError: bad ``n_intervals`` (< 1 or < P), a non-floating dtype, a partition that
            does not match ``N``/``P``, or a wrong propagator type -- raised identically on
            every rank, before any communication.
    """

    def __init__(self, propagator: Propagator, n_intervals: int, state_shape: Sequence[int] = (),
                 dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu",
                 options: MGRITOptions | None = None, comm: MPI.Comm | None = None,
                 partition: Partition | None = None, spatial=None):
        if not isinstance(propagator, Propagator):
            raise ValueError(f"propagator must be a mgrit.Propagator, got {type(propagator).__name__}")
        if isinstance(n_intervals, bool) or not isinstance(n_intervals, int) or n_intervals < 1:
            raise ValueError(f"n_intervals={n_intervals!r} is not allowed: use an int >= 1")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype!r} is not allowed: use a floating torch dtype "
                             f"(torch.float64 or torch.float32)")
        n_prop = getattr(propagator, "n_intervals", None)
        if isinstance(n_prop, int) and n_prop != n_intervals:
            raise ValueError(f"the propagator is defined on {n_prop} intervals but "
                             f"n_intervals={n_intervals}: they must agree")
        options = MGRITOptions() if options is None else options
        if not isinstance(options, MGRITOptions):
            raise ValueError(f"options must be MGRITOptions, got {type(options).__name__}")
        self.comm = MPI.COMM_SELF if comm is None else comm
        nprocs, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        if partition is None:
            partition = Partition.even(n_intervals, nprocs)
        elif partition.n_intervals != n_intervals or partition.nprocs != nprocs:
            raise ValueError(f"{partition!r} does not match N={n_intervals} and P={nprocs}")
        self.propagator = propagator
        self.n_intervals = n_intervals
        self.state_shape = torch.Size(state_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.options = options
        self.partition = partition
        if spatial is not None and not all(callable(getattr(spatial, m, None)) for m in
                                           ("coarsens", "restrict", "prolong", "level_shapes")):
            raise ValueError(f"spatial={spatial!r} is not allowed: use a "
                             f"mgrit.spatial.SpatialCoarsening or None")
        self.spatial = spatial
        self.hierarchy = Hierarchy(partition, self.rank, options.cfactor, options.max_levels,
                                   options.min_coarse)
        self.root = partition.owner(0)
        if options.max_levels > 1 and self.hierarchy.n_levels == 1 and self.rank == 0:
            warn_single_level(propagator, n_intervals, options.cfactor, options.min_coarse)
        bare = [lv for lv in range(1, self.hierarchy.n_levels) if spatial is not None
                and spatial.coarsens(lv) and options.sweeps(lv - 1) == 0]
        if bare and self.rank == 0:  # (I - P R) e_C is never relaxed: measured stagnation
            warnings.warn(f"spatial coarsening of level(s) {bare} under F-relaxation on the "
                          f"level above: the C-point error the coarse grid cannot represent is "
                          f"never corrected and the solve stagnates; use relax='FCF' there "
                          f"(docs/features/spatial_coarsening.rst)", stacklevel=2)
        self.stats = SolverStats()  # accumulated over all solves
        #: ``None`` (default) or a recorder with the hooks of :class:`mgrit.perf.trace.Tracer`:
        #: each solve then records this rank's operations, messages and collectives.
        self.tracer = None
        self._warned = False  # on_not_converged="warn": once per solver

    # -- validation ----------------------------------------------------------------------
    def _local_error(self, u0, initial_guess, shape) -> str | None:
        def bad(t, what, want_shape):
            if not isinstance(t, torch.Tensor):
                return f"{what} must be a torch.Tensor, got {type(t).__name__}"
            if t.shape != want_shape or t.dtype != self.dtype or t.device != self.device:
                return (f"{what} has shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}; "
                        f"expected shape {tuple(want_shape)}, dtype {self.dtype}, device {self.device}")
            return None

        if self.rank == self.root:
            if u0 is None:
                return f"u0 is required on rank {self.rank}, which owns fine point 0"
            err = bad(u0, "u0", shape)
            if err:
                return err
            if not bool(torch.isfinite(u0).all()):
                return "u0 contains NaN or Inf values"
        if initial_guess is not None:
            if self.options.nested_iteration:
                return "an initial guess cannot be combined with nested_iteration=True"
            lo, hi = self.hierarchy.levels[0].lo, self.hierarchy.levels[0].hi
            err = bad(initial_guess, f"initial_guess on rank {self.rank}",
                      torch.Size((hi - lo, *shape)))
            if err:
                return err
        return None

    def check_input(self, u0: torch.Tensor | None, initial_guess: torch.Tensor | None = None,
                    state_shape: Sequence[int] | None = None,
                    stats: SolverStats | None = None, error: str | None = None) -> torch.Size:
        """The checks :meth:`solve` makes before any other communication, agreed over the
        communicator (one small allgather with the collective deadline when it has more than
        one rank): ``u0`` on the rank owning point 0 (shape ``state_shape``, the solver's dtype
        and device, finite values), ``initial_guess`` (shape ``(hi - lo, *state_shape)``), and
        the same ``state_shape`` on every rank; ``error``: the caller's own finding on this
        rank, agreed with them. Returns the state shape (``state_shape``, default the
        constructor's).

        Raises:
            ValueError: on every rank, naming each rank's problem.
        """
        shape = self.state_shape if state_shape is None else torch.Size(state_shape)
        if error is None:
            try:  # a check that fails on one rank still meets the others
                error = self._local_error(u0, initial_guess, shape)
            except Exception as exc:  # noqa: BLE001 - reported on every rank
                error = f"checking the input raised {type(exc).__name__}: {exc}"
        raise_agreed(self.comm, error, stats,
                     same=tuple(shape), what="state shape (e.g. a different batch size per rank)")
        return shape

    # -- solve ---------------------------------------------------------------------------
    # a failure on one rank ends the job (mgrit.collective); the NaN/Inf verdict is agreed
    @guarded("MGRIT solve", agreed_types=(FloatingPointError, UnconvergedError))
    @torch.no_grad()
    def solve(self, u0: torch.Tensor | None, initial_guess: torch.Tensor | None = None,
              state_shape: Sequence[int] | None = None) -> MGRITResult:
        """Solve the chain from ``u0``.

        Args:
            u0: state at fine point 0, shape ``state_shape``; required on the rank owning
                point 0 (``self.root``), ignored elsewhere.
            initial_guess: this rank's fine states ``(hi - lo, *state_shape)`` to start from
                (warm start); default zeros. Its row for point 0 is replaced by ``u0``.
            state_shape: overrides the constructor's state shape for this solve.

        Stopping (``options.tol``, ``options.rtol``; see :class:`~mgrit.options.MGRITOptions`):
        after each cycle the C-point residual ``r`` and the C-point state norm ``s`` are
        reduced in one allreduce; the solve stops when ``r < tol`` or ``r <= rtol * s`` (each
        test only when its tolerance is > 0), else after ``max_iter`` cycles. With an
        ``initial_guess`` and a tolerance > 0, the guess is first F-relaxed (the first cycle's
        leading F-relaxation, not repeated) and the same test applied to it: a guess that
        meets it returns after 0 cycles (``iterations == 0``, ``residuals == []``,
        ``converged``, ``initial_residual`` = its residual, states = the F-relaxed guess).
        The check reuses its C-point steps in the first cycle, so it costs one allreduce (and,
        with ``skip_first_relaxation``, the F-relaxation that option would have skipped).

        Returns:
            :class:`MGRITResult` with this rank's states.

        Raises:
            ValueError: wrong ``u0``/``initial_guess`` shape, dtype or device, NaN/Inf in
                ``u0`` -- on every rank (agreed by one collective before the solve).
            FloatingPointError: the residual became NaN/Inf (every rank, same iteration)
                when ``options.check_finite``.
            UnconvergedError: ``max_iter`` cycles did not meet ``tol``/``rtol`` and
                ``options.on_not_converged == "raise"`` (every rank); with ``"warn"`` (the
                default) an :class:`UnconvergedWarning` instead, once per solver.
        """
        opts, levels = self.options, self.hierarchy.levels
        stats, prop, tracer = SolverStats(), self.propagator, self.tracer
        if tracer is not None:  # records this solve (mgrit.perf.trace); prop: timed steps
            stats.tracer, prop = tracer, tracer.begin_solve(self)
        shape = self.check_input(u0, initial_guess, state_shape, stats)
        ex = Exchanger(self.comm, shape, self.dtype, self.device, stats)
        ops = LevelOps(prop, ex, stats, opts.batched, float(opts.c_weight), self.spatial,
                       level_shapes(self.spatial, shape, len(levels)))
        self._ops, self._stats = ops, stats
        self._st = [LevelState(lv, ops.state_shape(lv.index), self.dtype, self.device,
                               with_rhs=lv.index > 0, zero=lv.index > 0) for lv in levels]
        self._initialize(self._st[0], initial_guess)
        if self.rank == self.root:
            x = u0.unsqueeze(0)
            for st in self._st:
                x = x if st.lv.index == 0 else ops.down(x, st)
                st.u[0] = x[0]
        result = MGRITResult(self._st[0].u, levels[0].lo, levels[0].hi, stats=stats)
        if len(levels) == 1:
            with stats.timed("coarse"):
                ops.coarse_solve(self._st[0])
            result.residuals.append(0.0)  # sequential stepping satisfies every equation exactly
            result.iterations, result.converged = 1, True
        else:
            if opts.nested_iteration:
                self._nested_iteration()
            prechecked = initial_guess is not None and (opts.tol > 0 or opts.rtol > 0)
            if prechecked:  # a converged warm start costs no cycle
                with stats.timed("relax"):
                    ops.f_relax(self._st[0])  # the C-point residual holds F-equations exact
                res, result.state_norm = self._residual()
                result.initial_residual = res
                if opts.check_finite and not math.isfinite(res):
                    raise FloatingPointError(f"MGRIT residual of the initial guess is {res}: "
                                             f"the guess, or a step from it, has NaN/Inf values")
                result.converged = met(opts, res, result.state_norm)
            it = 0
            while not result.converged and it < opts.max_iter:
                self._cycle(0, opts.cycle, it, not (prechecked and it == 0),
                            opts.skip_first_relaxation and it == 0)
                res, result.state_norm = self._residual()
                result.residuals.append(res)
                result.iterations = it = it + 1
                if opts.check_finite and not math.isfinite(res):
                    raise FloatingPointError(f"MGRIT residual is {res} after cycle {it} "
                                             f"(history {result.residuals}): the iteration diverged")
                result.converged = met(opts, res, result.state_norm)
        ops.waitall()
        self.stats += stats
        if tracer is not None:
            tracer.end_solve(stats)
            del stats.tracer  # the class default again: the result's counters hold no recorder
        if not result.converged and (opts.tol > 0 or opts.rtol > 0):
            self._warned = not_converged(opts, result.final_residual, result.state_norm,
                                         self._warned, self.rank == 0)
        return result

    def _initialize(self, st: LevelState, initial_guess) -> None:
        """The finest level's initial guess: ``initial_guess``, else zeros -- written only where
        it is read before being computed (an 8 MB state array costs a millisecond to clear):
        a one-level sweep writes every point from its predecessor, a first F-relaxation every
        F-point from the C-points (which are cleared); with ``skip_first_relaxation`` (or any
        other order) everything is cleared. ``u[0]`` (the initial value) is set afterwards."""
        lv = st.lv
        if initial_guess is not None:
            st.u.copy_(initial_guess)
        elif lv.is_coarsest:
            pass
        elif self.options.skip_first_relaxation:
            st.u.zero_()
        else:
            c = lv.c_points()
            if len(c):
                st.u[c.start - lv.lo:c[-1] - lv.lo + 1:c.step].zero_()

    def _cycle(self, l: int, cycle: str, iteration: int, first_f: bool, skip: bool) -> None:
        st, ops, stats = self._st[l], self._ops, self._stats
        if st.lv.is_coarsest:
            with stats.timed("coarse"):
                ops.coarse_solve(st)
            return
        if skip:  # XBraid's skip: copy the fine C-values down, start with the coarse solve
            with stats.timed("restrict"):
                ops.copy_down(st, self._st[l + 1])
        else:
            with stats.timed("relax"):
                if first_f and (l > 0 or iteration == 0):
                    ops.f_relax(st)
                for _ in range(self.options.sweeps(l)):
                    ops.c_relax(st)
                    ops.f_relax(st)
            with stats.timed("restrict"):
                ops.restrict(st, self._st[l + 1])
        self._cycle(l + 1, cycle, iteration, True, skip)
        with stats.timed("relax"):
            ops.correct(st, self._st[l + 1])
            ops.f_relax(st)
        if l > 0 and cycle == "F":
            self._cycle(l, "V", iteration, False, False)

    def _nested_iteration(self) -> None:
        """PyMGRIT's nested iteration: coarsest solve, then inject and V-cycle upwards."""
        n = len(self._st)
        with self._stats.timed("coarse"):
            self._ops.coarse_solve(self._st[-1])
        for l in range(n - 2, -1, -1):
            self._ops.inject(self._st[l], self._st[l + 1])
            if l > 0:
                self._cycle(l, "V", 0, True, False)

    def _residual(self) -> tuple[float, float]:
        """Global C-point residual norm on the finest level and the norm of the same C-point
        states (the scale of ``rtol``), in one allreduce; identical on every rank.

        Not-finite values reach every rank: MPI's ``MAX`` does not propagate NaN (its result
        depends on the reduction order), so each rank maps its NaNs to ``+inf`` and adds a
        NaN flag (a third entry, reduced with the others); a flagged reduction returns NaN
        for both norms on every rank, from the same reduced numbers, for every ``norm``."""
        st, stats = self._st[0], self._stats
        inf = self.options.norm == "inf"
        with stats.timed("residual"):
            targets, phi = self._ops.incoming(st, st.lv.cfactor or 1)
            local = np.zeros(3)
            if len(targets):
                u = st.u[targets.start - st.lv.lo:targets[-1] - st.lv.lo + 1:targets.step]
                rows = torch.stack([phi - u, u]).reshape(2, len(targets), -1)
                norms = torch.linalg.vector_norm(rows, dim=2)  # (2, points): residual, state
                norms = norms.to("cpu", torch.float64)  # float32 squares could overflow
                local[:2] = (norms.amax(dim=1) if inf else (norms ** 2).sum(dim=1)).numpy()
                nan = np.isnan(local[:2])
                local[2] = float(nan.any())
                local[:2][nan] = np.inf
            self._ops.waitall()
            if self.comm.Get_size() > 1:
                stats.allreduces += 1
                t0 = stats.tracer.clock() if stats.tracer is not None else 0.0
                if inf:  # exact: the same maximum on every rank whatever the reduction order
                    self.comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
                else:  # mpi4py's object reduction: one result, broadcast (identical bits)
                    local = self.comm.allreduce(local, op=MPI.SUM)
                if stats.tracer is not None:
                    stats.tracer.collective("residual", t0, stats.tracer.clock())
        if local[2] > 0:
            return math.nan, math.nan
        r, s = float(local[0]), float(local[1])
        return (r, s) if inf else (math.sqrt(r), math.sqrt(s))

    # -- utilities -----------------------------------------------------------------------
    def gather(self, result: MGRITResult, root: int = 0) -> torch.Tensor | None:
        """Collect all fine states ``(N + 1, *state_shape)`` on ``root`` (``None`` elsewhere),
        with the buffer API (bytes, so dtypes are preserved exactly). For tests and demos."""
        states = result.states.detach().cpu().contiguous()
        buf = states.reshape(-1).view(torch.uint8).numpy()
        counts = self.comm.gather(buf.nbytes, root=root)
        firsts = self.comm.gather(result.lo, root=root)
        if self.comm.Get_rank() == root:
            out = np.empty(sum(counts), dtype=np.uint8)
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
            self.comm.Gatherv(buf, [out, counts, displs, MPI.BYTE], root=root)
            pieces = []
            for r in np.argsort(firsts):
                pieces.append(out[displs[r]:displs[r] + counts[r]])
            t = torch.from_numpy(np.concatenate(pieces)).view(self.dtype)
            return t.reshape((self.n_intervals + 1, *states.shape[1:])).to(self.device)
        self.comm.Gatherv(buf, None, root=root)
        return None
