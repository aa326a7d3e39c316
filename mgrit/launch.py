"""Detect a launch that silently does the wrong thing: a foreign launcher (torchrun, Slurm's
``srun`` with an MPI that is not the one mpi4py was built with, another MPI's ``mpirun``)
started K processes, but MPI sees each of them as a 1-rank job, so K independent jobs would
train side by side (and write into the same run folder).

The launchers' environment variables say how many processes they started:

======================  ============================================================
launcher                variables read (world size; rank)
======================  ============================================================
torchrun / elastic      ``WORLD_SIZE`` (with ``TORCHELASTIC_RUN_ID``, ``LOCAL_WORLD_SIZE``
                        or ``MASTER_ADDR``); ``RANK``
Slurm ``srun``          ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``), only inside a job
                        step (``SLURM_STEP_ID`` a number: not the batch script itself);
                        ``SLURM_PROCID``
MPICH / Intel hydra     ``PMI_SIZE``; ``PMI_RANK``
PMIx launchers          ``PMIX_SIZE``; ``PMIX_RANK``
Open MPI ``mpirun``     ``OMPI_COMM_WORLD_SIZE``; ``OMPI_COMM_WORLD_RANK``
======================  ============================================================

:func:`check_launch` raises :class:`LaunchError` when one of them says more than one process
while ``MPI.COMM_WORLD`` has one rank. It is called by :class:`~mgrit.parallel.ProcessGrid`
(every library entry point that builds a grid) and at the start of ``experiments/train.py``.
No communication: each process decides from its own environment. Set
``LAYERPAR_IGNORE_LAUNCHER=1`` to start independent 1-rank processes on purpose (e.g. a
parameter sweep as one ``srun`` step).

How to launch instead: ``mpiexec -n K python -m mpi4py SCRIPT ...`` with the ``mpiexec`` of
the MPI that mpi4py was built with (``python -c "import mpi4py; print(mpi4py.get_config())"``),
or, on a Slurm cluster, ``srun`` with an mpi4py built against the site MPI (README, "Slurm").
"""
from __future__ import annotations

import os
import sys
import time

from mpi4py import MPI

__all__ = ["LaunchError", "foreign_launch", "check_launch", "launch_hint", "refuse_foreign_launch",
           "IGNORE_ENV"]

IGNORE_ENV = "LAYERPAR_IGNORE_LAUNCHER"


class LaunchError(RuntimeError):
    """A foreign launcher started several processes that MPI sees as separate 1-rank jobs."""


def _int(env, name: str) -> int | None:
    try:
        return int(env.get(name, ""))
    except ValueError:
        return None


def foreign_launch(env=None) -> tuple[str, int, int] | None:
    """``(launcher, processes, this process's rank)`` when the environment ``env`` (default
    ``os.environ``) says a launcher started more than one process, else None. Reads only the
    variables in the module doc."""
    env = os.environ if env is None else env
    size = _int(env, "WORLD_SIZE")
    if size and size > 1 and any(k in env for k in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE",
                                                    "MASTER_ADDR")):
        return "torchrun (torch.distributed)", size, _int(env, "RANK") or 0
    step = env.get("SLURM_STEP_ID", "")
    if step.isdigit():  # inside an srun step (not the batch script, not the extern step)
        size = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
        if size and size > 1:
            return "Slurm srun", size, _int(env, "SLURM_PROCID") or 0
    for name, rank, who in (("PMI_SIZE", "PMI_RANK", "an MPICH-style mpiexec (PMI)"),
                            ("PMIX_SIZE", "PMIX_RANK", "a PMIx launcher"),
                            ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's mpirun")):
        size = _int(env, name)
        if size and size > 1:
            return f"{who} ({name}={size})", size, _int(env, rank) or 0
    return None


def launch_hint(size: int, script: str = "SCRIPT") -> str:
    """How to start ``size`` ranks of ``script`` properly (one line)."""
    return (f"launch with MPI: mpiexec -n {size} python -m mpi4py {script} ... (the mpiexec of "
            f"the MPI mpi4py was built with), or on Slurm: srun -n {size} python -m mpi4py "
            f"{script} ... with mpi4py built against the site MPI (README, 'Slurm')")


def check_launch(script: str = "SCRIPT", env=None) -> None:
    """Raise :class:`LaunchError` (one line: the launcher, its process count, how to launch)
    when a foreign launcher started several processes but ``MPI.COMM_WORLD`` has one rank.
    No-op with ``$LAYERPAR_IGNORE_LAUNCHER=1``, or when MPI sees more than one rank."""
    env = os.environ if env is None else env
    if env.get(IGNORE_ENV, "") not in ("", "0") or MPI.COMM_WORLD.Get_size() != 1:
        return
    found = foreign_launch(env)
    if found is None:
        return
    who, size, _ = found
    raise LaunchError(f"started by {who} as {size} processes, but MPI sees 1 rank in each: they "
                      f"would run {size} independent jobs; {launch_hint(size, script)} "
                      f"(${IGNORE_ENV}=1 runs them independently on purpose)")


def refuse_foreign_launch(script: str) -> None:
    """For a script's start (before importing torch): on a foreign launch, the launcher's
    first process prints ``SCRIPT: error: ...`` (one line, :func:`check_launch`) and every
    process exits with status 2 (``SystemExit``); the others wait 5 s first, so that a launcher
    that stops the job at the first exit does not stop the one that prints."""
    try:
        check_launch(script)
    except LaunchError as exc:
        found = foreign_launch()
        if found is None or found[2] == 0:
            print(f"{script}: error: {exc}", file=sys.stderr, flush=True)
        else:
            time.sleep(5.0)
        raise SystemExit(2) from None
