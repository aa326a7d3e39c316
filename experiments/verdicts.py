"""Verdicts declared before the run (issue 34, item 4).

A record script builds one :class:`Declaration` at import time -- the comparisons it may judge,
each with its kind and threshold -- and calls :meth:`Declaration.freeze` before its first
measurement (it writes ``declared.json``: what was declared, when, and the number of
candidates any choice looks at). After the run, :meth:`Declaration.judge` turns an interval
into the sentence a table or the README may carry. Nothing else may say "better" or "faster":

* a comparison that was not declared raises KeyError (no verdict invented after the fact);
* a judgement before :meth:`freeze` raises RuntimeError;
* a timing whose load gate (:func:`experiments.measure.load_gate`) says unreliable gets
  "unreliable: no verdict" whatever its numbers;
* a setting chosen among ``k > 1`` candidates must have been chosen on validation data
  (``chosen_on="validation"``), and the verdict names ``k``.

Kinds (the interval is of ``a - b`` for gaps, of ``a / b`` for ratios):

* ``"within"`` -- equivalence: the whole interval inside ``[-threshold, +threshold]``; it never
  says better or worse.
* ``"better"`` -- the interval's lower end above ``threshold`` (a gap, e.g. points).
* ``"faster"`` -- ratios of times ``b / a`` (speed-up of ``a`` over ``b``): the lower end above
  ``threshold`` (e.g. 1.0, or 1.2 for a target); "slower" when the upper end is below 1.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["Comparison", "Declaration", "KINDS"]

KINDS = ("within", "better", "faster")


@dataclass(frozen=True)
class Comparison:
    """One declared comparison: ``a`` against ``b`` on ``metric``, judged by ``kind`` at
    ``threshold`` (``unit`` for the sentence). ``candidates``: how many settings a choice for
    ``a`` looked at (1: none); ``chosen_on``: ``"validation"`` or ``"none"``."""
    name: str
    a: str
    b: str
    metric: str
    kind: str
    threshold: float
    unit: str = ""
    candidates: int = 1
    chosen_on: str = "none"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} is not allowed: use one of {list(KINDS)}")
        if not (isinstance(self.candidates, int) and self.candidates >= 1):
            raise ValueError(f"candidates={self.candidates!r}: use an int >= 1")
        if self.candidates > 1 and self.chosen_on != "validation":
            raise ValueError(f"{self.name}: a choice among {self.candidates} candidates must be "
                             f"made on validation data (chosen_on='validation'), got "
                             f"{self.chosen_on!r}")
        if self.kind == "within" and not self.threshold > 0:
            raise ValueError(f"{self.name}: 'within' needs a threshold > 0")
        if self.kind == "faster" and not self.threshold > 0:
            raise ValueError(f"{self.name}: 'faster' needs a ratio threshold > 0")


class Declaration:
    """The comparisons of one record script, fixed before its run."""

    def __init__(self, script: str, *comparisons: Comparison):
        names = [c.name for c in comparisons]
        if len(set(names)) != len(names):
            raise ValueError(f"{script}: comparison names repeat: {names}")
        self.script = script
        self.comparisons = {c.name: c for c in comparisons}
        self.frozen_at = None

    def freeze(self, out_dir: str | Path | None = None) -> dict:
        """Fixes the declaration (before the first measurement); writes
        ``out_dir/declared.json`` when ``out_dir`` is given. Returns what was written."""
        self.frozen_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        d = self.as_dict()
        if out_dir is not None:
            p = Path(out_dir)
            p.mkdir(parents=True, exist_ok=True)
            (p / "declared.json").write_text(json.dumps(d, indent=1))
        return d

    def as_dict(self) -> dict:
        return {"script": self.script, "frozen_at": self.frozen_at,
                "comparisons": [asdict(c) for c in self.comparisons.values()]}

    def lines(self) -> list:
        """Markdown bullets of the declared comparisons (for a table's header)."""
        out = []
        for c in self.comparisons.values():
            pick = (f"; {c.a} chosen among {c.candidates} candidates on {c.chosen_on} data"
                    if c.candidates > 1 else "")
            out.append(f"- {c.name}: {c.a} vs {c.b}, {c.metric}, {c.kind} at "
                       f"{c.threshold:g}{(' ' + c.unit) if c.unit else ''}{pick}")
        return out

    def judge(self, name: str, interval: Mapping, reliable: bool = True) -> str:
        """The verdict sentence of the declared comparison ``name`` from ``interval``
        (``{"mean", "lo", "hi", "n"}``: a gap's interval, or a speed-up's for ``"faster"``).
        ``reliable``: the load gate's result (False: no verdict).

        Raises:
            KeyError: ``name`` was not declared.
            RuntimeError: :meth:`freeze` was not called before."""
        if name not in self.comparisons:
            raise KeyError(f"{self.script}: no verdict on {name!r}: it was not declared "
                           f"before the run (declared: {list(self.comparisons)})")
        if self.frozen_at is None:
            raise RuntimeError(f"{self.script}: freeze() the declaration before the run")
        c = self.comparisons[name]
        u = f" {c.unit}" if c.unit else ""
        pick = (f" ({c.a} chosen among {c.candidates} candidates on validation)"
                if c.candidates > 1 else "")
        if not reliable:
            return f"{c.name}: unreliable timing (load gate): no verdict{pick}"
        m, lo, hi, n = (float(interval[k]) for k in ("mean", "lo", "hi", "n"))
        if n < 2 or math.isnan(lo) or math.isnan(hi):
            return f"{c.name}: {m:.3g}{u} from n = {int(n)}: no interval, no verdict{pick}"
        num = f"{m:+.2f} [{lo:+.2f}, {hi:+.2f}]{u}" if c.kind != "faster" else \
            f"{m:.2f}x [{lo:.2f}, {hi:.2f}]"
        head = f"{c.name}: {c.a} vs {c.b} {num} (n = {int(n)}){pick}"
        t = c.threshold
        if c.kind == "within":
            if -t <= lo and hi <= t:
                return f"{head}: within +-{t:g}{u} (the whole interval)"
            if lo > t or hi < -t:
                return f"{head}: outside +-{t:g}{u} (the whole interval)"
            return f"{head}: not resolved against +-{t:g}{u}"
        if c.kind == "better":
            if lo > t:
                return f"{head}: better by more than {t:g}{u}"
            return f"{head}: not shown better (declared: lower end > {t:g}{u})"
        if lo > t:
            return f"{head}: {c.a} faster (declared: speed-up lower end > {t:g})"
        if hi < 1.0:
            return f"{head}: {c.a} slower"
        return f"{head}: not shown faster (declared: speed-up lower end > {t:g})"
