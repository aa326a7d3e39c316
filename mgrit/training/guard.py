"""Convergence guard for layer-parallel training: non-finite values and residual growth.

* Non-finite values: the solver already raises ``FloatingPointError`` on a NaN/Inf residual
  (``MGRITOptions.check_finite``); :meth:`ConvergenceGuard.check` also raises one naming the
  solver, step and iteration if a non-finite residual slips through (``check_finite=False``),
  and :func:`check_finite_states` names the first global layer whose state (or adjoint) is not
  finite (one tiny allgather, so every rank raises the same message).
* Residual growth: convergence factors ``r_{k+1}/r_k`` are collected per solver (``"forward"``,
  ``"backward"``) across cycles and steps; when the last ``window`` factors all exceed
  ``threshold``, the configured action is taken: ``"warn"`` (a warning), ``"add_iterations"``
  (raise that solver's ``max_iter`` by ``extra_per_trigger``, at most ``max_extra`` in total;
  afterwards it only warns) or ``"serial"`` (exact sequential propagation, ``max_levels=1``,
  forward and backward, for the rest of the run). Residual histories are identical on every
  rank, so every rank takes the same decision without communicating. Each decision is
  appended as one JSON line to ``log_path`` (written by rank 0 of ``COMM_WORLD`` only).

Usage::

    guard = ConvergenceGuard(window=3, threshold=1.0, action="serial",
                             log_path=os.path.join(run_dir, "guard.jsonl"))
    ...
    loss.backward()
    guard.check_resnet(resnet, step)   # checks last_forward and last_backward, applies action
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from collections import deque

import torch
from mpi4py import MPI

__all__ = ["ConvergenceGuard", "apply_action", "check_finite_states", "ACTIONS", "DivergenceWarning"]

ACTIONS = ("warn", "add_iterations", "serial")


class DivergenceWarning(RuntimeWarning):
    """Residuals of an MGRIT solve grew over the guard's window."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _replace_solver(resnet, which: str, options) -> None:
    """Rebuild ``resnet._fsolver`` or ``resnet._bsolver`` with ``options`` (no communication:
    only the local hierarchy is recomputed). Keeps accumulated stats and phase tags."""
    from ..solver import MGRIT

    old = resnet._fsolver if which == "forward" else resnet._bsolver
    new = MGRIT(old.propagator, resnet.n_layers, dtype=old.dtype, device=old.device,
                options=options, comm=old.comm, partition=old.partition)
    new.stats = old.stats
    if which == "forward":
        resnet._fsolver, resnet.fwd_opts = new, options
    else:
        resnet._bsolver, resnet.bwd_opts = new, options
    phases = getattr(old, "_layerpar_phases", None)
    if phases is not None:
        from .faults import instrument_solver
        instrument_solver(new, *phases)


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
        _replace_solver(resnet, solver, new)
        return {"solver": solver, "max_iter": [opts.max_iter, new.max_iter]}
    changed = {}
    for which in ("forward", "backward"):
        opts = resnet.fwd_opts if which == "forward" else resnet.bwd_opts
        if opts.max_levels != 1:
            _replace_solver(resnet, which, dataclasses.replace(opts, max_levels=1))
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

    def _log(self, event: dict) -> None:
        self.events.append(event)
        if self.log_path and MPI.COMM_WORLD.Get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            with open(self.log_path, "a") as fh:
                fh.write(json.dumps(event) + "\n")

    def check(self, result, solver_name: str, step: int) -> str | None:
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
        warnings.warn(f"{solver_name} MGRIT residuals grew over {self.window} cycles at step "
                      f"{step} (factors {['%.3g' % f for f in factors]}): action {action}",
                      DivergenceWarning, stacklevel=2)
        return action

    def apply(self, resnet, action: str | None, solver_name: str, step: int) -> None:
        """Apply a decision of :meth:`check` to ``resnet`` and log what changed."""
        if action is None or action == "warn":
            return
        change = apply_action(resnet, action, solver_name, self.extra_per_trigger)
        if action == "add_iterations":
            self.extra_used[solver_name] = self.extra_used.get(solver_name, 0) + self.extra_per_trigger
        if action == "serial":
            self.serial = True
            self._factors.clear()
        self._log({"time": time.time(), "step": step, "solver": solver_name,
                   "applied": action, "change": change})

    def check_resnet(self, resnet, step: int) -> list:
        """Check ``resnet.last_forward`` and ``resnet.last_backward`` (after ``backward()``),
        apply the decided actions, and return them (``[]`` when nothing happened)."""
        done = []
        for name, result in (("forward", resnet.last_forward), ("backward", resnet.last_backward)):
            if result is None:
                continue
            if self.check_states:
                check_finite_states(result, name, step, resnet.comm, resnet.n_layers)
            action = self.check(result, name, step)
            if action is not None:
                self.apply(resnet, action, name, step)
                done.append((name, action))
        return done

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"factors": {k: list(v) for k, v in self._factors.items()},
                "extra_used": dict(self.extra_used), "serial": self.serial}

    def load_state_dict(self, state: dict) -> None:
        self._factors = {k: deque(v, maxlen=self.window) for k, v in state["factors"].items()}
        self.extra_used = dict(state["extra_used"])
        self.serial = bool(state["serial"])
