"""Training-loop callbacks: the contract (:func:`check_callbacks`), the tqdm progress bar
(:class:`ProgressBar`) and the console lines (:class:`ConsoleLog`).

A callback is any object with some of the methods :data:`~mgrit.training.records.CALLBACK_HOOKS`
(``on_fit_start``, ``on_after_backward``, ``on_step_end``, ``on_epoch_end``, ``on_fit_end``),
each called as ``hook(trainer, record)`` on every rank, in list order. Hooks that change the
computation must decide the same thing on every rank; output hooks check ``trainer.is_root``.
A callback with state provides ``state_dict()`` / ``load_state_dict(state)`` (plain contents:
tensors, dicts, lists, numbers, strings), saved per rank in checkpoints under a stable key
(:func:`state_keys`: its ``state_key`` attribute, else its class name; ``#2``, ``#3``, ... for
later callbacks of the same key), so a resume with other callbacks around it (e.g. without the
progress bar) restores each state into the callback it belongs to; a saved state no callback
takes and a stateful callback without saved state are named in the resume notes
(:func:`restore_states`).
"""
from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Callable, Iterable, TextIO

import numpy as np
from tqdm import tqdm

from .guard import ConvergenceGuard
from .records import CALLBACK_HOOKS, EpochRecord, FitPlan, FitResult, StepRecord

if TYPE_CHECKING:  # annotations only: no import cycle with the trainer
    from .trainer import Trainer

__all__ = ["check_callbacks", "state_keys", "restore_states", "ProgressBar", "ConsoleLog"]


def check_callbacks(callbacks: Iterable | None) -> list:
    """The callbacks as a list, checked.

    Raises:
        TypeError: not an iterable of objects, or an ``on_*`` attribute that is not callable.
        ValueError: an ``on_*`` method the loop never calls (a misspelt hook would be silently
            ignored otherwise), or ``state_dict`` without ``load_state_dict`` (or vice versa).
    """
    if callbacks is None:
        return []
    if isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__"):
        raise TypeError(f"callbacks must be a list of objects, got {type(callbacks).__name__}")
    out = list(callbacks)
    for cb in out:
        name = type(cb).__name__
        hooks = [h for h in dir(cb) if h.startswith("on_")]
        unknown = [h for h in hooks if h not in CALLBACK_HOOKS]
        if unknown:
            raise ValueError(f"callback {name} has {unknown}, which the training loop never "
                             f"calls: use {list(CALLBACK_HOOKS)}")
        for h in hooks:
            if not callable(getattr(cb, h)):
                raise TypeError(f"callback {name}.{h} is not callable")
        if hasattr(cb, "state_dict") != hasattr(cb, "load_state_dict"):
            raise ValueError(f"callback {name} has only one of state_dict/load_state_dict: "
                             f"give both (checkpoints save and restore the state) or neither")
        key = getattr(cb, "state_key", None)
        if key is not None and (not isinstance(key, str) or not key or "#" in key):
            raise ValueError(f"callback {name}.state_key={key!r} is not allowed: use a "
                             f"non-empty string without '#' (or no state_key: the class name)")
    return out


def state_keys(callbacks: list) -> list:
    """The checkpoint key of each callback's state (None for a callback without
    ``state_dict``): its ``state_key`` attribute, else its class name, with ``#k`` appended
    for the k-th (k >= 2) stateful callback of the same key."""
    keys, seen = [], {}
    for cb in callbacks:
        if not hasattr(cb, "state_dict"):
            keys.append(None)
            continue
        name = getattr(cb, "state_key", None) or type(cb).__name__
        seen[name] = seen.get(name, 0) + 1
        keys.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return keys


def _legacy(saved: dict) -> dict:
    """Saved states keyed ``'{position}:{class name}'`` (checkpoints before the stable keys),
    re-keyed as :func:`state_keys` would key them."""
    if not saved or not all(re.fullmatch(r"\d+:.+", k) for k in saved):
        return saved
    out, seen = {}, {}
    for k in sorted(saved, key=lambda k: int(k.split(":", 1)[0])):
        name = k.split(":", 1)[1]
        seen[name] = seen.get(name, 0) + 1
        out[name if seen[name] == 1 else f"{name}#{seen[name]}"] = saved[k]
    return out


def restore_states(callbacks: list, saved: dict) -> list:
    """Load the checkpoint's callback states ``saved`` (key -> state) into ``callbacks`` by
    :func:`state_keys`; returns the notes for the resume report: saved states that no callback
    of this run takes (not restored) and stateful callbacks the checkpoint has no state for
    (they start empty, e.g. a metrics writer then lacks the steps before the resume)."""
    saved = _legacy(dict(saved or {}))
    used, fresh = set(), []
    for cb, key in zip(callbacks, state_keys(callbacks)):
        if key is None:
            continue
        if key in saved:
            cb.load_state_dict(saved[key])
            used.add(key)
        else:
            fresh.append(key)
    notes = []
    dropped = sorted(set(saved) - used)
    if dropped:
        notes.append(f"saved state of callback(s) {', '.join(dropped)} not restored: this run "
                     f"has no callback with that key")
    if fresh:
        notes.append(f"callback(s) {', '.join(fresh)} start without saved state: the "
                     f"checkpoint has none for them")
    return notes


class ProgressBar:
    """tqdm bar per epoch on the root rank (loss and last forward residual as postfix).

    Args:
        file: stream (default ``sys.stdout``). leave: keep finished bars (default False).
    """

    def __init__(self, file: TextIO | None = None, leave: bool = False):
        self.file, self.leave = file, leave
        self._bar, self._epoch, self._plan = None, None, None

    def on_fit_start(self, trainer: Trainer, plan: FitPlan) -> None:
        self._plan = plan

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        if not trainer.is_root or record.epoch is None:
            return
        if self._bar is None or self._epoch != record.epoch:
            self._close()
            self._epoch = record.epoch
            self._bar = tqdm(total=self._plan.batches_per_epoch, initial=record.batch,
                             desc=f"epoch {record.epoch + 1}/{self._plan.epochs}",
                             file=self.file or sys.stdout, dynamic_ncols=True, leave=self.leave)
        post = {}
        if record.loss is not None:
            post["loss"] = f"{record.loss:.3f}"
        if record.forward is not None and record.forward.residuals:
            post["fres"] = f"{record.forward.residuals[-1]:.1e}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def on_epoch_end(self, trainer: Trainer, record: EpochRecord) -> None:
        self._close()

    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _res(last, mean) -> str:
    return "-" if last is None else f"{last:.2e} (mean {mean:.2e})"


class ConsoleLog:
    """Console lines on the root rank: solver set-up, resume notes and initial test metrics
    at the start, one line per epoch (with MGRIT iterations and residuals), solver counters
    and guard actions at the end.

    Args:
        prefix: start of the non-epoch lines (default ``"[train]"``).
        print_fn: output function (default ``print(..., flush=True)``).
    """

    def __init__(self, prefix: str = "[train]", print_fn: Callable | None = None):
        self.prefix = prefix
        self.print_fn = print_fn or (lambda s: print(s, flush=True))
        self._epochs = None

    def _say(self, trainer, text: str) -> None:
        if trainer.is_root:
            self.print_fn(text)

    def on_fit_start(self, trainer: Trainer, plan: FitPlan) -> None:
        self._epochs = plan.epochs
        for line in plan.solvers:
            self._say(trainer, f"{self.prefix} {line}")
        if plan.resumed_from:  # then what the resume changed, one note a line
            self._say(trainer, f"{self.prefix} resumed {plan.resumed_from} at epoch "
                               f"{plan.start_epoch + 1}, batch {plan.start_batch}")
            for note in plan.notes:
                self._say(trainer, f"{self.prefix}   resume: {note}")
        line = f"{self.prefix} {plan.parameters} parameters"
        if plan.initial_test_acc is not None:
            line += (f"; initial test_acc {plan.initial_test_acc:.4f} test_loss "
                     f"{plan.initial_test_loss:.4f}")
        self._say(trainer, line)

    def on_epoch_end(self, trainer: Trainer, r: EpochRecord) -> None:
        test = "-" if r.test_acc is None else f"{r.test_acc:.4f}"
        line = (f"epoch {r.epoch}/{self._epochs} loss {r.loss:.4f} train_acc "
                f"{np.nan if r.train_acc is None else r.train_acc:.4f} test_acc {test} time "
                f"{r.epoch_time:.1f}s (eval {r.eval_time:.1f}s)")
        describe = getattr(getattr(trainer, "method", None), "describe_epoch", None)
        what = None if describe is None else describe(r.epoch - 1)
        if what:  # e.g. the layer a layer-by-layer schedule trains in this epoch
            line += f" | {what}"
        if r.fwd_iters is not None:
            line += (f" | MGRIT fwd {r.fwd_iters} it res "
                     f"{_res(r.fwd_residual, r.fwd_residual_mean)}; bwd {r.bwd_iters} it res "
                     f"{_res(r.bwd_residual, r.bwd_residual_mean)}")
        self._say(trainer, line)  # (the loop's warnings go through the warnings module)

    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        if result.solver_stats:
            self._say(trainer, f"{self.prefix} forward solver counters (rank 0, all solves): "
                               f"{result.solver_stats}")
        for cb in trainer.callbacks:
            if isinstance(cb, ConvergenceGuard) and cb.events:
                where = f"; see {cb.log_path}" if cb.log_path else ""
                self._say(trainer, f"{self.prefix} convergence guard acted {len(cb.events)} "
                                   f"time(s){where}")
