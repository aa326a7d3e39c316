"""Convergence guard for layer-parallel training: non-finite values and residual growth.

* Non-finite values: the solver raises ``FloatingPointError`` on a NaN/Inf residual
  (``MGRITOptions.check_finite``); :func:`name_nonfinite` turns it into one naming the first
  global layer whose state (or adjoint) is not finite (the training loop does this for every
  step), :meth:`ConvergenceGuard.check` raises one naming the solver, step and iteration if a
  non-finite residual slips through (``check_finite=False``), and :func:`check_finite_states`
  names the first bad layer of a result (one tiny allgather, so every rank raises the same
  message).
* Residual growth: convergence factors ``r_{k+1}/r_k`` are collected per solver (``"forward"``,
  ``"backward"``) across cycles and steps; when the last ``window`` factors all exceed
  ``threshold``, the configured action is taken: ``"warn"`` (a warning), ``"add_iterations"``
  (raise that solver's ``max_iter`` by ``extra_per_trigger``, at most ``max_extra`` in total;
  afterwards it only warns) or ``"serial"`` (exact sequential propagation, ``max_levels=1``,
  forward and backward, for the rest of the run). Residual histories are identical on every
  rank of a layer communicator; as a training-loop callback the decisions of the data-parallel
  replicas are also agreed (the most severe wins), so every rank takes the same decision.
  Each decision is appended as one JSON line to ``log_path`` by rank 0 of the job (the
  trainer's grid) or of the resnet's communicator.

Usage, as a callback of :class:`mgrit.training.Trainer` (``on_after_backward``)::

    guard = ConvergenceGuard(window=3, threshold=1.0, action="serial",
                             log_path=os.path.join(run_dir, "guard.jsonl"))
    trainer = Trainer(net, optimizer, grid, callbacks=[guard])

or in a hand-written loop, after ``loss.backward()``: ``guard.check_resnet(resnet, step)``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
import warnings
from collections import deque
from typing import TYPE_CHECKING

import torch
from mpi4py import MPI

from .support.nets import as_net
from .support.solvers import replace_solver, solver_states

if TYPE_CHECKING:  # annotations only: no import cycle with the trainer
    from ..nn import LayerParallelResNet
    from ..solver import MGRITResult
    from .records import StepRecord
    from .trainer import Trainer

__all__ = ["ConvergenceGuard", "apply_action", "check_finite_states", "name_nonfinite", "ACTIONS",
           "DivergenceWarning"]

ACTIONS = ("warn", "add_iterations", "serial")
_SEVERITY = {None: 0, "warn": 1, "add_iterations": 2, "serial": 3}


class DivergenceWarning(RuntimeWarning):
    """Residuals of an MGRIT solve grew over the guard's window."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def apply_action(resnet, action: str, solver: str = "forward", extra: int = 1) -> dict:
    """Apply a guard action to a :class:`~mgrit.nn.LayerParallelResNet` (same call on every
    rank of its communicator; no communication).

    Args:
        action: ``"warn"`` (nothing to change), ``"add_iterations"`` (``max_iter += extra``
            for ``solver``), or ``"serial"`` (``max_levels=1`` forward and backward: exact
            sequential propagation; MGRIT's parallelism is given up).
        solver: ``"forward"`` or ``"backward"`` (for ``"add_iterations"``).

    Returns:
        a dict describing the change (for the log).
    """
    if action not in ACTIONS:
        raise ValueError(f"action={action!r} is not allowed: use one of {list(ACTIONS)}")
    if solver not in ("forward", "backward"):
        raise ValueError(f"solver={solver!r} is not allowed: use 'forward' or 'backward'")
    if action == "warn":
        return {}
    if action == "add_iterations":
        opts = resnet.fwd_opts if solver == "forward" else resnet.bwd_opts
        new = dataclasses.replace(opts, max_iter=opts.max_iter + int(extra))
        replace_solver(resnet, solver, new)
        return {"solver": solver, "max_iter": [opts.max_iter, new.max_iter]}
    changed = {}
    for which in ("forward", "backward"):
        opts = resnet.fwd_opts if which == "forward" else resnet.bwd_opts
        if opts.max_levels != 1:
            replace_solver(resnet, which, dataclasses.replace(opts, max_levels=1))
            changed[which] = {"max_levels": [opts.max_levels, 1]}
    return changed


def check_finite_states(result, solver_name: str, step: int, comm: MPI.Comm | None = None,
                        n_layers: int | None = None) -> None:
    """Raise ``FloatingPointError`` on every rank of ``comm`` if any rank's states in
    ``result`` (an :class:`~mgrit.solver.MGRITResult`) contain NaN/Inf, naming the first bad
    point as a global layer state (``x_k``; for ``solver_name="backward"`` the reversed chain is
    mapped back to adjoints ``lambda_k``, which needs ``n_layers``). One small allgather when
    ``comm`` has more than one rank; cost one ``isfinite`` pass over the local states."""
    st = result.states
    bad = None
    flat = st.reshape(st.shape[0], -1)
    ok = torch.isfinite(flat).all(dim=1)
    if not bool(ok.all()):
        bad = result.lo + int((~ok).nonzero()[0, 0])
    if comm is not None and comm.Get_size() > 1:
        found = [b for b in comm.allgather(bad) if b is not None]
    else:
        found = [] if bad is None else [bad]
    if not found:
        return
    if solver_name == "backward" and n_layers is not None:
        k = max(n_layers - b for b in found)  # reversed point i is lambda_{N-i}
        what = f"adjoint lambda_{k} (input of layer {k})"
    else:
        k = min(found)
        what = f"state x_{k} (input of layer {k})"
    raise FloatingPointError(f"{solver_name} MGRIT solve at step {step}, iteration "
                             f"{result.iterations}: {what} contains NaN or Inf")


def name_nonfinite(net, which: str, step: int, exc: FloatingPointError):
    """After an MGRIT solve (``which``: ``"forward"``/``"backward"``) of ``net`` raised
    ``exc`` (a NaN/Inf residual: every layer rank raises at the same cycle), a
    ``FloatingPointError`` naming the first global layer whose state (or adjoint) is not
    finite, with ``exc``'s text appended; ``None`` if every state is finite or ``net`` is
    serial. Collective over the layer communicator (one small allgather per segment)."""
    segs = as_net(net).solver_segments()
    m = re.search(r"after cycle (\d+)", str(exc))
    for k, seg in enumerate(segs):
        cur = solver_states(seg, which)
        if cur is None:
            continue
        partial = _Partial(cur[0], cur[1], int(m.group(1)) if m else "?")
        name = which if len(segs) == 1 else f"{which} (segment {k + 1}/{len(segs)})"
        try:
            check_finite_states(partial, name, step, seg.comm, seg.n_layers)
        except FloatingPointError as named:
            return FloatingPointError(f"{named} ({exc})")
    return None


class _Partial:
    """The fields of an MGRITResult that :func:`check_finite_states` reads."""

    def __init__(self, states, lo, iterations):
        self.states, self.lo, self.iterations = states, lo, iterations


class ConvergenceGuard:
    """Watch MGRIT residual histories and act on divergence (see module doc).

    Args:
        window: number of consecutive convergence factors (int >= 1, default 3).
        threshold: factor above which a cycle counts as diverging (finite number > 0,
            default 1.0).
        action: ``"warn"`` (default), ``"add_iterations"`` or ``"serial"``.
        max_extra: total extra iterations allowed per solver for ``"add_iterations"``
            (int >= 0, default 10).
        extra_per_trigger: iterations added per trigger (int >= 1, default 1).
        log_path: JSON-lines file for the decisions (e.g. ``run_dir/guard.jsonl``) or None.
        check_states: also run :func:`check_finite_states` in :meth:`check_resnet`
            (default True; one small allgather per solve).

    Raises:
        ValueError: any argument outside the ranges above (same message on every rank).
    """

    def __init__(self, window: int = 3, threshold: float = 1.0, action: str = "warn",
                 max_extra: int = 10, extra_per_trigger: int = 1, log_path: str | None = None,
                 check_states: bool = True):
        if not _is_int(window) or window < 1:
            raise ValueError(f"window={window!r} is not allowed: use an int >= 1")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"threshold={threshold!r} is not allowed: use a finite number > 0")
        if action not in ACTIONS:
            raise ValueError(f"action={action!r} is not allowed: use one of {list(ACTIONS)}")
        if not _is_int(max_extra) or max_extra < 0:
            raise ValueError(f"max_extra={max_extra!r} is not allowed: use an int >= 0")
        if not _is_int(extra_per_trigger) or extra_per_trigger < 1:
            raise ValueError(f"extra_per_trigger={extra_per_trigger!r} is not allowed: use an int >= 1")
        if log_path is not None and not isinstance(log_path, (str, os.PathLike)):
            raise ValueError(f"log_path={log_path!r} is not allowed: use a path or None")
        self.window, self.threshold, self.action = window, float(threshold), action
        self.max_extra, self.extra_per_trigger = max_extra, extra_per_trigger
        self.log_path = None if log_path is None else os.fspath(log_path)
        self.check_states = bool(check_states)
        self._factors: dict[str, deque] = {}
        self.extra_used: dict[str, int] = {}
        self.serial = False
        self.events: list[dict] = []
        self._writer = True  # this rank warns and writes log_path (set by check_resnet)

    def _log(self, event: dict) -> None:
        self.events.append(event)
        if self.log_path and self._writer:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            with open(self.log_path, "a") as fh:
                fh.write(json.dumps(event) + "\n")

    def check(self, result: MGRITResult, solver_name: str, step: int) -> str | None:
        """Record ``result.residuals`` of solver ``solver_name`` at training step ``step``.

        Returns:
            ``None`` (no decision) or the action decided (``"warn"``, ``"add_iterations"``,
            ``"serial"``); the caller applies it (:meth:`check_resnet` does so itself).

        Raises:
            FloatingPointError: a NaN/Inf residual, naming solver, step and iteration.
        """
        res = list(result.residuals)
        for i, r in enumerate(res):
            if not math.isfinite(r):
                raise FloatingPointError(f"{solver_name} MGRIT residual is {r} at step {step}, "
                                         f"iteration {i + 1} (history {res})")
        q = self._factors.setdefault(solver_name, deque(maxlen=self.window))
        for a, b in zip(res, res[1:]):
            if a > 0:
                q.append(b / a)
        if len(q) < self.window or not all(f > self.threshold for f in q):
            return None
        factors = list(q)
        q.clear()
        action = self.action
        if action == "add_iterations" and \
                self.extra_used.get(solver_name, 0) + self.extra_per_trigger > self.max_extra:
            action = "warn"
        if action == "serial" and self.serial:
            return None
        self._log({"time": time.time(), "step": step, "solver": solver_name,
                   "factors": factors, "residuals": res, "window": self.window,
                   "threshold": self.threshold, "action": action,
                   "configured_action": self.action})
        if self._writer:  # one warning per job, not one per rank
            warnings.warn(f"{solver_name} MGRIT residuals grew over {self.window} cycles at "
                          f"step {step} (factors {['%.3g' % f for f in factors]}): action "
                          f"{action}", DivergenceWarning, stacklevel=2)
        return action

    def apply(self, resnet: LayerParallelResNet, action: str | None, solver_name: str, step: int,
              key: str | None = None) -> None:
        """Apply a decision of :meth:`check` to ``resnet``'s ``solver_name`` (``"forward"``
        or ``"backward"``) and log what changed; ``key``: the name the decision was recorded
        under in :meth:`check` (default ``solver_name``)."""
        if action is None or action == "warn":
            return
        key = key or solver_name
        change = apply_action(resnet, action, solver_name, self.extra_per_trigger)
        if action == "add_iterations":
            self.extra_used[key] = self.extra_used.get(key, 0) + self.extra_per_trigger
        if action == "serial":
            self.serial = True
            self._factors.clear()
        self._log({"time": time.time(), "step": step, "solver": key,
                   "applied": action, "change": change})

    def check_resnet(self, resnet: LayerParallelResNet, step: int,
                     data_comm: MPI.Comm | None = None,
                     writer: bool | None = None, results: tuple | None = None,
                     prefix: str = "") -> list:
        """Check ``resnet.last_forward`` and ``resnet.last_backward`` (after ``backward()``),
        apply the decided actions, and return them (``[(solver, action)]``, ``[]`` when
        nothing happened).

        Args:
            data_comm: the data-parallel communicator, if the replicas must agree (the most
                severe decision of any replica is applied on all; one small allgather).
            writer: whether this rank writes ``log_path`` (default: rank 0 of ``resnet.comm``).
            results: ``(forward, backward)`` results to check instead of the resnet's latest
                (``(None, None)`` for a replica that skipped the step: it only joins the
                agreement).
            prefix: prepended to the solver names of the factor histories and the log
                (distinguishes the segments of one network).
        """
        self._writer = resnet.comm.Get_rank() == 0 if writer is None else bool(writer)
        if results is None:
            results = (resnet.last_forward, resnet.last_backward)
        decided = {}
        for name, result in zip(("forward", "backward"), results):
            decided[name] = None
            if result is None:
                continue
            if self.check_states:
                check_finite_states(result, prefix + name, step, resnet.comm, resnet.n_layers)
            decided[name] = self.check(result, prefix + name, step)
        if data_comm is not None and data_comm.Get_size() > 1:
            everyone = data_comm.allgather(decided)
            decided = {k: max((d[k] for d in everyone), key=_SEVERITY.__getitem__) for k in decided}
        done = []
        for name, action in decided.items():
            if action is not None:
                self.apply(resnet, action, name, step, key=prefix + name)
                done.append((name, action))
        return done

    # -- training-loop callback ----------------------------------------------------------
    def on_after_backward(self, trainer: Trainer, record: StepRecord) -> None:
        """Check the step's MGRIT results, per segment (layer-parallel networks only; the
        replicas agree; a replica with an empty shard only joins the agreement)."""
        segs = trainer.net.solver_segments()
        for k, seg in enumerate(segs):
            results = record.solves[k] if record.solves else (None, None)
            prefix = "" if len(segs) == 1 else f"segment{k}."
            self.check_resnet(seg, record.step, data_comm=trainer.grid.data_comm,
                              writer=trainer.is_root, results=results, prefix=prefix)

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"factors": {k: list(v) for k, v in self._factors.items()},
                "extra_used": dict(self.extra_used), "serial": self.serial}

    def load_state_dict(self, state: dict) -> None:
        self._factors = {k: deque(v, maxlen=self.window) for k, v in state["factors"].items()}
        self.extra_used = dict(state["extra_used"])
        self.serial = bool(state["serial"])
