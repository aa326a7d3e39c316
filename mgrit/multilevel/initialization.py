"""Coarse-to-fine training in depth for the main job (``--multilevel-init L``): the nested
iteration in depth of Cyr, Guenther & Schroder 2019 ("Multilevel initialization for
layer-parallel deep neural network training", arXiv 1912.08974).

Schedule (:func:`depth_schedule`, :func:`epoch_schedule`): train the network with
``N / 2^(L-1)`` residual layers at step ``h = 2^(L-1) T / N`` for ``--init-epochs`` epochs,
prolong its weights in depth to twice the layers at half the step
(:func:`mgrit.nn.depth.transfer_weights`, ``--prolong constant`` or ``linear``; the opening
and closing layers are copied), continue, ... and train the final ``N`` layers for
``--epochs`` epochs. ``L = 1`` is ordinary training at depth ``N`` through the same code (the
same numbers as without the flag), with the extra columns below. Every level is one
:class:`~mgrit.training.Trainer` fit with a fresh optimizer (momentum or Adam moments are not
prolonged), the same data order (``--seed``; epoch ``e`` of every level draws the batches of
epoch ``e``), the same run directory, and the job's callbacks; the network at each depth is
built by the job's model builder (``--method mgrit``: layer-parallel with the job's MGRIT
options; every depth needs at least one layer per layer rank).

Output: one history across the levels (:class:`LevelHistory`): ``metrics.h5`` holds every
epoch of every level in order, with the columns of the training loop plus ``depth``,
``level``, ``cpu_time`` (CPU seconds of this process in the epoch's training steps:
``time.process_time``, robust on a loaded machine where wall time is not; under MPI it includes
busy-waiting for messages) and the cumulative ``train_time`` / ``train_cpu_time`` (training
epochs of all levels so far plus the prolongations; evaluation excluded); ``summary.json`` adds
``levels`` (per level: depth, epochs, test accuracy right after the prolongation, at the end,
wall and CPU seconds).

Checkpoints (``--checkpoint-every``): the same ``RUN/checkpoint.pt`` throughout; the level and
the history of the finished levels are saved with it (the callback state of
:class:`LevelHistory`), so ``--resume`` continues inside the schedule: at the saved level,
epoch and batch, then the remaining levels. A checkpoint written at the end of a level resumes
with that level's prolongation. Clocks after a resume count the resumed process only.

Depends on torch, :mod:`mgrit.nn.depth` and the training loop's records and metrics writer.
"""
from __future__ import annotations

import dataclasses
import time

from ..nn.depth import PROLONGATIONS, transfer_weights
from ..training.checkpoint.io import read_file
from ..training.support.faults import phase
from ..training.metrics import MetricsWriter, write_metrics
from ..training.records import HISTORY_KEYS

__all__ = ["depth_schedule", "epoch_schedule", "LevelHistory", "MultilevelMetricsWriter",
           "resume_level", "run_schedule", "FACTOR", "LEVEL_KEYS"]

#: Refinement factor between consecutive depths (Cyr et al.: twice the layers, half the step).
FACTOR = 2
#: Columns added to the training loop's :data:`~mgrit.training.records.HISTORY_KEYS`.
LEVEL_KEYS = ("depth", "level", "cpu_time", "train_time", "train_cpu_time")


def depth_schedule(layers: int, levels: int, factor: int = FACTOR) -> list[int]:
    """Depths ``[N / f^(L-1), ..., N / f, N]`` of an ``L``-level schedule.

    Raises:
        ValueError: ``levels < 1``, or ``N`` not divisible by ``f^(L-1)`` (naming the flags
            and the allowed level counts).
    """
    for name, v, low in (("--multilevel-init", levels, 1), ("--layers", layers, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r} is not allowed: use an int >= {low}")
    if layers % factor ** (levels - 1):
        ok = [k for k in range(1, levels + 1) if layers % factor ** (k - 1) == 0]
        raise ValueError(f"--multilevel-init {levels} needs --layers divisible by "
                         f"{factor}^{levels - 1} = {factor ** (levels - 1)} (depths N/{factor}^k); "
                         f"--layers {layers} allows --multilevel-init {ok[-1]} at most")
    return [layers // factor ** (levels - 1 - k) for k in range(levels)]


def epoch_schedule(init_epochs, levels: int, epochs: int) -> list[int]:
    """Epochs per level: ``init_epochs`` for the coarse levels (an int, or a comma-separated
    string / list coarsest first, the last entry repeated), ``epochs`` at the final depth.

    Raises:
        ValueError: entries that are not ints >= 1, or more entries than coarse levels.
    """
    if isinstance(init_epochs, str):
        parts = [s.strip() for s in init_epochs.split(",")]
        try:
            values = [int(s) for s in parts]
        except ValueError:
            raise ValueError(f"--init-epochs={init_epochs!r} is not allowed: use an int or "
                             f"comma-separated ints (epochs per coarse depth, coarsest "
                             f"first)") from None
    elif isinstance(init_epochs, int) and not isinstance(init_epochs, bool):
        values = [init_epochs]
    else:
        values = list(init_epochs)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"--init-epochs={init_epochs!r} is not allowed: use ints >= 1")
    if len(values) > max(levels - 1, 1):
        raise ValueError(f"--init-epochs={init_epochs!r} has {len(values)} entries for "
                         f"{levels - 1} coarse level(s) of --multilevel-init {levels}")
    coarse = [values[min(k, len(values) - 1)] for k in range(levels - 1)]
    return coarse + [int(epochs)]


class LevelHistory:
    """Training-loop callback joining the fits of a schedule into one history.

    Args:
        depths, epochs: the schedule (:func:`depth_schedule`, :func:`epoch_schedule`).
        prolong: the prolongation method (recorded).

    Use: :meth:`begin` before each level's fit (with the seconds its prolongation took), then
    the fit with this object among the callbacks, *before* the metrics writer (its hooks must
    run first); :meth:`combined` gives the history so far. Its state (level, finished levels'
    rows, clocks) goes into the trainer's checkpoints.
    """

    def __init__(self, depths, epochs, prolong: str = "constant"):
        self.depths, self.epochs, self.prolong = list(depths), list(epochs), prolong
        self.level = 0
        self.past = {k: [] for k in (*HISTORY_KEYS, *LEVEL_KEYS)}
        self.levels: list = []
        self.cpu: list = []  # CPU seconds per finished epoch of the current level
        self.offset = [0.0, 0.0]  # cumulative (wall, cpu) seconds before the current level
        self._cpu0 = self._cpu_last = None
        self._done = False  # the current level's rows are in ``past`` already
        self.writer = None  # the run's MultilevelMetricsWriter (kept here: one for all levels)

    # -- schedule --------------------------------------------------------------------------
    def begin(self, level: int, prolong_s: float = 0.0, prolong_cpu_s: float = 0.0) -> None:
        """Start ``level`` (after the prolongation that took ``prolong_s`` wall and
        ``prolong_cpu_s`` CPU seconds)."""
        self.level, self.cpu, self._done = level, [], False
        self.offset[0] += prolong_s
        self.offset[1] += prolong_cpu_s
        self.levels.append({"level": level, "depth": self.depths[level],
                            "epochs": self.epochs[level], "prolong_s": prolong_s})

    def finish(self, history: dict, initial_test_acc) -> None:
        """Move the finished level's rows (the trainer's ``history``) into :attr:`past` and
        complete its entry of :attr:`levels` (called by :meth:`on_fit_end`)."""
        if self._done:
            return
        rows = self.combined(history)
        n_past = len(self.past["epoch"])
        for k in self.past:
            self.past[k] = rows[k]
        mine = {k: rows[k][n_past:] for k in ("epoch_time", "cpu_time", "test_acc")}
        self.levels[-1].update(
            initial_test_acc=initial_test_acc,
            final_test_acc=mine["test_acc"][-1] if mine["test_acc"] else None,
            train_s=float(sum(t or 0.0 for t in mine["epoch_time"])),
            train_cpu_s=float(sum(t or 0.0 for t in mine["cpu_time"])))
        self.offset = [rows["train_time"][-1], rows["train_cpu_time"][-1]] if rows["epoch"] \
            else self.offset
        self.cpu, self._done = [], True

    def combined(self, history: dict) -> dict:
        """The finished levels' rows followed by the current level's (``history``: the
        trainer's, per epoch of this level), epochs numbered across levels."""
        out = {k: list(v) for k, v in self.past.items()}
        if self._done:
            return out
        n0 = len(out["epoch"])
        wall, cpu = self.offset
        for i in range(len(history.get("epoch", []))):
            for k in HISTORY_KEYS:
                out[k].append(history[k][i])
            out["epoch"][-1] = n0 + i + 1
            c = self.cpu[i] if i < len(self.cpu) else None
            wall += history["epoch_time"][i] or 0.0
            cpu += c or 0.0
            out["depth"].append(self.depths[self.level])
            out["level"].append(self.level)
            out["cpu_time"].append(c)
            out["train_time"].append(wall)
            out["train_cpu_time"].append(cpu)
        return out

    # -- callback hooks ----------------------------------------------------------------------
    def on_fit_start(self, trainer, plan) -> None:
        self._cpu0 = self._cpu_last = time.process_time()

    def on_step_end(self, trainer, record) -> None:
        self._cpu_last = time.process_time()

    def on_epoch_end(self, trainer, record) -> None:
        now = time.process_time()  # after the evaluation: the next epoch's steps start here
        self.cpu.append(self._cpu_last - self._cpu0)
        self._cpu0 = self._cpu_last = now

    def on_fit_end(self, trainer, result) -> None:
        self.finish(result.history, result.final.get("initial_test_acc"))

    def state_dict(self) -> dict:
        return {"depths": list(self.depths), "epochs": list(self.epochs), "level": self.level,
                "past": {k: list(v) for k, v in self.past.items()},
                "levels": [dict(x) for x in self.levels], "cpu": list(self.cpu),
                "offset": list(self.offset)}

    def load_state_dict(self, state: dict) -> None:
        self.level = int(state["level"])
        self.past = {k: list(v) for k, v in state["past"].items()}
        self.levels = [dict(x) for x in state["levels"]]
        self.cpu, self.offset = list(state["cpu"]), list(state["offset"])


class MultilevelMetricsWriter(MetricsWriter):
    """:class:`~mgrit.training.MetricsWriter` of a schedule: writes :meth:`LevelHistory.combined`
    (all levels) instead of the current fit's history, keeps one start time over all fits, and
    adds ``levels`` and ``schedule`` to ``summary.json``. Use the same object for every level.

    Args:
        levels: the :class:`LevelHistory`; the other arguments as ``MetricsWriter``.
    """

    def __init__(self, run, config=None, title: str = "", extra=None, *,
                 levels: LevelHistory):
        super().__init__(run, config, title, extra)
        self.levels_cb = levels

    def on_fit_start(self, trainer, plan) -> None:
        t0 = self._t0
        super().on_fit_start(trainer, plan)
        self.config["parameters"] = plan.parameters  # the last level's (the final depth)
        if t0 is not None:  # a later level: the run's clock keeps going
            self._t0 = t0

    def on_epoch_end(self, trainer, record) -> None:
        if trainer.is_root:
            write_metrics(self.run, self.levels_cb.combined(trainer.history), self.config)

    def on_fit_end(self, trainer, result) -> None:
        lv = self.levels_cb
        self.extra["schedule"] = {"depths": lv.depths, "epochs": lv.epochs,
                                  "prolong": lv.prolong, "factor": FACTOR}
        self.extra["levels"] = lv.levels
        super().on_fit_end(trainer, dataclasses.replace(
            result, history=lv.combined(result.history)))


def resume_level(path, comm, depths, epochs) -> int:
    """The level a ``--resume`` checkpoint of a schedule was written at (read on rank 0 of
    ``comm``, agreed on every rank).

    Raises:
        ValueError: the file is missing or unreadable, was not written by a
            ``--multilevel-init`` run, or by one with another schedule (every rank).
    """
    found = None
    if comm.Get_rank() == 0:
        ckpt, error = read_file(str(path))
        if error is not None:
            found = ("error", error[1])
        else:
            states = ckpt["ranks"][0]["extra"].get("callbacks", {})
            state = next((v for k, v in states.items()  # (before issue 40: "0:LevelHistory")
                          if k == "LevelHistory" or k.endswith(":LevelHistory")), None)
            if state is None:
                found = ("error", f"checkpoint {str(path)!r} was not written by a "
                                  f"--multilevel-init run: resume it without --multilevel-init")
            elif list(state["depths"]) != list(depths) or list(state["epochs"]) != list(epochs):
                found = ("error", f"checkpoint {str(path)!r} belongs to the schedule depths "
                                  f"{state['depths']} / epochs {state['epochs']}, this run has "
                                  f"depths {depths} / epochs {epochs}: use the same --layers, "
                                  f"--multilevel-init, --init-epochs and --epochs")
            else:
                found = ("ok", int(state["level"]))
    found = comm.bcast(found, root=0)
    if found[0] == "error":
        raise ValueError(found[1])
    return found[1]


def run_schedule(c, grid, build, make_trainer, fit) -> dict:
    """Train ``c``'s schedule (validated ``JobConfig`` with ``multilevel_init >= 1``).

    Args:
        grid: the job's :class:`~mgrit.parallel.ProcessGrid`.
        build: ``build(config) -> network`` at ``config.layers`` (the job's model builder).
        make_trainer: ``make_trainer(config, network, levels) -> Trainer`` (the job's optimizer
            and callbacks; with ``levels`` the metrics writer must be a
            :class:`MultilevelMetricsWriter` and ``levels`` a callback before it).
        fit: ``fit(trainer, config, resume) -> FitResult`` (``trainer.fit`` with the job's data).

    Returns:
        the final level's ``FitResult.final``.
    """
    if c.prolong not in PROLONGATIONS:
        raise ValueError(f"--prolong={c.prolong!r} is not allowed: use one of {PROLONGATIONS}")
    depths = depth_schedule(c.layers, c.multilevel_init)
    epochs = epoch_schedule(c.init_epochs, c.multilevel_init, c.epochs)
    with phase("checkpoint"):
        start = resume_level(c.resume, grid.comm, depths, epochs) if c.resume else 0
    levels = LevelHistory(depths, epochs, c.prolong)
    prev, result, timing = None, None, (0.0, 0.0)
    for level in range(start, len(depths)):
        cl = dataclasses.replace(c, layers=depths[level], epochs=epochs[level])
        with phase("model setup"):
            net = build(cl)
        if prev is not None:
            grid.comm.Barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            with phase("prolongation in depth", hint="the weights could not be prolonged to "
                       "the next depth: check --layers, --multilevel-init and --prolong"):
                transfer_weights(prev, net, c.prolong)
            timing = (time.perf_counter() - t0, time.process_time() - c0)
        levels.begin(level, *timing)
        trainer = make_trainer(cl, net, levels)
        if trainer.is_root:
            how = (f"prolonged ({c.prolong}) from N={depths[level - 1]}" if prev is not None
                   else ("resumed" if level == start and c.resume else "from scratch"))
            print(f"[train] multilevel level {level + 1}/{len(depths)}: N={depths[level]} "
                  f"(h={c.T / depths[level]:g}), {epochs[level]} epoch(s), {how}", flush=True)
        result = fit(trainer, cl, c.resume if level == start else None)
        prev = net
    return result.final
