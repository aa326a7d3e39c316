"""Rank-local MGRIT operations on one level: F-/C-relaxation, FAS restriction, correction and
the pipelined coarsest-level solve, with the neighbour messages they need.

Conventions (see :mod:`mgrit.grid`): a rank owns level points ``[lo, hi)``; the step leaving
point ``j`` is evaluated by the owner of ``j`` and, when ``j + 1`` belongs to another rank, its
*result* ``Phi(u_j)`` is sent there. Every operation therefore sends at most one state to
``level.next`` and receives at most one from ``level.prev``; sends are non-blocking and
issued before the rank waits for its own receive, so no cyclic wait can arise.

Concurrent relaxation: the F-intervals of a level owned by a rank are independent, so the
``k``-th step of all of them is one call of ``Propagator.step_batch`` on a strided view of the
state array (Kirby et al. 2020 ran them on separate CUDA streams; a batched kernel does the
same on any device). The F-points before the first owned C-point depend on the left neighbour
and are stepped afterwards, while that message is in flight. A propagator may also provide
``step_batch_into(u, starts, stops, level, out)``, which writes exactly the values of
``step_batch(u, starts, stops, level)`` into ``out`` (a strided view of the state array that
shares no element with ``u``): F-relaxation then writes its batched steps in place, without a
temporary and its copy (:class:`mgrit.nn.chains.ForwardChain` does).

The level equations are FAS equations ``u_j = Phi(u_{j-1}) + g_j`` (``g = 0`` on the finest
level, where ``g`` is ``None``); point 0 holds the initial value and is never updated.
"""
from __future__ import annotations

import torch

from .comm import Exchanger
from .grid import Level
from .propagator import Propagator
from .stats import SolverStats

__all__ = ["LevelState", "LevelOps"]

_TAG_F, _TAG_IN, _TAG_COARSE = 1, 2, 3


def _tag(op: int, level: int) -> int:
    return op * 1000 + level


def _sl(r: range, lo: int) -> slice:
    """Local slice of the level points in ``r`` (a non-empty range) for a rank starting at lo."""
    return slice(r.start - lo, r[-1] - lo + 1, r.step)


class _PerLevel:
    """The one exchanger of every level (no spatial coarsening)."""

    def __init__(self, ex: Exchanger):
        self.ex = ex

    def __getitem__(self, level: int) -> Exchanger:
        return self.ex


class LevelState:
    """States ``u`` (and FAS right-hand side ``g`` on coarse levels) of one rank on one level.

    ``u`` has shape ``(hi - lo, *state_shape)``, zeros (``zero=False``: uninitialized, for a
    caller that writes every row before it is read); ``cache`` keeps the last computed incoming
    steps ``Phi(u_{t-1})`` (reused by C-relaxation after a residual evaluation) and is cleared
    by every operation that changes ``u``.
    """

    def __init__(self, level: Level, shape, dtype, device, with_rhs: bool, zero: bool = True):
        self.lv = level
        alloc = torch.zeros if zero else torch.empty  # empty: the caller fills what is read
        self.u = alloc((level.n_local, *shape), dtype=dtype, device=device)
        self.g = torch.zeros_like(self.u) if with_rhs else None
        self.v = torch.zeros_like(self.u) if with_rhs else None  # restricted fine values
        self.cache: tuple | None = None


class LevelOps:
    """The operations of one solve; stateless apart from the counters.

    Args:
        prop: the user's propagator.
        ex: message exchanger on the solver's communicator.
        stats: counters to update.
        batched: use ``prop.step_batch`` for several intervals at once.
        c_weight: weight of C-relaxation.
        spatial: ``None`` or the spatial coarsening (:mod:`mgrit.spatial`) of the levels;
            ``shapes``: then the per-sample state shape of every level (``None``: every level
            has ``ex``'s shape); each level then exchanges messages of its own shape.
    """

    def __init__(self, prop: Propagator, ex: Exchanger, stats: SolverStats, batched: bool,
                 c_weight: float, spatial=None, shapes=None):
        self.prop, self.ex, self.stats = prop, ex, stats
        self.spatial, self.shapes = (spatial, shapes) if shapes is not None else (None, None)
        self._ex = _PerLevel(ex)
        if self.shapes is not None:
            by_shape = {ex.shape: ex}
            self._ex = [by_shape.setdefault(torch.Size((ex.shape[0], *s)), Exchanger(
                ex.comm, (ex.shape[0], *s), ex.dtype, ex.device, stats)) for s in shapes]
        self.batched = batched and prop.batched
        self._into = getattr(prop, "step_batch_into", None) if self.batched else None
        self.c_weight = c_weight

    def state_shape(self, level: int) -> torch.Size:
        """The state shape (with the batch dim) of ``level``."""
        return self.ex.shape if self.shapes is None else self._ex[level].shape

    # -- steps ---------------------------------------------------------------------------
    def phi_one(self, st: LevelState, j: int) -> torch.Tensor:
        s = st.lv.stride
        self.stats.steps_single += 1
        return self.prop.step(st.u[j - st.lv.lo], j * s, (j + 1) * s, st.lv.index)

    def phi(self, st: LevelState, sources: range) -> torch.Tensor:
        """``Phi(u_j)`` for the owned level points ``j`` in ``sources``: shape ``(len, *shape)``."""
        lv = st.lv
        if len(sources) == 1:
            return self.phi_one(st, sources[0]).unsqueeze(0)  # a view: no copy
        if not self.batched:
            return torch.stack([self.phi_one(st, j) for j in sources])
        s = lv.stride
        self.stats.steps_batched_calls += 1
        self.stats.steps_batched_items += len(sources)
        a, b, c = sources.start, sources.stop, sources.step
        return self.prop.step_batch(st.u[_sl(sources, lv.lo)], range(a * s, b * s, c * s),
                                    range((a + 1) * s, (b + 1) * s, c * s), lv.index)

    def _set(self, st: LevelState, targets: range, values: torch.Tensor) -> None:
        sl = _sl(targets, st.lv.lo)
        if st.g is not None:
            values = values + st.g[sl]
        st.u[sl] = values

    def _advance(self, st: LevelState, sources: range) -> None:
        """``u_{j+1} = Phi(u_j) (+ g_{j+1})`` for the owned points ``j`` in ``sources`` whose
        successors are owned too: a batched call writes straight into the state array
        (the propagator's ``step_batch_into``, see the module docstring; same values as
        :meth:`phi` then :meth:`_set`)."""
        lv = st.lv
        targets = range(sources.start + 1, sources.stop + 1, sources.step)
        if len(sources) == 1 or self._into is None:
            self._set(st, targets, self.phi(st, sources))
            return
        s = lv.stride
        self.stats.steps_batched_calls += 1
        self.stats.steps_batched_items += len(sources)
        a, b, c = sources.start, sources.stop, sources.step
        out = st.u[_sl(targets, lv.lo)]
        self._into(st.u[_sl(sources, lv.lo)], range(a * s, b * s, c * s),
                   range((a + 1) * s, (b + 1) * s, c * s), lv.index, out)
        if st.g is not None:
            out += st.g[_sl(targets, lv.lo)]

    # -- relaxation ----------------------------------------------------------------------
    def f_relax(self, st: LevelState) -> None:
        """F-relaxation: ``u_j = Phi(u_{j-1}) + g_j`` for every owned F-point, interval by
        interval from its C-point (all intervals at once)."""
        lv = st.lv
        lo, hi, m = lv.lo, lv.hi, lv.cfactor
        if lo == hi:
            return
        st.cache = None
        tag = _tag(_TAG_F, lv.index)
        send = lv.next is not None and hi % m != 0
        recv = lo % m != 0
        req = self._ex[lv.index].irecv(lv.prev, tag) if recv else None
        first_c = -(-lo // m) * m
        stop = hi + 1 if send else hi  # targets beyond hi - 1 go to the next rank
        if first_c < hi and stop - first_c <= m:  # one interval here: a plain sweep
            self._f_sweep(st, first_c, stop, tag)
        elif first_c < hi:
            for k in range(1, m):
                if first_c + k >= stop:
                    break
                sources = range(first_c + k - 1, stop - 1, m)
                if sources[-1] + 1 < hi:  # every target is owned: in place
                    self._advance(st, sources)
                    continue
                targets = range(first_c + k, stop, m)
                out = self.phi(st, sources)
                self._ex[lv.index].isend(out[-1], lv.next, tag)  # the step reaching hi: next rank's
                targets, out = targets[:-1], out[:-1]
                if len(targets):
                    self._set(st, targets, out)
        if recv:
            end = min(first_c, hi)
            incoming = req.wait()
            for j in range(lo, end):
                st.u[j - lo] = incoming if st.g is None else incoming + st.g[j - lo]
                if j + 1 < end:
                    incoming = self.phi_one(st, j)
            if end == hi and send:
                self._ex[lv.index].isend(self.phi_one(st, hi - 1), lv.next, tag)

    def _f_sweep(self, st: LevelState, c: int, stop: int, tag: int) -> None:
        """F-relaxation of the single interval starting at this rank's C-point ``c``, step by
        step (no batching possible; avoids the per-step slicing of the batched loop, which
        dominates for small states); the step reaching ``hi`` goes to the next rank."""
        lv = st.lv
        lo, hi, s, g = lv.lo, lv.hi, lv.stride, st.g
        step, level = self.prop.step, lv.index
        u = st.u[c - lo]
        for j in range(c + 1, stop):
            out = step(u, (j - 1) * s, j * s, level)
            self.stats.steps_single += 1
            if j == hi:
                self._ex[lv.index].isend(out, lv.next, tag)
                break
            u = out if g is None else out + g[j - lo]
            st.u[j - lo] = u

    def incoming(self, st: LevelState, mod: int) -> tuple[range, torch.Tensor | None]:
        """``Phi(u_{t-1})`` for every owned point ``t > 0`` with ``t % mod == 0`` (C-points for
        ``mod = m``, all points for ``mod = 1``), exchanging the boundary step with the
        neighbours. Returns ``(targets, values)``; cached until ``u`` changes."""
        lv = st.lv
        lo, hi = lv.lo, lv.hi
        if lo == hi:
            return range(0), None
        if st.cache is not None and st.cache[0] == mod:
            return st.cache[1], st.cache[2]
        tag = _tag(_TAG_IN, lv.index)
        first_t = max(-(-lo // mod) * mod, mod)
        targets = range(first_t, hi, mod)
        send = lv.next is not None and hi % mod == 0
        recv = first_t == lo
        req = self._ex[lv.index].irecv(lv.prev, tag) if recv else None
        local = range(first_t + mod if recv else first_t, hi + 1 if send else hi, mod)
        parts = []
        if len(local):
            out = self.phi(st, range(local.start - 1, local.stop - 1, mod))
            if send:
                self._ex[lv.index].isend(out[-1], lv.next, tag)
                out = out[:-1]
            parts.append(out)
        if recv:
            parts.insert(0, req.wait().unsqueeze(0))
        values = torch.cat(parts) if len(targets) else None
        st.cache = (mod, targets, values)
        return targets, values

    def c_relax(self, st: LevelState) -> None:
        """(Weighted) C-relaxation: ``u_c <- w (Phi(u_{c-1}) + g_c) + (1 - w) u_c``."""
        targets, phi = self.incoming(st, st.lv.cfactor)
        if st.lv.n_local == 0:
            return
        st.cache = None
        if not len(targets):
            return
        sl = _sl(targets, st.lv.lo)
        new = phi if st.g is None else phi + st.g[sl]
        w = self.c_weight
        st.u[sl] = new if w == 1.0 else w * new + (1.0 - w) * st.u[sl]

    # -- space ---------------------------------------------------------------------------
    def down(self, x: torch.Tensor, coarse: LevelState) -> torch.Tensor:
        """Spatial restriction of states ``x`` ``(n, batch, ...)`` of the level above
        ``coarse`` to ``coarse``'s grid (``x`` itself where that level is not coarsened)."""
        k = coarse.lv.index
        if self.spatial is None or not self.spatial.coarsens(k):
            return x
        return self.spatial.restrict(x, k, self.shapes[k - 1])

    def up(self, x: torch.Tensor, coarse: LevelState) -> torch.Tensor:
        """Spatial prolongation of ``coarse``'s states ``x`` to the grid of the level above."""
        k = coarse.lv.index
        if self.spatial is None or not self.spatial.coarsens(k):
            return x
        return self.spatial.prolong(x, k, self.shapes[k - 1])

    def waitall(self) -> None:
        """Complete the pending sends of every level's exchanger."""
        if isinstance(self._ex, _PerLevel):
            self.ex.waitall()
            return
        for ex in {id(e): e for e in self._ex}.values():
            ex.waitall()

    # -- coarse grid ---------------------------------------------------------------------
    def restrict(self, st: LevelState, coarse: LevelState) -> None:
        """FAS restriction by injection: ``v_k = u_{km}``,
        ``g^c_k = (g_{km} - u_{km} + Phi(u_{km-1})) + v_k - Phi^c(v_{k-1})``, i.e. the
        restricted residual plus ``A_c(v)_k`` (same operation order as PyMGRIT, so that
        residual histories agree to round-off)."""
        targets, phi = self.incoming(st, st.lv.cfactor)
        if coarse.lv.n_local == 0:
            return
        c_pts = st.lv.c_points()
        coarse.v.copy_(self.down(st.u[_sl(c_pts, st.lv.lo)], coarse))
        coarse.u.copy_(coarse.v)
        coarse.cache = None
        ktargets, cphi = self.incoming(coarse, 1)
        if not len(ktargets):
            return
        sl, ksl = _sl(targets, st.lv.lo), _sl(ktargets, coarse.lv.lo)
        r = phi - st.u[sl] if st.g is None else st.g[sl] - st.u[sl] + phi
        coarse.g[ksl] = self.down(r, coarse) + coarse.v[ksl] - cphi

    def copy_down(self, st: LevelState, coarse: LevelState) -> None:
        """XBraid's skip (``_braid_CopyFineToCoarse``): ``v_k = u^c_k = u_{km}`` and
        ``g^c = 0``, without steps or messages. The coarse equations are then the plain
        coarse chain ``u^c_k = Phi^c(u^c_{k-1})`` (no FAS tau-correction: the fine states
        were never relaxed, so their residual carries no information), and the correction
        that follows sets the fine C-points to the coarse solution."""
        if coarse.lv.n_local == 0:
            return
        coarse.v.copy_(self.down(st.u[_sl(st.lv.c_points(), st.lv.lo)], coarse))
        coarse.u.copy_(coarse.v)
        coarse.g.zero_()
        coarse.cache = None

    def correct(self, st: LevelState, coarse: LevelState) -> None:
        """Coarse-grid correction at C-points: ``u_{km} <- u_{km} + (u^c_k - v_k)``."""
        if st.lv.n_local == 0:
            return
        st.cache = None
        if coarse.lv.n_local == 0:
            return
        sl = _sl(st.lv.c_points(), st.lv.lo)
        st.u[sl] = st.u[sl] + self.up(coarse.u - coarse.v, coarse)

    def inject(self, st: LevelState, coarse: LevelState) -> None:
        """Interpolation by injection (nested iteration): ``u_{km} <- u^c_k``."""
        if st.lv.n_local == 0:
            return
        st.cache = None
        if coarse.lv.n_local:
            st.u[_sl(st.lv.c_points(), st.lv.lo)] = self.up(coarse.u, coarse)

    def coarse_solve(self, st: LevelState) -> None:
        """Sequential sweep ``u_j = Phi(u_{j-1}) + g_j`` over the level, pipelined across
        ranks (each rank waits for its left neighbour's last step)."""
        lv = st.lv
        lo, hi, s = lv.lo, lv.hi, lv.stride
        if lo == hi:
            return
        st.cache = None
        tag = _tag(_TAG_COARSE, lv.index)
        incoming = self._ex[lv.index].recv(lv.prev, tag) if lo > 0 else None
        # Python lists of row views: per-step tensor indexing dominates for small states
        us = list(st.u.unbind(0))
        gs = st.g.unbind(0) if st.g is not None else None
        step, level = self.prop.step, lv.index
        for j in range(lo, hi):
            if j > 0:
                us[j - lo] = incoming if gs is None else incoming + gs[j - lo]
            if j + 1 < hi or lv.next is not None:
                incoming = step(us[j - lo], j * s, (j + 1) * s, level)
        self.stats.steps_single += (hi - lo) - (0 if lv.next is not None else 1)
        st.u.copy_(torch.stack(us))
        if lv.next is not None:
            self._ex[lv.index].isend(incoming, lv.next, tag)
