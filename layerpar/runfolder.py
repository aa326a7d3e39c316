"""The main job's run folder: what it holds, how ``--overwrite`` clears it, the console copy
(``console.log``), the interrupt report and which solve produced the reported test metrics.

A run folder (``--out``, default ``runs/<method>-<timestamp>``) holds :data:`RUN_FILES`:
``config.json`` (the settings and the run's facts; :meth:`JobConfig.from_json
<layerpar.jobconfig.JobConfig.from_json>`), ``console.log`` (rank 0's console, without
progress bars), ``metrics.h5`` / ``metrics.csv`` (per epoch, epoch 0 = before training) and
``steps.csv`` (per optimizer step), ``summary.json``, ``curves.png``, ``model.pt`` (the final
weights; :func:`layerpar.export.load_run` makes a plain PyTorch model of it),
``checkpoint.pt`` (``--checkpoint-every``), ``guard.jsonl`` / ``bias.jsonl``,
``error-rank-R.log`` (a failure's traceback), ``lm.json`` (``--model gpt``) and ``tensorboard/``
(``--tensorboard``). ``model.pt`` is written by every run (a layer-wise run's: its stages and
heads, whose layers and last head are the network its test metrics come from).
A folder holding only what a job that failed before
its first step leaves (:data:`UNTRAINED_FILES`) is no run: :func:`never_trained` lets the
corrected command re-use it.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

from mgrit.training.support.nets import as_net

__all__ = ["RUN_FILES", "UNTRAINED_FILES", "never_trained", "RefuseEmptyResume", "clear_run_dir", "ConsoleCopy",
           "interrupt_line", "eval_solve"]

#: Names (glob patterns) of what a run writes into its folder; ``--overwrite`` deletes these.
RUN_FILES = ("config.json", "console.log", "metrics.h5", "metrics.h5.tmp", "metrics.csv",
             "steps.csv", "summary.json", "curves.png", "model.pt", "model.pt.tmp",
             "checkpoint.pt", "checkpoint.pt.tmp", "guard.jsonl", "bias.jsonl",
             "error-rank-*.log", "tensorboard", "lm.json")


#: What a job leaves in its folder when it fails before its first optimizer step (a late error
#: such as a model setting the data do not allow): such a folder is no run and is re-used
#: (:func:`never_trained`).
UNTRAINED_FILES = ("config.json", "console.log", "error-rank-*.log", "steps.csv")


def never_trained(run) -> bool:
    """Whether the folder ``run`` holds only what a job that never trained leaves
    (:data:`UNTRAINED_FILES`: the job's own ``config.json``, which it writes first, and maybe
    its logs and a ``steps.csv`` without steps), so a corrected rerun may use it."""
    run = Path(run)
    entries = sorted(os.listdir(run)) if run.is_dir() else []
    if "config.json" not in entries or any(  # (the job writes config.json first)
            not any(fnmatch.fnmatch(e, pat) for pat in UNTRAINED_FILES)
            or not (run / e).is_file() for e in entries):
        return False
    try:
        if "argv" not in json.loads((run / "config.json").read_text()):
            return False  # not a config.json of the job
        if "steps.csv" in entries and len((run / "steps.csv").read_text().splitlines()) > 1:
            return False
    except (OSError, ValueError, TypeError):
        return False
    return True


def clear_run_dir(run) -> list:
    """Delete the :data:`RUN_FILES` of an earlier run in ``run`` (other files are kept);
    returns the names deleted."""
    run = Path(run)
    gone = []
    for entry in sorted(os.listdir(run)) if run.is_dir() else []:
        if any(fnmatch.fnmatch(entry, pat) for pat in RUN_FILES):
            path = run / entry
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            gone.append(entry)
    return gone


class _Copy:
    """A text stream that also writes what it is given to ``log`` (progress-bar redraws, which
    contain ``\\r``, only to the stream)."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, s):
        n = self._stream.write(s)
        if "\r" not in s and "\x1b" not in s:
            self._log.write(s)
        return n

    def flush(self):
        self._stream.flush()
        self._log.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's
        return getattr(self._stream, name)


class ConsoleCopy:
    """Context manager: copies ``sys.stdout`` and ``sys.stderr`` into ``path`` (appended with
    ``append=True``, e.g. on ``--resume``) until it exits. Use on the printing rank only."""

    def __init__(self, path, append: bool = False):
        self.path, self.append = Path(path), append
        self._saved, self._log = None, None

    def __enter__(self):
        self._log = open(self.path, "a" if self.append else "w", buffering=1)
        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Copy(sys.stdout, self._log), _Copy(sys.stderr, self._log)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = self._saved
        self._log.close()
        return False


def interrupt_line(position, epochs: int, batches: int, checkpoint, saved_at, argv,
                   world: int = 1) -> str:
    """The console line of an interrupted run: where it stopped (``position`` = 0-based
    ``(epoch, batch)`` of the step in progress, or None before training), the last checkpoint
    (``saved_at`` = its ``(epoch, batch)`` position, or None) and how to resume (``argv``:
    the job's command line, run on ``world`` ranks)."""
    if position is None:
        where = "interrupted before training started"
    else:
        where = (f"interrupted at epoch {position[0] + 1}/{epochs}, batch "
                 f"{position[1] + 1}/{batches}")
    if checkpoint and saved_at is not None and os.path.isfile(checkpoint):
        args, skip = [], False
        for a in argv:  # the same command with --resume CHECKPOINT (instead of --overwrite)
            if skip:
                skip = False
                continue
            if a in ("--resume",):
                skip = True
                continue
            if a == "--overwrite" or a.startswith("--resume="):
                continue
            args.append(a)
        e, b = saved_at
        ckpt = (f"last checkpoint {checkpoint} (after {b} batch(es) of epoch {e + 1})" if b
                else f"last checkpoint {checkpoint} (end of epoch {e})")
        launch = f"mpiexec -n {world} python -m mpi4py" if world > 1 else "python -m mpi4py"
        cmd = shlex.join(args + ["--resume", checkpoint])
        return f"{where}; {ckpt}; resume with `{launch} {cmd}`"
    return (f"{where}; no checkpoint was written (--checkpoint-every K saves one every K "
            f"steps): start again to continue")


def eval_solve(net, method: str, model: str = "", gru_eval_rtol: float = 0.0) -> str:
    """Which forward produced the test metrics of a job's network ``net`` (as trained, at the
    end of the fit: a guard or bias monitor may have changed its solvers) for ``--method``
    ``method`` and ``--model`` ``model``."""
    if method in ("sequential", "decoupled"):
        return "serial forward of the layer-wise trained network (exact)"
    if model == "gru" and method == "mgrit":
        return (f"MGRIT forward in time to relative residual {gru_eval_rtol:g}"
                if gru_eval_rtol > 0 else "MGRIT forward in time with the training cycles")
    net = as_net(net)
    segs = net.solver_segments()
    if not segs:
        return "serial forward (exact)"
    if all(s.forward_solver.hierarchy.n_levels == 1 for s in segs):
        return "one-level forward, layers in order across the ranks (exact)"
    tol = net.exact_tolerance()
    if tol is not None:
        return f"MGRIT forward iterated to tolerance {tol:g} (exact up to it)"
    o = segs[0].fwd_opts
    warm = ", warm-started from training" if segs[0].warm_start else ""
    return (f"inexact MGRIT forward ({o.max_iter} cycle(s){warm}): not the serial network's "
            f"output")


class RefuseEmptyResume:
    """First callback of a job's fit (not of a ``--multilevel-init`` level, which resumes at a
    level's end to prolong it): a ``--resume`` with nothing left to train is refused before
    any output is written."""

    def on_fit_start(self, trainer, plan) -> None:
        if plan.resumed_from and plan.start_epoch >= plan.epochs:
            raise ValueError(f"--resume {plan.resumed_from} is at the end of epoch "
                             f"{plan.start_epoch} of the run's {plan.epochs}: nothing is left "
                             f"to train (--epochs counts from the start of the run): pass a "
                             f"larger --epochs to train more")
