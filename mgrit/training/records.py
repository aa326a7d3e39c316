"""The records the training loop hands to callbacks and returns (plain dataclasses, like
XBraid's status object): :class:`FitPlan` (``on_fit_start``), :class:`StepRecord`
(``on_after_backward``, ``on_step_end``), :class:`EpochRecord` (``on_epoch_end``) and
:class:`FitResult` (``on_fit_end``, returned by :meth:`Trainer.fit`)."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FitPlan", "StepRecord", "EpochRecord", "FitResult", "HISTORY_KEYS", "CALLBACK_HOOKS"]

#: Per-epoch metrics of :attr:`FitResult.history` (one list entry per epoch; the datasets of
#: ``metrics.h5``). MGRIT fields are ``None`` for serial networks.
HISTORY_KEYS = ("epoch", "loss", "train_acc", "test_acc", "test_loss", "epoch_time", "eval_time",
                "fwd_iters", "fwd_residual", "bwd_iters", "bwd_residual", "fwd_residual_mean",
                "bwd_residual_mean")

#: The callback methods the loop calls, each as ``hook(trainer, record)``.
CALLBACK_HOOKS = ("on_fit_start", "on_after_backward", "on_step_end", "on_epoch_end", "on_fit_end")


@dataclass
class FitPlan:
    """What :meth:`Trainer.fit` is about to do (given to ``on_fit_start``).

    Attributes:
        epochs, batch_size, seed: the arguments of ``fit``.
        n_train, n_test: samples in the training / test set (``n_test`` 0 without one).
        batches_per_epoch: global batches per epoch (the last one may be smaller; none dropped).
        parameters: trainable parameters of the whole network (all layer ranks).
        start_epoch, start_batch: where training starts (0-based; > 0 after a resume).
        initial_test_acc, initial_test_loss: test metrics before training (None without test).
        resumed_from: the checkpoint resumed from, or None. notes: what the resume changed.
        solvers: one line per MGRIT solver (levels, relaxation, mode); empty for serial nets.
    """

    epochs: int
    batch_size: int
    seed: int
    n_train: int
    n_test: int
    batches_per_epoch: int
    parameters: int
    start_epoch: int = 0
    start_batch: int = 0
    initial_test_acc: float | None = None
    initial_test_loss: float | None = None
    resumed_from: str | None = None
    notes: list = field(default_factory=list)
    solvers: list = field(default_factory=list)


@dataclass
class StepRecord:
    """One optimizer step of this replica.

    Attributes:
        step: 0-based index of the step (optimizer steps done before it).
        epoch, batch: 0-based epoch and batch index within it (None from :meth:`Trainer.step`).
        samples: this replica's samples in the step (0: an empty shard, no forward/backward).
        weight: this replica's weight in the gradient average (``samples / global batch``).
        loss: mean loss over this replica's samples (from the last layer rank; None until
            ``on_step_end``, and None for an empty shard).
        correct: correctly classified samples (argmax of a 2-D output vs integer targets;
            None for other outputs or until ``on_step_end``).
        lr: the learning rate of the step's update (the optimizer's first parameter group,
            read before ``optimizer.step()``; None with a training method).
        solves: ``[(forward, backward)]`` :class:`~mgrit.solver.MGRITResult` of the step's
            MGRIT solves, one pair per layer-parallel segment (empty for serial networks and
            empty shards). ``forward``/``backward``: the first segment's (None if none).
    """

    step: int
    epoch: int | None
    batch: int | None
    samples: int
    weight: float
    loss: float | None = None
    correct: int | None = None
    lr: float | None = None
    solves: list = field(default_factory=list)

    @property
    def forward(self):
        return self.solves[0][0] if self.solves else None

    @property
    def backward(self):
        return self.solves[0][1] if self.solves else None


@dataclass
class EpochRecord:
    """Metrics of one finished epoch (every field of :data:`HISTORY_KEYS`, plus
    ``unconverged``: MGRIT solves of the epoch that stopped at the cycle cap before the
    tolerance in exact mode, and ``warnings``: messages the loop issued). The MGRIT fields are
    those of the first segment: iterations and final residual of the epoch's last step and
    the mean final residual over its steps (this replica's)."""

    epoch: int
    loss: float
    train_acc: float | None
    test_acc: float | None
    test_loss: float | None
    epoch_time: float
    eval_time: float
    fwd_iters: int | None = None
    fwd_residual: float | None = None
    bwd_iters: int | None = None
    bwd_residual: float | None = None
    fwd_residual_mean: float | None = None
    bwd_residual_mean: float | None = None
    unconverged: int = 0
    warnings: list = field(default_factory=list)

    def metrics(self) -> dict:
        """The :data:`HISTORY_KEYS` fields as a dict."""
        return {k: getattr(self, k) for k in HISTORY_KEYS}


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` returns (and gives to ``on_fit_end``), identical on every rank.

    Attributes:
        history: per-epoch metrics, ``{key: [value per epoch]}`` for :data:`HISTORY_KEYS`
            (epochs before a resume included).
        final: ``loss``, ``train_acc``, ``test_acc``, ``test_loss`` of the last epoch and
            ``initial_test_acc``.
        steps: optimizer steps done in total (including those before a resume).
        plan: the :class:`FitPlan` of this fit.
        solver_stats: forward MGRIT counters of this rank (all solves), None for serial nets.
    """

    history: dict
    final: dict
    steps: int
    plan: FitPlan
    solver_stats: str | None = None
