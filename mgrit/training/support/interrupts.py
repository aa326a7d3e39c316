"""Ctrl-C on many ranks: every rank stops at the same step boundary, and a write is never cut.

MPICH's launcher forwards one SIGINT to every rank, at slightly different moments, and Python
raises :class:`KeyboardInterrupt` only between bytecodes. So with Python's default handler a
rank inside a blocking MPI call (waiting for a rank that has already stopped) never raises and
never reports, and an interrupt inside ``torch.save`` or h5py leaves a half-written file whose
error (``unexpected pos ...``) replaces the interrupt.

With :func:`install` (every rank of a job; the main job does so), SIGINT inside a *deferral
zone* (:func:`deferred`: the :class:`~mgrit.training.Trainer`'s fit loop, a checkpoint write)
only records the request; :func:`check` -- collective, at every step boundary of the fit loop
and when the outermost zone is left -- lets every rank raise :class:`KeyboardInterrupt` at the
same point. A second SIGINT while one is pending raises at once (a way out of a hang; under
``mpiexec`` the launcher's own "Ctrl-C again" aborts the job). Outside the zones, and without
:func:`install`, SIGINT behaves as Python's default. Only the main thread handles signals.
SIGTERM (a scheduler's time limit: Slurm sends it before SIGKILL) is handled alike and raises
:class:`Terminated`, a :class:`KeyboardInterrupt`, on every rank (exit status 143 by convention).
"""
from __future__ import annotations

import contextlib
import signal
import threading

from mpi4py import MPI

__all__ = ["install", "uninstall", "installed", "deferred", "check", "pending", "Terminated"]

_state = {"installed": False, "previous": None, "previous_term": None, "depth": 0,
          "pending": False, "signal": 0}
_TERM = "SIGTERM (e.g. the scheduler's time limit)"


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the job (with :func:`install`: at one step boundary on every rank)."""


def _interrupt(signum: int) -> KeyboardInterrupt:
    return Terminated(_TERM) if signum == signal.SIGTERM else KeyboardInterrupt()


def _handler(signum, frame) -> None:
    if _state["depth"] == 0 or _state["pending"]:
        _state["pending"] = False
        raise _interrupt(signum)
    _state["pending"] = True
    _state["signal"] = max(_state["signal"], int(signum))


def install() -> bool:
    """Install the deferring SIGINT handler in this process (call on every rank of the job,
    from the main thread); returns False (nothing installed) in another thread."""
    if _state["installed"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _state["previous"] = signal.signal(signal.SIGINT, _handler)
    _state["previous_term"] = signal.signal(signal.SIGTERM, _handler)
    _state.update(installed=True, depth=0, pending=False, signal=0)
    return True


def uninstall() -> None:
    """Restore the SIGINT and SIGTERM handlers that :func:`install` replaced (idempotent)."""
    if _state["installed"] and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _state["previous"] or signal.default_int_handler)
        signal.signal(signal.SIGTERM, _state["previous_term"] or signal.SIG_DFL)
        _state.update(installed=False, previous=None, previous_term=None, depth=0,
                      pending=False, signal=0)


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _state["installed"]


def pending() -> bool:
    """Whether a SIGINT or SIGTERM arrived on this rank and has not been acted on yet."""
    return _state["pending"]


def check(comm: MPI.Comm) -> None:
    """Collective over ``comm`` when :func:`install` is in effect (else nothing, no
    communication): raise :class:`KeyboardInterrupt` on every rank if a SIGINT reached any
    of them (:class:`Terminated` if a SIGTERM reached any).

    Raises:
        KeyboardInterrupt: a signal is pending on some rank (then on every rank alike).
    """
    if not _state["installed"]:
        return
    got = comm.allreduce(_state["signal"] if _state["pending"] else 0, op=MPI.MAX)
    if got:
        _state.update(pending=False, signal=0)
        raise _interrupt(got)


@contextlib.contextmanager
def deferred(comm: MPI.Comm):
    """Deferral zone (collective: entered and left on every rank of ``comm`` alike): a SIGINT
    inside it waits for the next :func:`check`; leaving the outermost zone without an
    exception calls :func:`check`."""
    _state["depth"] += 1
    try:
        yield
    except BaseException:
        _state["depth"] -= 1
        raise
    _state["depth"] -= 1
    if _state["depth"] == 0:
        check(comm)
