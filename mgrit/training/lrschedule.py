"""Learning-rate schedules of the training loop: :func:`make_scheduler` (``torch.optim.
lr_scheduler`` objects: linear warm-up, then cosine annealing or step decay) and the
:class:`LRSchedule` callback that steps it in :class:`~mgrit.training.Trainer` and saves its
state in checkpoints, so ``--resume`` continues the exact learning-rate sequence.

The schedule is stepped **once per optimizer step** (batch), and lengths given in epochs are
counted in optimizer steps (``epochs x batches per epoch``); so ``step`` decays after every
``step_epochs`` full epochs exactly as ``StepLR(step_size=step_epochs)`` stepped per epoch
would, while cosine and the warm-up change the rate smoothly within an epoch (the usual choice,
e.g. timm's ``t_in_epochs=False``).

* ``none``: the constant ``lr`` (after the warm-up, if any).
* ``cosine``: ``CosineAnnealingLR(T_max = (epochs - warmup) x batches, eta_min = 0)``.
* ``step``: ``StepLR(step_size = step_epochs x batches, gamma)``.
* warm-up (``warmup_epochs > 0``): ``LinearLR(start_factor = 1 / warmup steps, end_factor =
  1)`` over the first ``warmup_epochs x batches`` steps, joined to the above with
  ``SequentialLR``; the step decay counts from the end of the warm-up.
"""
from __future__ import annotations

import math
import warnings

import torch
from torch.optim import lr_scheduler as sched

__all__ = ["SCHEDULES", "make_scheduler", "LRSchedule"]

#: ``--lr-schedule`` choices.
SCHEDULES = ("none", "cosine", "step")


def _check(kind, epochs, batches, warmup_epochs, step_epochs, gamma) -> None:
    if kind not in SCHEDULES:
        raise ValueError(f"lr schedule {kind!r} is not allowed: use one of {list(SCHEDULES)}")
    for name, v, low in (("epochs", epochs, 1), ("batches per epoch", batches, 1),
                         ("warmup_epochs", warmup_epochs, 0), ("step_epochs", step_epochs, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r} is not allowed: use an int >= {low}")
    if warmup_epochs >= epochs and (kind != "none" or warmup_epochs > epochs):
        raise ValueError(f"warmup_epochs={warmup_epochs} leaves no epoch of the {kind} schedule "
                         f"(epochs={epochs}): use fewer warm-up epochs")
    if not (isinstance(gamma, (int, float)) and math.isfinite(gamma) and 0 < gamma <= 1):
        raise ValueError(f"gamma={gamma!r} is not allowed: use a number in (0, 1]")


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str, *, epochs: int, batches: int,
                   warmup_epochs: int = 0, step_epochs: int = 1, gamma: float = 0.1):
    """The ``torch.optim.lr_scheduler`` of ``kind`` (see the module docstring) for a run of
    ``epochs`` epochs of ``batches`` optimizer steps each, to be stepped after every optimizer
    step; ``None`` for ``"none"`` without warm-up. Creating it sets the optimizer's rate to the
    first step's (as every torch scheduler does).

    Raises:
        ValueError: an unknown kind, non-int or too small lengths, a warm-up as long as the
            run (cosine, step), ``gamma`` outside ``(0, 1]``.
    """
    _check(kind, epochs, batches, warmup_epochs, step_epochs, gamma)
    warm = warmup_epochs * batches
    if kind == "none" and not warm:
        return None
    main = None
    if kind == "cosine":
        main = sched.CosineAnnealingLR(optimizer, T_max=(epochs - warmup_epochs) * batches)
    elif kind == "step":
        main = sched.StepLR(optimizer, step_size=step_epochs * batches, gamma=gamma)
    if not warm:
        return main
    ramp = sched.LinearLR(optimizer, start_factor=1.0 / warm, end_factor=1.0, total_iters=warm)
    if main is None:
        return ramp  # after warm steps LinearLR keeps the full rate
    return sched.SequentialLR(optimizer, [ramp, main], milestones=[warm])


def _legacy(pending: dict, setting: dict) -> dict | None:
    """The schedule of a checkpoint written before the setting was saved, as far as its torch
    scheduler state tells (base rates; the cosine's length); the rest assumed unchanged."""
    state = pending.get("scheduler")
    if not state:
        return None
    subs = state.get("_schedulers") or [state]  # SequentialLR: warm-up, then the main one
    old = dict(setting, base_lrs=[float(b) for b in subs[0].get("base_lrs", setting["base_lrs"])])
    if setting["kind"] == "cosine" and "T_max" in subs[-1]:
        old["epochs"] = int(subs[-1]["T_max"]) // setting["batches"] + setting["warmup_epochs"]
    return old


class LRSchedule:
    """Trainer callback: builds :func:`make_scheduler` for the trainer's optimizer when the fit
    starts (it needs the number of batches per epoch), steps it after every optimizer step,
    and saves / restores its state and the optimizer's current rates with the checkpoint
    (exact ``--resume``). The rates it gave every step so far are in :attr:`lrs` (first
    parameter group).

    A resume whose schedule differs from the checkpoint's -- other ``epochs`` (extending or
    shortening the run), ``kind``, warm-up, step length, ``gamma`` or base rate (the
    optimizer's ``lr``) -- **re-plans** it: from the resumed step on, the rates are those of
    the new schedule at that step, as if the run had been planned with the new settings from
    its start (e.g. 2 cosine epochs extended to 4: cosine over the 4 epochs' steps, so the rate
    at the end of epoch 2 is half the base rate, not 0, and reaches 0 at the end of epoch 4).
    The re-plan is added to the fit's resume notes (``plan.notes``, printed by
    :class:`~mgrit.training.ConsoleLog` when it comes after this callback). A resume with
    this callback but no saved state (the run had none) re-plans as well.

    Args:
        kind, warmup_epochs, step_epochs, gamma: as :func:`make_scheduler` (checked at
            construction with a placeholder length).
    """

    def __init__(self, kind: str = "none", warmup_epochs: int = 0, step_epochs: int = 1,
                 gamma: float = 0.1):
        _check(kind, max(warmup_epochs + 1, 1), 1, warmup_epochs, step_epochs, gamma)
        self.kind, self.warmup_epochs = kind, warmup_epochs
        self.step_epochs, self.gamma = step_epochs, gamma
        self.scheduler, self._optimizer = None, None
        self.setting: dict | None = None  # the schedule being followed (saved, compared)
        self._pending = None
        self.lrs: list = []

    def on_fit_start(self, trainer, plan) -> None:
        opt = self._optimizer = trainer.optimizer
        base = [float(g.get("initial_lr", g["lr"])) for g in opt.param_groups]
        self.setting = {"kind": self.kind,  # (only the cosine's length depends on epochs)
                        "epochs": plan.epochs if self.kind == "cosine" else None,
                        "batches": plan.batches_per_epoch, "warmup_epochs": self.warmup_epochs,
                        "step_epochs": self.step_epochs, "gamma": float(self.gamma),
                        "base_lrs": base}
        pending, self._pending = self._pending, None
        saved = None if pending is None else pending.get("setting", _legacy(pending, self.setting))
        if pending is not None and (saved is None or saved == self.setting):
            # resumed with the same schedule (or from a checkpoint that did not record it):
            # the saved position and rates, exactly
            self.scheduler = self._build(opt, plan)
            if self.scheduler is not None and pending["scheduler"] is not None:
                self.scheduler.load_state_dict(pending["scheduler"])
            for group, lr in zip(opt.param_groups, pending["lrs"]):
                group["lr"] = lr
            self.lrs = list(pending["history"])
            return
        done = len(pending["history"]) if pending is not None else trainer.steps_done
        if pending is not None:
            self.lrs = list(pending["history"])
        if not done:  # a fresh fit
            self.scheduler = self._build(opt, plan)
            return
        was = float(pending["lrs"][0] if pending is not None and pending["lrs"]
                    else opt.param_groups[0]["lr"])
        for g, b in zip(opt.param_groups, base):  # the new schedule from its start ...
            g["lr"] = b
            g.pop("initial_lr", None)
        self.scheduler = self._build(opt, plan)
        if self.scheduler is not None:
            with warnings.catch_warnings():  # ("lr_scheduler.step() before optimizer.step()")
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(done):  # ... advanced to the resumed step
                    self.scheduler.step()
        constant = (lambda d: d is None or (d["kind"] == "none" and not d["warmup_epochs"]))
        if self.scheduler is None and constant(saved):
            return  # a constant rate before and now (a changed lr is the optimizer's note)
        if saved is None:
            why = "the checkpoint has no schedule state"
        else:
            why = ", ".join(f"{k} {'-' if saved.get(k) is None else saved.get(k)} -> "
                            f"{'-' if v is None else v}" for k, v in self.setting.items()
                            if saved.get(k) != v)
        plan.notes.append(
            f"learning-rate schedule re-planned ({why}): {self.kind} over {plan.epochs} "
            f"epoch(s) x {plan.batches_per_epoch} batches, warm-up {self.warmup_epochs} "
            f"epoch(s), base rate {base[0]:g}; step {done} continues at the new schedule's "
            f"rate {opt.param_groups[0]['lr']:.4g} (the checkpoint's rate was {was:.4g})")

    def _build(self, opt, plan):
        return make_scheduler(opt, self.kind, epochs=plan.epochs, batches=plan.batches_per_epoch,
                              warmup_epochs=self.warmup_epochs, step_epochs=self.step_epochs,
                              gamma=self.gamma)

    def on_step_end(self, trainer, record) -> None:
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])  # the rate this step used
        if self.scheduler is not None:
            self.scheduler.step()

    def state_dict(self) -> dict:
        opt_lrs = [] if self._optimizer is None else [
            float(g["lr"]) for g in self._optimizer.param_groups]
        return {"scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "lrs": opt_lrs, "history": [float(v) for v in self.lrs],
                "setting": None if self.setting is None else dict(self.setting)}

    def load_state_dict(self, state: dict) -> None:
        self._pending = state
