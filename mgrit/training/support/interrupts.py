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
"""
from __future__ import annotations

import contextlib
import signal
import threading

from mpi4py import MPI

__all__ = ["install", "uninstall", "installed", "deferred", "check", "pending"]

_state = {"installed": False, "previous": None, "depth": 0, "pending": False}


def _handler(signum, frame) -> None:
    if _state["depth"] == 0 or _state["pending"]:
        _state["pending"] = False
        raise KeyboardInterrupt
    _state["pending"] = True


def install() -> bool:
    """Install the deferring SIGINT handler in this process (call on every rank of the job,
    from the main thread); returns False (nothing installed) in another thread."""
    if _state["installed"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _state["previous"] = signal.signal(signal.SIGINT, _handler)
    _state.update(installed=True, depth=0, pending=False)
    return True


def uninstall() -> None:
    """Restore the SIGINT handler that :func:`install` replaced (idempotent)."""
    if _state["installed"] and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _state["previous"] or signal.default_int_handler)
        _state.update(installed=False, previous=None, depth=0, pending=False)


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _state["installed"]


def pending() -> bool:
    """Whether a SIGINT arrived on this rank and has not been acted on yet."""
    return _state["pending"]


def check(comm: MPI.Comm) -> None:
    """Collective over ``comm`` when :func:`install` is in effect (else nothing, no
    communication): raise :class:`KeyboardInterrupt` on every rank if a SIGINT reached any
    of them.

    Raises:
        KeyboardInterrupt: a SIGINT is pending on some rank (then on every rank alike).
    """
    if not _state["installed"]:
        return
    if comm.allreduce(int(_state["pending"]), op=MPI.MAX):
        _state["pending"] = False
        raise KeyboardInterrupt


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
