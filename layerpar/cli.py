"""Command-line plumbing of the main job on many ranks: :class:`JobParser`, an
``argparse.ArgumentParser`` that prints help, usage and errors once (rank 0) and ends the whole
job with argparse's status, and turns the flags into a validated
:class:`~layerpar.jobconfig.JobConfig`."""
from __future__ import annotations

import argparse
import sys
import time

from mpi4py import MPI

from mgrit.training.support.faults import abort_quietly

from .jobconfig import JobConfig

__all__ = ["JobParser", "HelpFormatter"]

_UNSET = object()  # a flag not given on the command line (see JobParser.model_defaults)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` only where the help text does not mention the default itself
    and there is one to show (not None, not False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if "default" in text or d is None or d is False or d == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


class JobParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` for jobs run on every rank of ``comm`` (default ``COMM_WORLD``).

    Help, usage and error messages are printed by rank 0 only. With ``hard_exit=True`` (set
    by a job's ``main``) an error ends the job with status 2 through a quiet ``MPI_Abort``
    (rank 0 after printing, the other ranks a moment later, so no rank waits for another and
    no MPI banner or per-rank usage block follows); otherwise ``SystemExit(2)`` as argparse.
    ``model_defaults = (dests, fill)``: the flags ``dests`` not given on the command line are
    left as a sentinel and ``fill(namespace, sentinel)`` sets them (defaults per ``--model``).
    """

    def __init__(self, *args, comm: MPI.Comm | None = None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.hard_exit = False

    def _print_message(self, message, file=None):
        if self.comm.Get_rank() == 0:
            super()._print_message(message, file)

    def exit(self, status=0, message=None):
        if message:
            self._print_message(message, sys.stderr)
        if status and self.hard_exit:
            if self.comm.Get_rank() != 0:
                time.sleep(1.0)  # rank 0 prints and aborts the job first
            abort_quietly(self.comm, status)
        sys.exit(status)

    def parse_config(self, argv=None, world: int | None = None) -> JobConfig:
        """Parse ``argv`` into a :meth:`JobConfig.validated` config for ``world`` ranks
        (default: the size of ``comm``); a bad flag or value is a usage error."""
        dependent, fill = getattr(self, "model_defaults", (set(), None))
        ns = self.parse_args(argv, namespace=argparse.Namespace(**{d: _UNSET for d in dependent}))
        if fill is not None:  # flags whose default depends on --model (left _UNSET if not given)
            fill(ns, _UNSET)
        if getattr(ns, "method", "") is None:  # --method not given: --serial or the default
            if ns.serial:
                ns.method = "serial"
            else:
                del ns.method
        elif getattr(ns, "serial", False) and ns.method != "serial":
            self.error(f"--serial is short for --method serial: it conflicts with --method "
                       f"{ns.method} (pass one of them)")
        try:
            return JobConfig(**vars(ns)).validated(self.comm.Get_size() if world is None
                                                   else world)
        except ValueError as exc:
            self.error(str(exc))
