"""A recorded run: every rank's traced MGRIT solves (:mod:`mgrit.perf.trace.recorder` defines
the events), its tallies, the matching of its messages, and JSON (one file per run).

The tallies are the trace's own: :meth:`Trace.counts` counts the events under the names of
:class:`~mgrit.stats.SolverStats`, so a test can hold them against the solver's counters (also
stored per solve, :meth:`Trace.solver_counts`). Loading checks the structure and types of
every entry and raises ``ValueError`` on anything else (JSON only: reading runs no code).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["Trace", "COUNT_KEYS"]

#: The counters a trace tallies, named as in :class:`mgrit.stats.SolverStats`.
COUNT_KEYS = ("steps_single", "steps_batched_calls", "steps_batched_items", "messages",
              "bytes_sent", "allreduces")

_FIELDS = {"step": (int, int, int, int), "send": (int, int, int, int),
           "recv": (int, int, int, int), "coll": (str,)}
_VERSION = 1


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_event(e, where: str) -> None:
    if not isinstance(e, list) or not e or e[0] not in _FIELDS:
        raise ValueError(f"{where}: {e!r} is not an event (kinds: {sorted(_FIELDS)})")
    types = _FIELDS[e[0]]
    if len(e) != 3 + len(types) or not (_num(e[1]) and _num(e[2]) and e[1] <= e[2]):
        raise ValueError(f"{where}: {e!r} needs [kind, t0, t1 >= t0, {len(types)} fields]")
    for v, t in zip(e[3:], types):
        if not isinstance(v, t) or isinstance(v, bool) or (t is int and v < 0):
            raise ValueError(f"{where}: field {v!r} of {e!r} must be a {t.__name__}"
                             f"{' >= 0' if t is int else ''}")


class Trace:
    """Every rank's traced solves of one run.

    Args:
        ranks: one record per rank of the communicator, in rank order, as
            :meth:`mgrit.perf.trace.Tracer.as_dict` returns it (``rank``, ``size``,
            ``solves``; each solve with ``label``, ``t0``, ``t1``, ``events``, ``stats``).
        meta: what the run was (free-form, JSON-serializable).

    Raises:
        ValueError: a record out of rank order, a size other than ``len(ranks)``, a solve
            without its fields, an event of an unknown kind or with a wrong field.
    """

    def __init__(self, ranks: list, meta: dict | None = None):
        if not isinstance(ranks, list) or not ranks:
            raise ValueError(f"a trace needs a non-empty list of rank records, got {ranks!r:.80}")
        for r, d in enumerate(ranks):
            if not isinstance(d, dict) or d.get("rank") != r or d.get("size") != len(ranks):
                raise ValueError(f"rank record {r} must be a dict with rank={r} and "
                                 f"size={len(ranks)}, got {str(d)[:120]}")
            if not isinstance(d.get("solves"), list):
                raise ValueError(f"rank record {r} has no list of solves")
            for i, s in enumerate(d["solves"]):
                where = f"rank {r}, solve {i}"
                if not isinstance(s, dict) or not isinstance(s.get("events"), list) or not (
                        _num(s.get("t0")) and _num(s.get("t1")) and s["t0"] <= s["t1"]):
                    raise ValueError(f"{where}: needs events, t0 <= t1 (seconds)")
                stats = s.get("stats")
                if stats is not None and not (isinstance(stats, dict) and all(
                        isinstance(stats.get(k), int) for k in COUNT_KEYS)):
                    raise ValueError(f"{where}: stats must hold the ints {COUNT_KEYS}")
                for e in s["events"]:
                    _check_event(e, where)
        self.ranks, self.meta = ranks, dict(meta or {})

    @property
    def nprocs(self) -> int:
        return len(self.ranks)

    def solves(self, rank: int, label: str | None = None) -> list[dict]:
        """The solves of ``rank`` in the order they ran (only those named ``label``)."""
        return [s for s in self.ranks[rank]["solves"] if label is None or s["label"] == label]

    def subset(self, start: int, stop: int | None = None) -> "Trace":
        """The trace of solves ``start:stop`` (Python slice of each rank's solves in the
        order they ran; e.g. ``subset(2)`` drops a training step's forward and adjoint solve,
        the warm-up). Every rank must have run the same number of solves (a solve is
        collective), so a message of a kept solve keeps both its ends.

        Raises:
            ValueError: the ranks ran different numbers of solves.
        """
        n = {len(d["solves"]) for d in self.ranks}
        if len(n) > 1:
            raise ValueError(f"the ranks ran {sorted(n)} solves: a subset needs the same number "
                             f"on every rank")
        return Trace([dict(d, solves=d["solves"][start:stop]) for d in self.ranks], self.meta)

    def events(self, rank: int, label: str | None = None) -> list[list]:
        """The events of ``rank``'s solves, in order, concatenated."""
        return [e for s in self.solves(rank, label) for e in s["events"]]

    def counts(self, rank: int, label: str | None = None) -> dict:
        """The trace's tally of ``rank``'s events, keys :data:`COUNT_KEYS`."""
        c = dict.fromkeys(COUNT_KEYS, 0)
        for e in self.events(rank, label):
            if e[0] == "step":
                if e[6]:
                    c["steps_batched_calls"] += 1
                    c["steps_batched_items"] += e[5]
                else:
                    c["steps_single"] += e[5]
            elif e[0] == "send":
                c["messages"] += 1
                c["bytes_sent"] += e[5]
            elif e[0] == "coll":
                c["allreduces"] += 1
        return c

    def solver_counts(self, rank: int, label: str | None = None) -> dict:
        """The solver's own counters (``SolverStats``) of ``rank``'s complete solves, summed."""
        c = dict.fromkeys(COUNT_KEYS, 0)
        for s in self.solves(rank, label):
            for k in COUNT_KEYS:
                c[k] += (s.get("stats") or {}).get(k, 0)
        return c

    def wall(self, rank: int, label: str | None = None) -> float:
        """Recorded wall clock of ``rank``'s solves (seconds, the sum of ``t1 - t0``)."""
        return sum(s["t1"] - s["t0"] for s in self.solves(rank, label))

    def messages(self) -> dict:
        """Every message, matched: ``{(sender, receiver, tag, seq): nbytes}``.

        Raises:
            ValueError: a send without its receive or a receive without its send, a name
                used twice, or a receive of another size than its send.
        """
        sent, got = {}, {}
        for r in range(self.nprocs):
            for e in self.events(r):
                if e[0] in ("send", "recv"):
                    key = (r, e[3], e[4], e[6]) if e[0] == "send" else (e[3], r, e[4], e[6])
                    book = sent if e[0] == "send" else got
                    if key in book:
                        raise ValueError(f"message {key} is {e[0]} twice")
                    book[key] = e[5]
        for key in sent.keys() ^ got.keys():
            side = "never received" if key in sent else "received but never sent"
            raise ValueError(f"message (sender, receiver, tag, seq) = {key} was {side}")
        for key, n in sent.items():
            if got[key] != n:
                raise ValueError(f"message {key}: {n} bytes sent, {got[key]} received")
        return sent

    # -- files ---------------------------------------------------------------------------
    def to_json(self, path) -> Path:
        """Write the trace as one JSON file; returns the path."""
        path = Path(path)
        path.write_text(json.dumps({"format": "layerpar-trace", "version": _VERSION,
                                    "meta": self.meta, "ranks": self.ranks}))
        return path

    @classmethod
    def from_json(cls, path) -> "Trace":
        """Read a file written by :meth:`to_json` (ValueError on any other content)."""
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a trace (not JSON: {exc})") from None
        if not isinstance(d, dict) or d.get("format") != "layerpar-trace" or \
                d.get("version") != _VERSION:
            raise ValueError(f"{path} is not a layerpar trace of version {_VERSION}")
        return cls(d.get("ranks"), d.get("meta") if isinstance(d.get("meta"), dict) else {})
