"""Gradient-bias monitor for inexact (fixed-iteration) layer-parallel training: the rationale,
the criterion in full and its cost are in ``docs/features/guard.rst``.

Every ``every`` optimizer steps, on the step's own batch (collective over the grid): bias
``b = ||g - G||`` of the step's gradient ``g`` against the reference gradient ``G`` of ``M``
micro-batches per replica through a tight solve (``reference="serial"``: one level, or
``"converged"``: the same hierarchy to ``reference_tol``), and the noise ``s`` of ``G`` from
the micro-batches' spread. After ``window`` checks in a row with ``b > ratio * s`` (default
ratio 0.5): ``action="raise"`` adds ``raise_by`` cycles to every segment up to
``max_fwd_iters`` / ``max_bwd_iters``, then switches to serial (``at_cap="serial"``) or only
logs (``at_cap="log"``); ``action="serial"`` switches every segment to the one-level solve for
the rest of the run; ``action="log"`` only logs. Every rank takes the same decision. One JSON
line per check in ``log_path`` (grid rank 0). A monitor that never acts leaves the run bit for
bit unchanged (RNG states, buffers, ``.grad``, warm starts and solver options are restored;
the solvers' counters include the reference solves).

Usage (a :class:`~mgrit.training.Trainer` callback; its ``batch`` attribute gives the batch)::

    monitor = BiasMonitor(action="raise", every=50, ratio=0.5, log_path="run/bias.jsonl")
    trainer = Trainer(net, optimizer, grid, callbacks=[guard, monitor])

or after a hand-written ``loss.backward()``: :func:`measure_bias` (numbers only).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import TYPE_CHECKING, Callable

from torch import nn

from .estimate import REFERENCES, BiasEstimate, _is_int, _is_pos_number, measure_bias
from ..support.nets import as_net
from ..support.solvers import replace_solver

if TYPE_CHECKING:  # annotations only: no import cycle with the trainer
    from ..records import FitPlan, FitResult, StepRecord
    from ..trainer import Trainer

__all__ = ["BiasMonitor", "BiasEstimate", "measure_bias", "ACTIONS", "REFERENCES"]

ACTIONS = ("log", "raise", "serial")
_AT_CAP = ("serial", "log")


def _json_number(v):
    return v if v is None or not isinstance(v, float) or math.isfinite(v) else None


def _iters(net) -> list:
    """``[(forward max_iter, adjoint max_iter, forward levels)]`` per segment."""
    return [(s.fwd_opts.max_iter, s.bwd_opts.max_iter, s.fwd_opts.max_levels)
            for s in as_net(net).solver_segments()]


def _one_level(net) -> bool:
    return all(s.fwd_opts.max_levels == 1 and s.bwd_opts.max_levels == 1
               for s in as_net(net).solver_segments())


class BiasMonitor:
    """Training-loop callback: measure the gradient bias of inexact MGRIT solves against the
    SGD noise and act when the bias dominates (criterion, source and cost: module doc).

    Args:
        action: ``"raise"`` (default: more forward/adjoint cycles, then serial at the caps),
            ``"serial"`` (one-level exact solves for the rest of the run) or ``"log"``
            (measure and log only).
        every: check every ``every`` optimizer steps (int >= 1, default 50; the cost of a
            check is about one serial step, so 20-100 keeps the overhead at a few percent).
        ratio: bias dominates when ``bias > ratio * noise`` (finite number > 0, default 0.5).
            Below 1 on purpose: the bias is the same every step and adds up, while the noise
            of successive batches averages out (momentum 0.9 averages about 19 batches,
            whose mean has ~0.23 of one batch's noise). On the recorded Peaks run
            (experiments/results/studies/bias_monitor) 1.0 fired too rarely to keep up with serial;
            0.5 recovered the serial loss. Smaller reacts earlier (and costs more cycles).
        window: consecutive dominated checks before acting (int >= 1, default 2; one check
            is one batch, so 1 reacts to single noisy estimates).
        micro_batches: micro-batches per replica for the noise estimate (int >= 2, default 4;
            more gives a steadier noise estimate at the same cost per sample).
        reference, reference_tol, reference_max_iter: the tight solve (see
            :func:`measure_bias`; default ``"serial"``, exact).
        raise_by: cycles added per trigger to forward and adjoint (int >= 1, default 1).
        max_fwd_iters, max_bwd_iters: caps of the raised cycle counts (ints >= 1, default 8).
        at_cap: ``"serial"`` (default) or ``"log"``: what a trigger does when both caps are
            reached.
        log_path: JSON-lines file of every check (e.g. ``run_dir/bias.jsonl``) or None.
        print_fn: console output of the grid's rank 0 (default ``print(..., flush=True)``).

    Attributes:
        events: the logged checks (dicts, every rank). checks: checks done. streak: current
        run of dominated checks. serial: whether the monitor switched to serial.

    Raises:
        ValueError: any argument outside the ranges above (same message on every rank);
            a network without layer-parallel segments at the first check.
    """

    def __init__(self, action: str = "raise", every: int = 50, ratio: float = 0.5,
                 window: int = 2, micro_batches: int = 4, reference: str = "serial",
                 reference_tol: float = 1e-9, reference_max_iter: int = 50, raise_by: int = 1,
                 max_fwd_iters: int = 8, max_bwd_iters: int = 8, at_cap: str = "serial",
                 log_path: str | os.PathLike | None = None, print_fn: Callable | None = None):
        if action not in ACTIONS:
            raise ValueError(f"action={action!r} is not allowed: use one of {list(ACTIONS)}")
        for name, v, lo in (("every", every, 1), ("window", window, 1),
                            ("micro_batches", micro_batches, 2), ("raise_by", raise_by, 1),
                            ("max_fwd_iters", max_fwd_iters, 1),
                            ("max_bwd_iters", max_bwd_iters, 1),
                            ("reference_max_iter", reference_max_iter, 1)):
            if not _is_int(v) or v < lo:
                raise ValueError(f"{name}={v!r} is not allowed: use an int >= {lo}")
        for name, v in (("ratio", ratio), ("reference_tol", reference_tol)):
            if not _is_pos_number(v):
                raise ValueError(f"{name}={v!r} is not allowed: use a finite number > 0")
        if reference not in REFERENCES:
            raise ValueError(f"reference={reference!r} is not allowed: use one of "
                             f"{list(REFERENCES)}")
        if at_cap not in _AT_CAP:
            raise ValueError(f"at_cap={at_cap!r} is not allowed: use one of {list(_AT_CAP)}")
        if log_path is not None and not isinstance(log_path, (str, os.PathLike)):
            raise ValueError(f"log_path={log_path!r} is not allowed: use a path or None")
        self.action, self.every = action, int(every)
        self.ratio, self.window = float(ratio), int(window)
        self.micro_batches, self.reference = int(micro_batches), reference
        self.reference_tol, self.reference_max_iter = float(reference_tol), int(reference_max_iter)
        self.raise_by, self.at_cap = int(raise_by), at_cap
        self.max_fwd_iters, self.max_bwd_iters = int(max_fwd_iters), int(max_bwd_iters)
        self.log_path = None if log_path is None else os.fspath(log_path)
        self.print_fn = print_fn or (lambda s: print(s, flush=True))
        self.events: list[dict] = []
        self.checks = self.streak = 0
        self.serial = False
        self._options: list | None = None  # per segment (fwd max_iter, bwd max_iter) set by us
        self._pending: dict | None = None   # from load_state_dict, applied at on_fit_start

    # -- the decision (pure: numbers in, action out) ------------------------------------------
    def decide(self, bias: float, noise: float, at_cap: bool = False) -> str | None:
        """Record one check and return the action to take: ``None`` (bias does not dominate,
        or not for ``window`` checks in a row yet, or no noise estimate), ``"log"`` (it
        dominates, ``action="log"`` or ``at_cap="log"`` with the caps reached), ``"raise"``
        or ``"serial"``. ``at_cap``: whether every cycle count is at its cap already. A check
        without a noise estimate (``noise`` NaN) leaves the streak as it is."""
        self.checks += 1
        if not math.isfinite(noise) or not math.isfinite(bias):
            return None
        if bias > self.ratio * noise:
            self.streak += 1
        else:
            self.streak = 0
        if self.streak < self.window:
            return None
        self.streak = 0
        if self.action == "raise" and at_cap:
            return "serial" if self.at_cap == "serial" else "log"
        return self.action

    def apply(self, net: nn.Module, action: str) -> dict:
        """Apply ``"raise"`` or ``"serial"`` to every segment of ``net`` (the same call on every
        rank; no communication). Returns ``{segment index: {option: [old, new]}}``."""
        if action not in ("raise", "serial"):
            raise ValueError(f"action={action!r} is not allowed here: use 'raise' or 'serial'")
        change = {}
        for k, s in enumerate(as_net(net).solver_segments()):
            c = {}
            if action == "serial":
                for which, o in (("forward", s.fwd_opts), ("backward", s.bwd_opts)):
                    if o.max_levels != 1:
                        replace_solver(s, which, dataclasses.replace(o, max_levels=1))
                        c[f"{which}.max_levels"] = [o.max_levels, 1]
            else:
                for which, o, cap in (("forward", s.fwd_opts, self.max_fwd_iters),
                                      ("backward", s.bwd_opts, self.max_bwd_iters)):
                    new = min(o.max_iter + self.raise_by, cap)
                    if new > o.max_iter:
                        replace_solver(s, which, dataclasses.replace(o, max_iter=new))
                        c[f"{which}.max_iter"] = [o.max_iter, new]
            change[k] = c
        if action == "serial":
            self.serial = True
        self._options = [(f, b) for f, b, _ in _iters(net)]
        return change

    def _at_cap(self, net) -> bool:
        return all(f >= self.max_fwd_iters and b >= self.max_bwd_iters for f, b, _ in _iters(net))

    # -- training-loop callback ----------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, plan: FitPlan) -> None:
        """Refuse a serial network (every rank, before training); re-apply the solver options
        of a resumed run (:meth:`load_state_dict`)."""
        self._check_net(trainer.net)
        self.restore(trainer.net)

    @staticmethod
    def _check_net(net) -> None:
        if not as_net(net).solver_segments():
            raise ValueError("BiasMonitor needs a layer-parallel network (a LayerParallelNet "
                             "with LayerParallelResNet segments): a serial network has no "
                             "solver bias; remove the monitor")

    def restore(self, net: nn.Module) -> None:
        """Put the cycle counts and the serial switch of a loaded state onto ``net`` (called by
        :meth:`on_fit_start`; call it yourself after ``Trainer.load`` in a hand-written loop).

        Raises:
            ValueError: the state has another number of segments than ``net``.
        """
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        segs = as_net(net).solver_segments()
        if pending["options"] is not None and len(pending["options"]) != len(segs):
            raise ValueError(f"the bias monitor's state has {len(pending['options'])} "
                             f"segment(s), the network {len(segs)}")
        for s, (f, b) in zip(segs, pending["options"] or []):
            for which, o, it in (("forward", s.fwd_opts, f), ("backward", s.bwd_opts, b)):
                if o.max_iter != it:
                    replace_solver(s, which, dataclasses.replace(o, max_iter=it))
        if pending["serial"]:
            self.apply(net, "serial")
        if pending["options"] is not None:
            self._options = [tuple(x) for x in pending["options"]]

    def on_after_backward(self, trainer: Trainer, record: StepRecord) -> None:
        """Every ``every`` steps: measure on the step's batch, decide, act, log (collective)."""
        if self.serial or (record.step + 1) % self.every:
            return
        net = trainer.net
        self._check_net(net)
        if _one_level(net):  # exact solves already (e.g. the convergence guard switched)
            return
        x, y = trainer.batch
        est = measure_bias(net, x, y, trainer.grid, loss_fn=trainer.loss_fn,
                           micro_batches=self.micro_batches, reference=self.reference,
                           reference_tol=self.reference_tol,
                           reference_max_iter=self.reference_max_iter)
        before = _iters(net)
        dominated = bool(math.isfinite(est.noise) and math.isfinite(est.bias)
                         and est.bias > self.ratio * est.noise)
        streak = (self.streak + 1 if dominated else 0) if math.isfinite(est.noise) else self.streak
        action = self.decide(est.bias, est.noise, self._at_cap(net))
        change = self.apply(net, action) if action in ("raise", "serial") else {}
        event = {"time": time.time(), "step": record.step, "epoch": record.epoch,
                 **{k: _json_number(v) for k, v in dataclasses.asdict(est).items()},
                 "relative_bias": _json_number(est.bias / est.grad_norm) if est.grad_norm > 0
                 else None, "threshold": self.ratio, "window": self.window,
                 "streak": streak, "dominated": dominated,
                 "reference": self.reference, "action": action or "none", "change": change,
                 "options": [{"fwd_iters": f, "bwd_iters": b, "levels": lv}
                             for f, b, lv in _iters(net)],
                 "options_before": [{"fwd_iters": f, "bwd_iters": b, "levels": lv}
                                    for f, b, lv in before]}
        self._log(event, trainer.is_root)
        if action is not None and trainer.is_root:
            what = {"log": "logged only", "raise": "raised cycles",
                    "serial": "switched to serial (one-level exact solves)"}[action]
            opts = ", ".join(f"fwd {f} / bwd {b} cycles, {lv} level(s)" for f, b, lv in _iters(net))
            self.print_fn(f"[bias] step {record.step}: gradient bias {est.bias:.3g} > "
                          f"{self.ratio:g} x noise {est.noise:.3g} in {self.window} check(s) in "
                          f"a row: {what}; now {opts}")

    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        acted = [e for e in self.events if e["action"] in ("raise", "serial")]
        if trainer.is_root and self.checks:
            where = f"; log {self.log_path}" if self.log_path else ""
            self.print_fn(f"[bias] {self.checks} check(s), acted {len(acted)} time(s)"
                          + (f" (steps {[e['step'] for e in acted]})" if acted else "") + where)

    def _log(self, event: dict, writer: bool) -> None:
        self.events.append(event)
        if self.log_path and writer:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            with open(self.log_path, "a") as fh:
                fh.write(json.dumps(event) + "\n")

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Checks done, streak, the serial switch and the cycle counts this monitor set."""
        return {"checks": self.checks, "streak": self.streak, "serial": self.serial,
                "options": None if self._options is None else [list(x) for x in self._options]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the solver options follow at :meth:`on_fit_start` (or
        :meth:`restore`)."""
        self.checks, self.streak = int(state["checks"]), int(state["streak"])
        self.serial = False  # set again by restore() when the switch is re-applied
        self._pending = {"serial": bool(state["serial"]), "options": state["options"]}
