"""No collective the library starts waits forever, and no failure inside one leaves the other
ranks waiting: the deadline of the library's rendezvous and the guard of its collective
sections.

* :func:`allgather_within` / :func:`rendezvous` -- an ``allgather`` (and an arrival check)
  with a deadline, for the collectives a user's call starts on every rank: the agreement
  before a backward (:func:`mgrit.nn.chains.agreement.agree_backward`), checkpoints and evaluation.
  Built on point-to-point messages (``isend`` + ``improbe`` polled until the deadline), so a
  rank that never arrives is *named*: after :func:`collective_timeout` seconds (default
  :data:`DEFAULT_TIMEOUT` = 600 s; ``$LAYERPAR_COLLECTIVE_TIMEOUT``, or
  :func:`set_collective_timeout`; ``None``/``"none"`` waits forever) it raises
  :class:`CollectiveTimeout` naming the missing ranks, e.g. when ``.backward()`` was called on
  one rank only. A rank that meets another kind of rendezvous (it skipped this one and went
  on) is named too. After a timeout the communicator is unusable (messages are left posted):
  the error ends the job through :class:`guarded`.
* :class:`guarded` -- context manager / decorator around a section that communicates (an
  MGRIT solve, the backward agreement, the pipelined sweeps). An exception leaving it on one
  rank would leave the others blocked in their next receive, whatever the launch line (a plain
  ``mpiexec -n K python script.py`` does not abort on an uncaught exception). So, on a world
  of more than one rank, the guard prints the failure (rank, phase, message) and calls
  ``MPI.COMM_WORLD.Abort(1)``. Exceptions raised *on every rank alike* by design (validation
  consensus, the backward agreement's verdict, a checkpoint error -- marked with
  :func:`agreed`) pass through, so they stay catchable. ``KeyboardInterrupt`` and
  ``SystemExit`` pass through too (the main job reports an interrupt itself).

  Opt out with ``$LAYERPAR_ABORT_ON_ERROR=0`` or :func:`set_abort_on_error(False)
  <set_abort_on_error>` -- for tests that catch an error on every rank (the MPI test harness
  does so for its cases); then such an exception propagates and the other ranks may wait.
  :mod:`mgrit.training.support.faults` installs its one-line report (hint and traceback file) as the
  reporter (:func:`set_failure_reporter`); the default prints one line and the traceback.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
import traceback
from typing import Callable

from mpi4py import MPI

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV", "ABORT_ENV", "CollectiveTimeout",
           "collective_timeout", "set_collective_timeout", "allgather_within", "rendezvous",
           "guarded", "agreed", "abort_on_error", "set_abort_on_error", "set_failure_reporter",
           "check_thread_level"]

#: Seconds a library rendezvous waits for every rank by default (10 minutes).
DEFAULT_TIMEOUT = 600.0
TIMEOUT_ENV = "LAYERPAR_COLLECTIVE_TIMEOUT"
ABORT_ENV = "LAYERPAR_ABORT_ON_ERROR"
#: Tag of the rendezvous messages: clear of the solver's (< 4,000), the pipelined path's
#: (5,001-5,002) and the segment transfers' (20,000-32,000).
_TAG = 4_321
_UNSET = object()
_SPIN = 2e-3  # seconds a rendezvous polls without sleeping before it backs off
_settings: dict = {"timeout": _UNSET, "abort": None, "reporter": None}


class CollectiveTimeout(RuntimeError):
    """Ranks never arrived at a library collective within :func:`collective_timeout`."""


_LEVELS = {}


def check_thread_level() -> None:
    """``RuntimeError`` (marked :func:`agreed`) when the library communicates from a thread
    other than the main one while MPI was initialized with less than ``MPI.THREAD_MULTIPLE``
    (``MPI.Query_thread()``; e.g. ``MPI4PY_RC_THREAD_LEVEL=single``) on a world of more than
    one rank: MPI calls from several threads at that level are undefined and two training
    threads then wait for each other's messages forever. Cheap: nothing on the main thread;
    called before the library's collectives (:class:`guarded`, :func:`allgather_within`,
    ``raise_agreed``, ``ProcessGrid``)."""
    if threading.current_thread() is threading.main_thread():
        return
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    if "level" not in _LEVELS:
        _LEVELS["level"] = MPI.Query_thread()
        _LEVELS["world"] = MPI.COMM_WORLD.Get_size()
    level = _LEVELS["level"]
    if level >= MPI.THREAD_MULTIPLE or _LEVELS["world"] == 1:
        return
    names = {MPI.THREAD_SINGLE: "THREAD_SINGLE", MPI.THREAD_FUNNELED: "THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "THREAD_SERIALIZED"}
    raise agreed(RuntimeError(
        f"mgrit communicates from thread {threading.current_thread().name!r}, not the main "
        f"thread, but MPI was initialized with {names.get(level, level)} "
        f"(MPI.Query_thread()): MPI calls from several threads need MPI.THREAD_MULTIPLE, or "
        f"the threads' messages may wait for each other forever. Set "
        f"MPI4PY_RC_THREAD_LEVEL=multiple (or mpi4py.rc.thread_level = 'multiple' before "
        f"importing mpi4py.MPI; it is mpi4py's default), or train on the main thread"))


def _parse_timeout(value, source: str) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
        return None
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = float("nan")
    if isinstance(value, bool) or not (math.isfinite(t) and t > 0):
        raise ValueError(f"{source}={value!r} is not allowed: use a number of seconds > 0 or "
                         f"None (wait forever)")
    return t


def collective_timeout() -> float | None:
    """Seconds a rendezvous waits (None: forever): :func:`set_collective_timeout`'s value,
    else ``$LAYERPAR_COLLECTIVE_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`."""
    if _settings["timeout"] is not _UNSET:
        return _settings["timeout"]
    env = os.environ.get(TIMEOUT_ENV)
    return DEFAULT_TIMEOUT if env is None else _parse_timeout(env, f"${TIMEOUT_ENV}")


def set_collective_timeout(seconds: float | None) -> None:
    """Set the deadline of every later rendezvous (seconds > 0, or None = wait forever); the
    same value on every rank. Raises ValueError for anything else."""
    _settings["timeout"] = _parse_timeout(seconds, "timeout")


def abort_on_error() -> bool:
    """Whether :class:`guarded` aborts the job (default True; ``$LAYERPAR_ABORT_ON_ERROR=0``
    or :func:`set_abort_on_error` turn it off)."""
    if _settings["abort"] is not None:
        return _settings["abort"]
    return os.environ.get(ABORT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def set_abort_on_error(enabled: bool | None) -> None:
    """Turn the abort of :class:`guarded` on or off (None: back to the environment's)."""
    _settings["abort"] = None if enabled is None else bool(enabled)


def set_failure_reporter(fn: Callable | None) -> None:
    """``fn(phase, exc_type, exc, tb)`` reports a failure and ends the job (must not return);
    None restores the default (one line, the traceback, ``MPI.COMM_WORLD.Abort(1)``)."""
    _settings["reporter"] = fn


def agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised on every rank alike (it passes :class:`guarded`); returns it."""
    with contextlib.suppress(AttributeError):
        exc.layerpar_agreed = True
    return exc


def _default_report(name: str, exc_type, exc, tb) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    where = getattr(exc, "layerpar_phase", None) or name
    text = " ".join(str(exc).split()) or "(no message)"
    sys.stdout.flush()
    sys.stderr.write(f"rank {rank} failed in phase {where}: {exc_type.__name__}: {text} "
                     f"(ending the job: MPI.COMM_WORLD.Abort)\n")
    traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
    sys.stderr.flush()
    time.sleep(0.2)  # let the launcher forward the lines before the abort
    MPI.COMM_WORLD.Abort(1)


def end_job(name: str, exc_type, exc, tb) -> None:
    """Report ``exc`` (failed in phase ``name``) through the reporter and abort the job."""
    (_settings["reporter"] or _default_report)(name, exc_type, exc, tb)


class guarded(contextlib.ContextDecorator):
    """A section ``name`` that communicates: an ``Exception`` leaving it on a world of more
    than one rank ends the job (see module doc), unless :func:`agreed` or opted out.
    ``agreed_types``: exception types the section itself raises on every rank alike (e.g. the
    MGRIT solver's ``FloatingPointError`` for a NaN/Inf residual, which is allreduced)."""

    def __init__(self, name: str, agreed_types: tuple = ()):
        self.name, self.agreed_types = name, tuple(agreed_types)

    def __enter__(self):
        check_thread_level()
        return self

    def __exit__(self, exc_type, exc, tb):
        if isinstance(exc, self.agreed_types):
            agreed(exc)  # outer sections let it pass too
        if exc is None or not isinstance(exc, Exception) \
                or getattr(exc, "layerpar_agreed", False) or not abort_on_error():
            return False
        if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
            return False
        end_job(self.name, exc_type, exc, tb)
        return False


def allgather_within(comm: MPI.Comm, obj, what: str, timeout=_UNSET) -> list:
    """``comm.allgather(obj)`` (any picklable ``obj``; ``what``: what the ranks meet for, in
    messages and to tell rendezvous apart) that waits at most ``timeout`` seconds (default
    :func:`collective_timeout`; None: forever) for every rank.

    Returns:
        the ranks' objects, in rank order (``[obj]`` on one rank, without communicating).

    Raises:
        CollectiveTimeout: ranks that never arrived (or arrived at another rendezvous) are
            named; the communicator must not be used afterwards.
    """
    size, me = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return [obj]
    check_thread_level()
    timeout = collective_timeout() if timeout is _UNSET else _parse_timeout(timeout, "timeout")
    sends = [comm.isend((what, obj), dest=r, tag=_TAG) for r in range(size) if r != me]
    got, pending = {me: obj}, set(range(size)) - {me}
    strays: dict = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    pause, spin_until = 0.0, time.monotonic() + _SPIN
    while pending:
        progress = False
        for r in sorted(pending):
            msg = comm.improbe(source=r, tag=_TAG)
            if msg is not None:
                kind, value = msg.recv()
                pending.discard(r)
                progress = True
                if kind == what:
                    got[r] = value
                else:
                    strays[r] = kind
        if not pending:
            break
        if deadline is not None and time.monotonic() > deadline:
            break
        if progress or time.monotonic() < spin_until:  # busy-poll first, as MPI's own waits
            pause = 0.0
            continue
        pause = min(2e-3, pause * 2 or 1e-5)
        time.sleep(pause)
    if pending or strays:
        parts = []
        if pending:
            parts.append(f"rank(s) {sorted(pending)} never arrived within {timeout:g} s")
        if strays:
            parts.append("; ".join(f"rank {r} arrived at {k!r} instead" for r, k in
                                   sorted(strays.items())))
        raise CollectiveTimeout(
            f"rank {me} waited for {what} on a communicator of {size} ranks: "
            + "; ".join(parts) + f" (every rank must call it; the deadline is "
            f"${TIMEOUT_ENV} or mgrit.collective.set_collective_timeout, None waits forever)")
    MPI.Request.waitall(sends)
    return [got[r] for r in range(size)]


def rendezvous(comm: MPI.Comm, what: str, timeout=_UNSET) -> None:
    """Wait (at most ``timeout`` s, see :func:`allgather_within`) until every rank of ``comm``
    has arrived at ``what``; raises :class:`CollectiveTimeout` naming the others."""
    allgather_within(comm, None, what, timeout)
