"""Multilevel layer grid: C-/F-points per level and ownership of indices by ranks.

Indices are integers throughout (no floating-point time points: ``t0 + i*h`` is not bitwise
uniform). The fine grid has points ``0..N`` (``N`` intervals = ``N`` layers of a ResNet).
Level ``l+1`` keeps every ``m_l``-th point of level ``l`` (the **C-points**; the others are
**F-points**), so level ``l`` has ``N_l = N_{l-1} // m_{l-1}`` intervals, each spanning
``S_l = m_0 * ... * m_{l-1}`` fine intervals. Points after the last C-point of a level are
F-points of a trailing, shorter F-interval (as in XBraid and PyMGRIT).

Ownership (:class:`Partition`): the fine points are split into ``P`` contiguous blocks, one per
rank, for any ``N >= P`` (sizes differ by at most one; remainders go to the first blocks).
A rank owns the points of its block; the **step leaving a point is computed by the owner of that
point** (for a ResNet: the rank holding layer ``i`` owns state ``x_i``), and its result travels
to the owner of the next point. A level point belongs to the owner of its fine index, so a rank
may own no point on a coarse level; it then idles there. The block order may be reversed
(:meth:`Partition.reversed`), which the adjoint solve uses: it runs over the reversed chain, and
the rank holding layer ``i`` then owns adjoint ``lambda_{i+1}``.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Partition", "Level", "Hierarchy", "coarsening_factors", "warn_single_level"]


class Partition:
    """Contiguous ownership of the fine points ``0..N`` by ``P`` ranks (one block each).

    Args:
        n_intervals: ``N >= 1``, number of fine intervals (steps/layers).
        sizes: number of *steps* (points ``0..N-1``) in each block, in chain order; the last
            block also owns the final point ``N``. Each size must be ``>= 1`` and they must sum
            to ``N``.
        ranks: rank owning each block (a permutation of ``0..P-1``); default ``0..P-1``.

    Raises:
        ValueError: sizes that do not sum to ``N``, an empty block, or ranks that are not a
            permutation of ``0..P-1``.
    """

    def __init__(self, n_intervals: int, sizes: Sequence[int], ranks: Sequence[int] | None = None):
        sizes = [int(s) for s in sizes]
        if sum(sizes) != n_intervals or any(s < 1 for s in sizes):
            raise ValueError(f"partition sizes {sizes} must be >= 1 and sum to N={n_intervals}")
        ranks = list(range(len(sizes))) if ranks is None else [int(r) for r in ranks]
        if sorted(ranks) != list(range(len(sizes))):
            raise ValueError(f"partition ranks {ranks} must be a permutation of 0..{len(sizes) - 1}")
        self.n_intervals = n_intervals
        self.sizes = sizes
        self.ranks = ranks
        self.starts = [0]
        for s in sizes:
            self.starts.append(self.starts[-1] + s)
        self._block_of_rank = {r: b for b, r in enumerate(ranks)}

    @classmethod
    def even(cls, n_intervals: int, nprocs: int) -> "Partition":
        """Split ``N`` steps over ``P`` ranks as evenly as possible (first blocks one larger).

        Raises:
            ValueError: ``N < P`` or ``P < 1`` (every rank must own at least one step).
        """
        if nprocs < 1:
            raise ValueError(f"number of ranks P={nprocs} must be >= 1")
        if n_intervals < nprocs:
            raise ValueError(f"N={n_intervals} intervals cannot be split over P={nprocs} ranks: "
                             f"need N >= P (every rank owns at least one layer)")
        q, r = divmod(n_intervals, nprocs)
        return cls(n_intervals, [q + 1] * r + [q] * (nprocs - r))

    @property
    def nprocs(self) -> int:
        return len(self.sizes)

    def reversed(self) -> "Partition":
        """Partition of the reversed chain ``i -> N - i`` such that the rank owning step ``k``
        of this chain owns step ``N - 1 - k`` of the reversed one (used by the adjoint solve)."""
        return Partition(self.n_intervals, self.sizes[::-1], self.ranks[::-1])

    def block(self, rank: int) -> tuple[int, int]:
        """Fine points ``[a, b)`` owned by ``rank`` (the last block also owns ``N``: ``b = N+1``)."""
        b = self._block_of_rank[rank]
        stop = self.starts[b + 1] + (1 if b == self.nprocs - 1 else 0)
        return self.starts[b], stop

    def owner(self, point: int) -> int:
        """Rank owning fine point ``point`` (``0 <= point <= N``)."""
        if not 0 <= point <= self.n_intervals:
            raise ValueError(f"fine point {point} outside 0..{self.n_intervals}")
        lo, hi = 0, self.nprocs - 1
        while lo < hi:  # last block whose start <= point
            mid = (lo + hi + 1) // 2
            if self.starts[mid] <= point:
                lo = mid
            else:
                hi = mid - 1
        return self.ranks[lo]

    def __repr__(self) -> str:
        return f"Partition(N={self.n_intervals}, sizes={self.sizes}, ranks={self.ranks})"


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy as seen by one rank.

    Attributes:
        index: level number ``l`` (0 = finest).
        stride: ``S_l``, fine intervals per interval of this level.
        n_intervals: ``N_l``; level points are ``0..N_l``.
        cfactor: coarsening factor ``m_l`` to level ``l+1`` (``None`` on the coarsest level).
        lo, hi: this rank owns level points ``[lo, hi)`` (``lo == hi``: none).
        prev: rank owning point ``lo - 1`` (sends this rank the step into ``lo``), or ``None``.
        next: rank owning point ``hi`` (receives the step out of ``hi - 1``), or ``None``.
    """

    index: int
    stride: int
    n_intervals: int
    cfactor: int | None
    lo: int
    hi: int
    prev: int | None
    next: int | None

    @property
    def is_coarsest(self) -> bool:
        return self.cfactor is None

    @property
    def n_local(self) -> int:
        return self.hi - self.lo

    def c_points(self) -> range:
        """Owned C-points (level indices), ascending."""
        m = self.cfactor
        first = -(-self.lo // m) * m
        return range(first, self.hi, m)


def coarsening_factors(cfactor: int | Sequence[int], max_levels: int) -> list[int]:
    """Expand an int or a per-level list of coarsening factors to ``max_levels - 1`` entries
    (the last entry of a short list is repeated).

    Raises:
        ValueError: a factor below 2, a non-integer factor, or an empty list.
    """
    facs = [cfactor] if isinstance(cfactor, int) else list(cfactor)
    if not facs:
        raise ValueError("cfactor list is empty: give an int >= 2 or a list of ints >= 2")
    for f in facs:
        if isinstance(f, bool) or not isinstance(f, int) or f < 2:
            raise ValueError(f"coarsening factor {f!r} is not allowed: use integers >= 2")
    n = max(max_levels - 1, 0)
    return (facs + [facs[-1]] * n)[:n]


class Hierarchy:
    """The levels of an MGRIT hierarchy for one rank of a :class:`Partition`.

    Coarsening from level ``l`` stops when ``max_levels`` is reached or when the next level
    would have fewer than ``min_coarse`` intervals (XBraid's ``min_coarse``; Guenther et al. use
    10 for Peaks). Level counts: ``len(hierarchy.levels)``.

    Args:
        partition: fine-point ownership.
        rank: this rank (in the solver's communicator).
        cfactor: coarsening factor, int or per-level list (see :func:`coarsening_factors`).
        max_levels: maximum number of levels, ``>= 1`` (1 = sequential stepping).
        min_coarse: minimum number of intervals on a coarse level, ``>= 1``.
    """

    def __init__(self, partition: Partition, rank: int, cfactor: int | Sequence[int] = 2,
                 max_levels: int = 2, min_coarse: int = 2):
        if isinstance(max_levels, bool) or not isinstance(max_levels, int) or max_levels < 1:
            raise ValueError(f"max_levels={max_levels!r} is not allowed: use an int >= 1")
        if isinstance(min_coarse, bool) or not isinstance(min_coarse, int) or min_coarse < 1:
            raise ValueError(f"min_coarse={min_coarse!r} is not allowed: use an int >= 1")
        facs = coarsening_factors(cfactor, max_levels)
        self.partition = partition
        self.rank = rank
        n, stride, sizes = partition.n_intervals, 1, [(partition.n_intervals, 1)]
        for m in facs:
            if n // m < min_coarse:
                break
            n, stride = n // m, stride * m
            sizes.append((n, stride))
        self.cfactors = facs[:len(sizes) - 1]
        a, b = partition.block(rank)
        self.levels: list[Level] = []
        for l, (n_l, s) in enumerate(sizes):
            lo, hi = -(-a // s), min(-(-b // s), n_l + 1)
            owns = lo < hi
            prev = partition.owner((lo - 1) * s) if owns and lo > 0 else None
            nxt = partition.owner(hi * s) if owns and hi <= n_l else None
            self.levels.append(Level(l, s, n_l, self.cfactors[l] if l < len(self.cfactors) else None,
                                     lo, hi, prev, nxt))

    @property
    def n_levels(self) -> int:
        return len(self.levels)

    def __repr__(self) -> str:
        desc = ", ".join(f"L{lv.index}: N={lv.n_intervals} own [{lv.lo},{lv.hi})"
                         for lv in self.levels)
        return f"Hierarchy(rank={self.rank}, {desc})"


_single_level_warned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def warn_single_level(propagator, n: int, cfactor: int, min_coarse: int) -> None:
    """The UserWarning of an MGRIT whose hierarchy has a single level, once per ``propagator``
    and setting (a segment builds a forward and an adjoint solver over one propagator)."""
    try:
        seen = _single_level_warned.setdefault(propagator, set())
    except TypeError:  # not weak-referenceable: warn every time
        seen = set()
    if (n, cfactor, min_coarse) in seen:
        return
    seen.add((n, cfactor, min_coarse))
    warnings.warn(f"MGRIT with N={n}, cfactor={cfactor}, min_coarse={min_coarse} has a single "
                  f"level: it reduces to sequential stepping (pipelined across ranks); use a "
                  f"smaller cfactor or min_coarse", stacklevel=3)
