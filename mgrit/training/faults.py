"""Fail fast across ranks: phase tags on exceptions, an abort-on-exception installer, and an
environment-driven fault injector for tests.

An exception on one rank of an MPI job must end the whole job within seconds, with a message
naming the rank and the phase, instead of leaving the other ranks blocked in a receive or a
collective. Three pieces:

* :class:`phase` -- context manager *and* decorator. An exception leaving ``with phase(name)``
  gets a note ``rank R failed in phase NAME`` (``BaseException.add_note``, printed by every
  traceback) and the attributes ``exc.layerpar_rank`` / ``exc.layerpar_phase`` (the innermost
  phase wins; outer phases leave a tagged exception alone). The exception keeps its type and
  message, so ``except ValueError`` still works.
* :func:`fail_fast` -- installs ``sys.excepthook`` (and ``threading.excepthook``): prints ``rank R failed in phase P: Type: message``,
  the traceback, then ``MPI_Abort``. Works with and without ``python -m mpi4py``.
* :func:`maybe_inject` -- called on entry of every :class:`phase`; raises
  :class:`InjectedFault` when ``$LAYERPAR_INJECT_FAULT`` selects this rank and phase.

``LAYERPAR_INJECT_FAULT`` syntax: comma-separated ``RANK:PHASE[:N]`` items; ``RANK`` is the
``COMM_WORLD`` rank or ``*``; ``PHASE`` a phase name or ``*``; the fault fires on the ``N``-th
entry (1-based, default 1) of that phase on that rank. Example::

    LAYERPAR_INJECT_FAULT="2:coarse solve:3" mpiexec -n 4 python train.py ...

Phase names used by the library (:data:`PHASES`): ``"forward relaxation"``, ``"coarse solve"``
(forward MGRIT; see :func:`instrument_resnet`), ``"adjoint"`` (the backward solve),
``"data loading"`` and ``"gradient averaging"`` (tagged by the training script), plus
``"checkpoint"`` (:mod:`mgrit.training.checkpoint`).

Usage in a training script::

    from mgrit.training.faults import fail_fast, phase, instrument_resnet
    fail_fast(MPI.COMM_WORLD)              # first thing after MPI is up
    instrument_resnet(resnet)              # tags forward relaxation / coarse solve / adjoint
    for ...:
        with phase("data loading"):
            xb, yb = next(batches)
        loss = net.loss(net(xb), yb); loss.backward()
        with phase("gradient averaging"):
            average_gradients(params, grid.data_comm)
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback

from mpi4py import MPI

__all__ = ["PHASES", "phase", "current_phase", "fail_fast", "maybe_inject", "InjectedFault",
           "instrument_resnet", "instrument_solver", "ENV"]

ENV = "LAYERPAR_INJECT_FAULT"
PHASES = ("forward relaxation", "coarse solve", "adjoint", "data loading", "gradient averaging",
          "checkpoint")

_stack = threading.local()
_entries: dict = {}


class InjectedFault(RuntimeError):
    """The exception raised by :func:`maybe_inject` (tests only)."""


def _world_rank() -> int:
    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else 0


def current_phase() -> str | None:
    """Innermost active phase on this thread, or ``None``."""
    st = getattr(_stack, "names", None)
    return st[-1] if st else None


def _parse(spec: str):
    items = []
    for raw in spec.split(","):
        raw = raw.strip()
        if not raw:
            continue
        parts = raw.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"{ENV}={spec!r}: item {raw!r} is not RANK:PHASE[:N]")
        rank, name = parts[0].strip(), parts[1].strip()
        n = int(parts[2]) if len(parts) == 3 else 1
        if rank != "*" and not rank.isdigit():
            raise ValueError(f"{ENV}={spec!r}: rank {rank!r} is not an int or '*'")
        if n < 1:
            raise ValueError(f"{ENV}={spec!r}: occurrence {n} must be >= 1")
        items.append((rank, name, n))
    return items


def maybe_inject(name: str) -> None:
    """Raise :class:`InjectedFault` if ``$LAYERPAR_INJECT_FAULT`` selects this rank and phase
    ``name`` at this entry (see module doc). No-op (one ``os.environ`` lookup) otherwise."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    count = _entries[name] = _entries.get(name, 0) + 1
    rank = _world_rank()
    for r, p, n in _parse(spec):
        if (r == "*" or int(r) == rank) and (p == "*" or p == name) and count == n:
            raise InjectedFault(f"injected fault on rank {rank} in phase {name!r} (entry {count}) "
                                f"at t={time.time():.3f}")


def _tag(exc: BaseException, name: str) -> None:
    if getattr(exc, "layerpar_phase", None) is not None:
        return
    rank = _world_rank()
    try:
        exc.layerpar_rank, exc.layerpar_phase = rank, name
        exc.add_note(f"rank {rank} failed in phase {name}")
    except (AttributeError, TypeError):  # exotic exception types without __dict__
        pass


class phase(contextlib.ContextDecorator):
    """Tag exceptions raised inside with the rank and phase ``name`` (see module doc); checks
    the fault injector on entry. Usable as ``with phase("data loading"):`` or ``@phase("x")``.

    Raises:
        ValueError: an empty or non-string name.
    """

    def __init__(self, name: str):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"phase name {name!r} is not allowed: use a non-empty string")
        self.name = name

    def __enter__(self):
        st = getattr(_stack, "names", None)
        if st is None:
            st = _stack.names = []
        st.append(self.name)
        try:
            maybe_inject(self.name)
        except BaseException as exc:
            _tag(exc, self.name)
            st.pop()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        _stack.names.pop()
        if exc is not None:
            _tag(exc, self.name)
        return False


def _message(exc_type, exc) -> str:
    rank = getattr(exc, "layerpar_rank", None)
    rank = _world_rank() if rank is None else rank
    name = getattr(exc, "layerpar_phase", None) or "unknown phase"
    return f"rank {rank} failed in phase {name}: {exc_type.__name__}: {exc}\n"


def fail_fast(comm: MPI.Comm | None = None, exit_code: int = 1) -> None:
    """Make an uncaught exception on any rank end the whole job (``MPI_Abort`` on ``comm``,
    default ``COMM_WORLD``) after printing ``rank R failed in phase P: Type: message`` and the
    traceback to stderr. Covers the main thread (``sys.excepthook``) and other threads
    (``threading.excepthook``, e.g. data-loading threads). Safe to call more than once;
    harmless under ``python -m mpi4py`` (which would abort too, but without the phase line).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if getattr(sys.excepthook, "_layerpar_fail_fast", False):
        return

    def report_and_abort(exc_type, exc, tb):
        try:
            sys.stderr.write(_message(exc_type, exc))
            traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
            sys.stderr.flush()
            sys.stdout.flush()
            # let the launcher's proxy forward the message before the abort kills the job
            # (MPICH's hydra was seen to drop the stdio of an aborting job, rarely, under load)
            time.sleep(0.2)
        finally:
            comm.Abort(exit_code)

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, SystemExit) and exc.code in (None, 0):
            return
        report_and_abort(exc_type, exc, tb)

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        report_and_abort(args.exc_type, args.exc_value, args.exc_traceback)

    hook._layerpar_fail_fast = True
    sys.excepthook = hook
    threading.excepthook = thread_hook


# -- phase tags on the solvers of a LayerParallelResNet ---------------------------------------
def instrument_solver(solver, relax_phase: str, coarse_phase: str | None = None) -> None:
    """Wrap ``solver.solve`` and its recursive ``_cycle`` (instance attributes, the class is
    untouched) so that work on the coarsest level runs in ``coarse_phase`` and everything else
    in ``relax_phase``. Idempotent."""
    if getattr(solver, "_layerpar_phases", None) == (relax_phase, coarse_phase):
        return
    cls = type(solver)
    coarse_phase = coarse_phase or relax_phase

    def solve(*args, **kwargs):
        with phase(relax_phase):
            return cls.solve(solver, *args, **kwargs)

    def _cycle(l, *args, **kwargs):
        name = coarse_phase if solver._st[l].lv.is_coarsest else relax_phase
        with phase(name):
            return cls._cycle(solver, l, *args, **kwargs)

    solver.solve, solver._cycle = solve, _cycle
    solver._layerpar_phases = (relax_phase, coarse_phase)


def instrument_resnet(resnet) -> None:
    """Tag the forward solve of a :class:`~mgrit.nn.LayerParallelResNet` as
    ``"forward relaxation"`` / ``"coarse solve"`` and the backward solve as ``"adjoint"``.
    Re-applied automatically by :func:`mgrit.training.guard.apply_action` after it rebuilds solvers."""
    instrument_solver(resnet._fsolver, "forward relaxation", "coarse solve")
    instrument_solver(resnet._bsolver, "adjoint", "adjoint")
    resnet._layerpar_instrumented = True
