"""The epoch loop of :class:`~mgrit.training.Trainer`: :meth:`FitLoop.fit` -- epochs over the
global batches of :mod:`mgrit.training.schedule`, evaluation before training and after every
epoch, checkpoints (per epoch and every ``checkpoint_every`` steps) and resuming from one, the
callbacks' fit and epoch hooks, the epoch records and the
:class:`~mgrit.training.records.FitResult`.

A mixin of :class:`~mgrit.training.Trainer` (it uses the trainer's ``net``, ``grid``,
``method``, ``callbacks``, ``_step``, ``_evaluate``, ``save`` and ``load``); one step and the
evaluation live in :mod:`mgrit.training.trainer`.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from mpi4py import MPI

from .epoch import EpochAccumulator, UnconvergedWarning
from .support import interrupts
from .support.faults import phase
from .records import HISTORY_KEYS, FitPlan, FitResult
from .schedule import as_tensors, batches_per_epoch, epoch_batches, fingerprint

if TYPE_CHECKING:  # annotations only
    from data import Split

__all__ = ["FitLoop"]


def _positive_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{name}={v!r} is not allowed: use an int >= {minimum}")
    return int(v)


def _hyperparameters(optimizer) -> list:
    """Per parameter group, its hyper-parameters (everything but ``params``)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _plain(v):
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


def _take_hyperparameters(optimizer, asked: list) -> list:
    """After loading a checkpoint into ``optimizer``: put back the hyper-parameters the
    optimizer was built with (``asked``, from :func:`_hyperparameters` before loading) where
    the checkpoint's differ, so a resume with another ``lr``, ``momentum``, ... trains with
    them. ``lr`` is compared with the checkpoint's base rate (``initial_lr``, set by a
    scheduler; else ``lr``): an unchanged base keeps the checkpoint's current (scheduled)
    rate. Returns the resume note naming the changes (empty: none)."""
    changed = {}
    for g, want in zip(optimizer.param_groups, asked):
        for k, v in want.items():
            if k == "initial_lr":
                continue
            have = g.get("initial_lr", g.get("lr")) if k == "lr" else g.get(k)
            if _plain(have) == _plain(v):
                continue
            changed.setdefault(k, (have, v))
            g[k] = v
            if k == "lr" and "initial_lr" in g:  # a new base rate for the schedule
                g["initial_lr"] = want.get("initial_lr", v)
    if not changed:
        return []
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    return [f"this run's optimizer settings replace the checkpoint's: {what}"]


class FitLoop:
    """:meth:`fit` and its checkpoint/resume helpers (mixed into
    :class:`~mgrit.training.Trainer`)."""

    def fit(self, train: Split | Sequence[np.ndarray | torch.Tensor], *, epochs: int,
            batch_size: int, seed: int = 0,
            test: Split | Sequence[np.ndarray | torch.Tensor] | None = None,
            resume: str | os.PathLike | None = None) -> FitResult:
        """Train for ``epochs`` epochs over ``train`` (a :class:`data.Split` or ``(x, y)``:
        inputs ``(n, *in_shape)`` converted to the network's dtype, targets ``(n,)``, e.g.
        int64 labels; the same on every rank) in global batches of ``batch_size`` drawn with
        ``seed`` (see
        :mod:`mgrit.training.schedule`; every sample of every epoch is used), evaluating on
        ``test`` before training and after every epoch. ``resume``: a checkpoint to continue
        from (its data, batch size and seed must equal these; any grid; ``epochs`` counts
        from the start of the run: fewer than the checkpoint's finished epochs is refused,
        equal trains nothing, said in a ``UserWarning`` and the notes). On a
        resume the optimizer's hyper-parameters as built replace the checkpoint's and the
        callback states are restored by key; what changed is in ``plan.notes`` (see
        ``docs/features/resume.rst``). Collective.

        Raises:
            ValueError: bad arguments (every rank, before communicating), a checkpoint that
                does not match, a resume past ``epochs``; exceptions of the network, loss
                and callbacks propagate.
            KeyboardInterrupt: Ctrl-C, at the same step boundary on every rank where
                :func:`mgrit.training.support.interrupts.install` is in effect (the main job).
        """
        with interrupts.deferred(self.grid.comm):  # Ctrl-C: every rank at one step boundary
            return self._fit(train, epochs=epochs, batch_size=batch_size, seed=seed, test=test,
                             resume=resume)

    def _fit(self, train, *, epochs, batch_size, seed, test, resume) -> FitResult:
        epochs = _positive_int("epochs", epochs)
        batch_size = _positive_int("batch_size", batch_size)
        seed = _positive_int("seed", seed, 0)
        x, y = as_tensors(train, self._dtype, "train")
        tx, ty = (None, None) if test is None else as_tensors(test, self._dtype, "test")
        n, nb = len(y), batches_per_epoch(len(y), batch_size)
        expect = {"training data": fingerprint(x, y), "batch size": batch_size, "seed": seed}
        self.history = hist = {k: [] for k in HISTORY_KEYS}
        if resume is not None:
            start_epoch, start_batch, acc_state, notes, initial = self._resume(resume, expect)
            if start_epoch > epochs:  # the same on every rank (the checkpoint's position)
                raise ValueError(
                    f"resume={os.fspath(resume)!r} is at the end of epoch {start_epoch} "
                    f"(step {self.steps_done}), past fit(epochs={epochs}) (epochs counts from "
                    f"the start of the run, not from the checkpoint): pass epochs > "
                    f"{start_epoch} to train more")
            if start_epoch == epochs:  # e.g. a multilevel schedule resumed at a level's end
                notes.append(f"nothing left to train: the checkpoint is at the end of epoch "
                             f"{start_epoch} = epochs (pass epochs > {start_epoch} to train "
                             f"more)")
                if self.is_root:
                    warnings.warn(f"fit(epochs={epochs}, resume={os.fspath(resume)!r}) trains "
                                  f"nothing: the checkpoint is at the end of epoch "
                                  f"{start_epoch}; pass epochs > {start_epoch} to train more",
                                  UserWarning, stacklevel=2)
        else:
            start_epoch = start_batch = 0
            acc_state, notes = None, []
            initial = (None, None) if tx is None else self._evaluate(tx, ty)
        n_params = sum(p.numel() for p in self.net.parameters())
        plan = FitPlan(epochs=epochs, batch_size=batch_size, seed=seed, n_train=n,
                       n_test=0 if ty is None else len(ty), batches_per_epoch=nb,
                       parameters=int(self.grid.layer_comm.allreduce(n_params)),
                       start_epoch=start_epoch, start_batch=start_batch,
                       initial_test_acc=initial[0], initial_test_loss=initial[1],
                       resumed_from=None if resume is None else os.fspath(resume), notes=notes,
                       solvers=self.net.describe_solvers())
        self.plan = plan
        self._call("on_fit_start", plan)
        tol = self.net.exact_tolerance()
        for epoch in range(start_epoch, epochs):
            self.net.train()
            acc = EpochAccumulator(acc_state if epoch == start_epoch else None)
            t0 = time.perf_counter()
            batches = epoch_batches(n, batch_size, seed, epoch, self.grid.data_rank,
                                    self.grid.data_size)
            first = start_batch if epoch == start_epoch else 0  # > 0: resumed mid-epoch
            xe = x
            if self.method is not None:
                self.method.begin_epoch(epoch, epochs, [len(i) for i, _ in batches[first:]])
                xe = self.method.inputs(x)
            for b, (idx, glen) in enumerate(batches):
                if b < first:
                    continue  # done before the checkpoint we resumed from
                self.position = (epoch, b)
                with phase("data loading"):
                    j = torch.as_tensor(idx)
                    xb, yb = xe[j], y[j]
                    if self._device.type != "cpu":
                        xb, yb = xb.to(self._device), yb.to(self._device)
                rec = self._step(xb, yb, len(idx) / glen, epoch, b)
                if rec.loss is not None:  # (a method's ranks without the output: nothing)
                    acc.add(rec, tol is not None)
                if self.checkpoint and self.checkpoint_every \
                        and self.steps_done % self.checkpoint_every == 0:
                    self._save_fit(epoch, b + 1, acc, hist, expect, initial)
                interrupts.check(self.grid.comm)
            if self.method is not None:
                self.method.end_epoch()
            t_epoch = time.perf_counter() - t0
            tot = self.net.from_last(self.grid.data_comm.allreduce(acc.totals()))
            t1 = time.perf_counter()
            test_acc, test_loss = (None, None) if tx is None else self._evaluate(tx, ty)
            t_eval = time.perf_counter() - t1
            t_epoch = self.grid.comm.allreduce(t_epoch, op=MPI.MAX)  # the slowest rank's
            rec = acc.record(epoch + 1, tot, test_acc, test_loss, t_epoch, t_eval, tol)
            if rec.warnings and self.is_root:
                for w in rec.warnings:
                    warnings.warn(w, UnconvergedWarning, stacklevel=2)
            for k, v in rec.metrics().items():
                hist[k].append(v)
            self._call("on_epoch_end", rec)
            self.net.check_tied_replicas()  # weight-tied layers across ranks: still identical
            if self.checkpoint:
                self._save_fit(epoch + 1, 0, EpochAccumulator(), hist, expect, initial)
            interrupts.check(self.grid.comm)
        final = {k: hist[k][-1] for k in ("loss", "train_acc", "test_acc", "test_loss")}
        final["initial_test_acc"] = initial[0]
        result = FitResult(history=hist, final=final, steps=self.steps_done, plan=plan,
                           solver_stats=self.net.solver_summary())
        self._call("on_fit_end", result)
        return result

    def _resume(self, path, expect: dict) -> tuple:
        """Load ``path`` for :meth:`fit`: ``(start epoch, start batch, this replica's epoch
        accumulator state, notes, initial test metrics)``; the history goes to
        :attr:`history`."""
        asked = _hyperparameters(self.optimizer) if self.method is None else []
        with phase("checkpoint"):
            loaded = self.load(path, expect=expect)
        loaded.notes.extend(_take_hyperparameters(self.optimizer, asked))
        extra = loaded.extra
        for k in self.history:
            self.history[k].extend(extra["history"].get(k, []))
        pos = extra["position"]
        self.saved_at = (int(pos[0]), int(pos[1]))
        return (int(pos[0]), int(pos[1]), EpochAccumulator.state_for(extra["accum"], self.grid),
                list(loaded.notes), tuple(extra["initial"]))

    def _save_fit(self, epoch, batch, acc, hist, expect, initial) -> None:
        accum = self.net.from_last(self.grid.data_comm.allgather(acc.state()))
        self.save(self.checkpoint, {"position": [epoch, batch], "history": hist,
                                    "accum": accum, "initial": list(initial), **expect})
        self.saved_at = (epoch, batch)

