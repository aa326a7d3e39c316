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
* :func:`fail_fast` -- installs ``sys.excepthook`` (and ``threading.excepthook``): prints ONE
  line ``rank R failed in phase P: Type: message | what to do: ... | traceback: FILE``, keeps
  the full traceback in ``LOG_DIR/error-rank-R.log`` (printed too with ``debug=True``, or when
  no log directory is set), then ``MPI_Abort`` (whose own banner is suppressed). Ranks other
  than 0 wait 0.5 s first, so an error raised on every rank (a bad file, an agreed
  ``ValueError``) is reported once, by rank 0. Works with and without ``python -m mpi4py``.
* Collective phases (:data:`COLLECTIVE_PHASES`: the solves, the pipelined sweeps, data
  loading and gradient averaging of the training loop, evaluation, checkpoints) are also
  :class:`mgrit.collective.guarded` sections: an exception leaving one on one rank ends the
  job at once (this module's one-line report, then ``MPI_Abort``), with or without
  :func:`fail_fast` and ``python -m mpi4py``, unless it was raised on every rank alike
  (:func:`mgrit.collective.agreed`) or the guard is turned off
  (``$LAYERPAR_ABORT_ON_ERROR=0``, :func:`mgrit.collective.set_abort_on_error`: for tests
  that catch an error on every rank).
* :func:`maybe_inject` -- called on entry of every :class:`phase`; raises
  :class:`InjectedFault` when ``$LAYERPAR_INJECT_FAULT`` selects this rank and phase.

``LAYERPAR_INJECT_FAULT`` syntax: comma-separated ``RANK:PHASE[:N]`` items; ``RANK`` is the
``COMM_WORLD`` rank or ``*``; ``PHASE`` a phase name or ``*``; the fault fires on the ``N``-th
entry (1-based, default 1) of that phase on that rank. Example::

    LAYERPAR_INJECT_FAULT="2:coarse solve:3" mpiexec -n 4 python train.py ...

Phase names used by the library (:data:`PHASES`): ``"forward relaxation"``, ``"coarse solve"``
(forward MGRIT; see :func:`~mgrit.training.support.solvers.instrument_resnet`), ``"adjoint"`` (the backward solve),
``"pipelined forward"`` / ``"pipelined adjoint"`` (the one-level exact path of
:mod:`mgrit.nn.resnet.pipelined`, which runs no MGRIT solve: its forward sweep and messages / its
backward's checks, agreement and gradient messages),
``"data loading"``, ``"gradient averaging"`` and ``"evaluation"`` (the training loop),
``"checkpoint"`` (:mod:`mgrit.training.checkpoint`), ``"run directory"`` and ``"model setup"``
(the main job). Each has a default hint of what to do (:data:`HINTS`); ``phase(name, hint=...)``
gives a specific one.

Usage in a training script (:class:`mgrit.training.Trainer` tags its own phases and
instruments the network's MGRIT solves)::

    fail_fast(MPI.COMM_WORLD, log_dir=run_dir)   # first thing after MPI is up
    trainer = Trainer(net, optimizer, grid)
    for ...:
        with phase("data loading", hint="check the files in DIR"):
            xb, yb = next(batches)
        trainer.step(xb, yb)
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback

from mpi4py import MPI

from ...collective import guarded, set_failure_reporter

__all__ = ["PHASES", "COLLECTIVE_PHASES", "HINTS", "phase", "current_phase", "fail_fast",
           "failure_line", "maybe_inject", "InjectedFault", "abort_quietly", "set_log_dir",
           "ENV"]

ENV = "LAYERPAR_INJECT_FAULT"
PHASES = ("forward relaxation", "coarse solve", "adjoint", "pipelined forward", "pipelined adjoint",
          "data loading", "gradient averaging", "evaluation", "checkpoint", "run directory",
          "model setup")
#: Phases that communicate with other ranks: a failure in one on one rank ends the job.
COLLECTIVE_PHASES = frozenset(("forward relaxation", "coarse solve", "adjoint",
                               "pipelined forward", "pipelined adjoint", "data loading",
                               "gradient averaging", "evaluation", "checkpoint"))

_DIVERGED = ("if it is a NaN/Inf: lower the learning rate, iterate MGRIT to a tolerance (exact "
             "mode) or use the convergence guard")
#: What to do, per phase (shown in the one-line report).
HINTS = {
    "forward relaxation": f"a step module or the forward MGRIT solve failed; {_DIVERGED}",
    "coarse solve": f"the coarse-grid MGRIT solve failed; {_DIVERGED}",
    "adjoint": f"the adjoint (backward) MGRIT solve failed; {_DIVERGED}",
    "pipelined forward": "a step module or a state message failed in the one-level exact "
                         "forward (layers swept in order, pipelined across ranks); if it is a "
                         "NaN/Inf: lower the learning rate",
    "pipelined adjoint": "the one-level exact backward failed (its checks, the agreement "
                         "between ranks or a gradient message): every rank must backpropagate "
                         "the same forwards; do not change parameters in place before backward",
    "data loading": "check that the data set files exist, are complete and in the expected "
                    "format",
    "gradient averaging": "the replicas disagree (parameters changed shape, dtype or device?)",
    "evaluation": "the test-set forward failed: check the test data",
    "checkpoint": "a mismatch: resume with the model, optimizer and data of the run that "
                  "wrote the checkpoint; a file error: check the path and free disk space",
    "run directory": "choose a writable run directory",
    "model setup": "check the network flags against the data set",
}

_stack = threading.local()
_entries: dict = {}
_config = {"log_dir": None, "debug": False, "print_traceback": None}


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


def _tag(exc: BaseException, name: str, hint: str | None = None) -> None:
    if not hasattr(exc, "__dict__"):  # exotic exception types without attributes: untagged
        return
    if hint and getattr(exc, "layerpar_hint", None) is None:
        exc.layerpar_hint = hint
    if getattr(exc, "layerpar_phase", None) is not None:
        return
    rank = _world_rank()
    exc.layerpar_rank, exc.layerpar_phase = rank, name
    exc.add_note(f"rank {rank} failed in phase {name}")


class phase(contextlib.ContextDecorator):
    """Tag exceptions raised inside with the rank and phase ``name`` (see module doc); checks
    the fault injector on entry. Usable as ``with phase("data loading"):`` or ``@phase("x")``.
    ``hint``: what the user should do if this phase fails (default ``HINTS[name]``);
    the innermost hint wins.

    Raises:
        ValueError: an empty or non-string name.
    """

    def __init__(self, name: str, hint: str | None = None):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"phase name {name!r} is not allowed: use a non-empty string")
        self.name, self.hint = name, hint

    def __enter__(self):
        st = getattr(_stack, "names", None)
        if st is None:
            st = _stack.names = []
        st.append(self.name)
        try:
            maybe_inject(self.name)
        except BaseException as exc:
            _tag(exc, self.name, self.hint)
            st.pop()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        _stack.names.pop()
        if exc is not None:
            _tag(exc, self.name, self.hint)
            if self.name in COLLECTIVE_PHASES:  # one rank failed alone: end the job
                guarded(self.name).__exit__(exc_type, exc, tb)
        return False


def _hint(exc: BaseException) -> str | None:
    if isinstance(exc, InjectedFault):
        return f"the fault was injected by ${ENV} (fault-injection tests): unset it"
    hint = getattr(exc, "layerpar_hint", None)
    if hint:
        return hint
    if isinstance(exc, MemoryError):
        return "reduce the batch size or the network size"
    name = getattr(exc, "layerpar_phase", None)
    return HINTS.get(name) if name else None


def failure_line(exc: BaseException, log_file: str | None = None) -> str:
    """The one-line report of ``exc``: ``rank R failed in phase P: Type: message`` (or
    ``rank R failed outside a tagged phase: ...``), ``| what to do: HINT`` when known and
    ``| traceback: FILE`` when one was written. Newlines of the message become spaces."""
    rank = getattr(exc, "layerpar_rank", None)
    rank = _world_rank() if rank is None else rank
    name = getattr(exc, "layerpar_phase", None)
    where = f"in phase {name}" if name else "outside a tagged phase"
    text = " ".join(str(exc).split()) or "(no message)"
    line = f"rank {rank} failed {where}: {type(exc).__name__}: {text}"
    hint = _hint(exc)
    if hint:
        line += f" | what to do: {hint}"
    if log_file:
        line += f" | traceback: {log_file}"
    return line


def _write_log(exc_type, exc, tb, rank: int) -> tuple[str | None, str | None]:
    """Full traceback to ``LOG_DIR/error-rank-R.log``: (path, None) or (None, why not)."""
    log_dir = _config["log_dir"]
    if not log_dir:
        return None, None
    path = os.path.join(os.fspath(log_dir), f"error-rank-{rank}.log")
    try:
        with open(path, "w") as fh:
            traceback.print_exception(exc_type, exc, tb, file=fh)
    except OSError as err:
        return None, f"could not write {path}: {err}"
    return path, None


def _report_and_abort(comm, exit_code, exc_type, exc, tb) -> None:
    try:
        rank = _world_rank()
        log_file, log_error = _write_log(exc_type, exc, tb, rank)
        if rank != 0:
            # an error raised on every rank is reported once: rank 0 aborts the job first
            time.sleep(0.5)
        line = failure_line(exc, log_file)
        if log_error:
            line += f" ({log_error})"
        show_tb = _config["print_traceback"]
        if show_tb is None:
            show_tb = _config["debug"] or not log_file
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        if show_tb:
            traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
        sys.stderr.flush()
        # let the launcher's proxy forward the message before the abort kills the job
        # (MPICH's hydra was seen to drop the stdio of an aborting job, rarely, under load)
        time.sleep(0.2)
        _silence_stderr()  # MPI_Abort's own banner repeats what the line says
    finally:
        comm.Abort(exit_code)


def _guard_report(name, exc_type, exc, tb) -> None:
    """The reporter of :class:`mgrit.collective.guarded` sections: this module's line."""
    _tag(exc, name)
    _report_and_abort(MPI.COMM_WORLD, 1, exc_type, exc, tb)


set_failure_reporter(_guard_report)


def _silence_stderr() -> None:
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 2)
    os.close(fd)


def abort_quietly(comm: MPI.Comm | None = None, exit_code: int = 1) -> None:
    """Flush stdout/stderr, then ``MPI_Abort(exit_code)`` without MPI's banner (e.g. after a
    command-line error was printed once by rank 0)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    sys.stdout.flush()
    sys.stderr.flush()
    # as in fail_fast: give the launcher's proxy time to forward what was printed (under load
    # MPICH's hydra dropped the error line of an immediately aborting job, 2 of ~30 runs)
    time.sleep(0.5)
    _silence_stderr()
    comm.Abort(exit_code)


def set_log_dir(log_dir) -> None:
    """Where :func:`fail_fast` keeps tracebacks from now on (``error-rank-R.log``; None: no
    file). Installs nothing by itself."""
    _config["log_dir"] = log_dir


def fail_fast(comm: MPI.Comm | None = None, exit_code: int = 1, *,
              log_dir: str | os.PathLike | None = None,
              debug: bool | None = None, print_traceback: bool | None = None) -> None:
    """Make an uncaught exception on any rank end the whole job (``MPI_Abort`` on ``comm``,
    default ``COMM_WORLD``) after one line per failure (see :func:`failure_line`). Covers the
    main thread (``sys.excepthook``) and other threads (``threading.excepthook``). Harmless
    under ``python -m mpi4py`` (which would abort too, but with a traceback per rank).

    Calling it again (e.g. once the run directory exists) updates the settings:

    Args:
        log_dir: folder for ``error-rank-R.log`` (the full traceback of rank R); None: none.
        debug: also print the traceback (default False).
        print_traceback: force the traceback on (True) or off (False); default None = print
            it when ``debug`` or when there is no log file to keep it.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if log_dir is not None:
        _config["log_dir"] = log_dir
    if debug is not None:
        _config["debug"] = bool(debug)
    if print_traceback is not None:
        _config["print_traceback"] = bool(print_traceback)
    if getattr(sys.excepthook, "_layerpar_fail_fast", False):
        return

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, SystemExit) and exc.code in (None, 0):
            return
        _report_and_abort(comm, exit_code, exc_type, exc, tb)

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        _report_and_abort(comm, exit_code, args.exc_type, args.exc_value, args.exc_traceback)

    hook._layerpar_fail_fast = True
    sys.excepthook = hook
    threading.excepthook = thread_hook
