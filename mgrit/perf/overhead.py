"""The MGRIT solver's own bookkeeping (level operations, state updates, residuals, set-up),
timed apart from any network: solves with a free propagator (:class:`_Null`) on one rank, fit
per single step, per batched call, per batched item and per solve. Part of the calibration of
the cost model (:mod:`mgrit.perf.calibration` re-exports both functions)."""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import warnings

import numpy as np
import torch
from mpi4py import MPI

from . import model as perf
from mgrit.propagator import Propagator
from mgrit.solver import MGRIT

__all__ = ["solver_overhead", "solver_overhead_fit"]

med = statistics.median


class _Null(Propagator):
    """A free step: solving with it times the solver's own bookkeeping. Steps return a cached
    tensor of zeros (no allocation, no arithmetic; the states stay zero), and a batched step
    written in place writes nothing -- the kernel's own write is in the step costs."""

    def __init__(self):
        self._zeros = {}

    def _z(self, like):
        key = (tuple(like.shape), like.dtype)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros_like(like)
        return self._zeros[key]

    def step(self, u, start, stop, level):
        return self._z(u)

    def step_batch(self, u, starts, stops, level):
        return self._z(u)

    def step_batch_into(self, u, starts, stops, level, out) -> None:
        pass


def _nonneg_lstsq(rows, y):
    """Least squares ``rows @ c ~ y`` with ``c >= 0``: the best of the unconstrained fits over
    every subset of free variables whose solution is non-negative (exact for a handful of
    unknowns)."""
    A, y = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    k, best = A.shape[1], None
    for mask in itertools.product((True, False), repeat=k):
        idx = [i for i in range(k) if mask[i]]
        c = np.zeros(k)
        if idx:
            c[idx] = np.linalg.lstsq(A[:, idx], y, rcond=None)[0]
        if (c >= -1e-12 * max(1.0, float(np.abs(c).max()))).all():
            c = np.clip(c, 0.0, None)
            r = float(np.sum((A @ c - y) ** 2))
            if best is None or r < best[0] * (1 - 1e-12):
                best = (r, c)
    return best[1]


def _null_solver(nn, shape, options, dtype, **changes):
    opts = dataclasses.replace(options, **changes)
    with warnings.catch_warnings():  # a one-level solve warns that it is sequential
        warnings.simplefilter("ignore")
        return MGRIT(_Null(), nn, shape, dtype=dtype, options=opts, comm=MPI.COMM_SELF)


def solver_overhead_fit(n, shape, options, timed, repeats=3, dtype=torch.float32):
    """MGRIT bookkeeping (level operations, state updates, residuals, set-up) from 1-rank
    solves with a free propagator: ``(StepCost(single, call, item), fixed)`` -- per single
    step, per batched call, per batched interval, and per solve -- the non-negative
    least-squares fit of the times of one-level solves over ``n`` and ``n // 2`` intervals and
    ``options`` solves over ``n``, ``n // 2`` and ``n // 4`` intervals against their
    ``SolverStats`` counters. ``timed(fn)``: seconds of ``fn()`` (it returns the MGRITResult)."""
    u0 = torch.zeros(shape, dtype=dtype)
    rows, ys = [], []

    def run(nn, **changes):
        s = _null_solver(nn, shape, options, dtype, **changes)
        st = s.solve(u0).stats
        rows.append([1.0, st.steps_single, st.steps_batched_calls, st.steps_batched_items])
        ys.append(med([timed(lambda: s.solve(u0)) for _ in range(repeats)]))
    for nn in (n, n // 2):
        run(nn, max_levels=1, max_iter=1)
    for nn in (n, n // 2, n // 4):
        if nn >= 2:
            run(nn)
    fixed, single, call, item = _nonneg_lstsq(rows, ys)
    return perf.StepCost(single, call, item), float(fixed)


def solver_overhead(n, shape, options, timed, repeats=3, dtype=torch.float32):
    """MGRIT bookkeeping (level operations, state updates, residuals) in the form of a
    :class:`mgrit.perf.StepCost` to add to the step costs, from 1-rank solves with a free
    propagator: per single step from a one-level solve over ``n`` intervals (the sequential
    sweep that coarse solves and one-interval F-relaxations run), per batched call and per
    interval from ``options`` solves over ``n`` and ``n // 2`` intervals (a least-squares fit
    after the singles' share). Without a per-solve term: :func:`solver_overhead_fit` has one."""
    u0 = torch.zeros(shape, dtype=dtype)

    def run(nn, **changes):
        s = _null_solver(nn, shape, options, dtype, **changes)
        st = s.solve(u0).stats
        return med([timed(lambda: s.solve(u0)) for _ in range(repeats)]), st
    t1, st1 = run(n, max_levels=1, max_iter=1)
    single = t1 / st1.steps_single
    rows = []
    for nn in (n, n // 2):
        t, st = run(nn)
        rows.append((st.steps_batched_calls, st.steps_batched_items,
                     max(t - single * st.steps_single, 0.0)))
    (c1, i1, y1), (c2, i2, y2) = rows
    det = c1 * i2 - c2 * i1
    if det == 0:  # same shape of work: no per-interval term
        return perf.StepCost(single, y1 / max(c1, 1), 0.0)
    call, item = (y1 * i2 - y2 * i1) / det, (c1 * y2 - c2 * y1) / det
    if call < 0 or item < 0:  # noise: keep one non-negative term
        call, item = (0.0, y1 / max(i1, 1)) if call < 0 else (y1 / max(c1, 1), 0.0)
    return perf.StepCost(single, call, item)
