"""Recurrent networks of the main job: ``--model gru``, a GRU sequence classifier (or regressor)
parallel in time, and the long synthetic sequence task ``--dataset adding``.

``--model gru``: the input is read as a sequence -- a single-channel image ``(1, H, W)`` row by
row (``H`` time steps of ``W`` features: row-by-row MNIST is 28 steps of 28 pixels,
:func:`mgrit.nn.gru.classifier.image_rows`), a sequence set ``(T, F)`` as it is -- into a
one-layer GRU of ``--hidden`` units, then a linear head on the final hidden state (Moon & Cyr,
"Parallel training of GRU networks with a multi-grid solver for long sequences", ICLR 2022).

* ``--method mgrit``: :class:`GRUNet`, a :class:`~mgrit.nn.gru.classifier.GRUSequenceClassifier`
  whose :class:`~mgrit.nn.gru.ParallelGRU` is solved by MGRIT over the time steps, distributed
  over the layer ranks (here: time ranks), forward and adjoint. Its MGRIT options are the main
  job's (:func:`mgrit.models.mgrit_options`: ``--levels``, ``--cfactor``, ``--relax``,
  ``--fwd-iters``, ``--bwd-iters``, ``--tol``). Evaluation forwards (``eval()`` mode, no grad)
  in inexact mode iterate to the relative tolerance ``--gru-eval-rtol`` (FCF, at most 50
  cycles) instead of the training's fixed cycles: trained GRUs converge slowly under MGRIT
  (about 5x per FCF cycle, see :mod:`mgrit.nn.gru`), and a test accuracy should measure the
  network, not the solver.
* ``--method serial``: :class:`SerialGRUNet`, PyTorch's fused ``nn.GRU`` (the strongest serial
  baseline) with the same parameter names, initial weights (same seed) and head, so the
  checkpoints of both load into each other.

Recommended MGRIT flags for row-MNIST (28 steps) on 2 time ranks: ``--levels 2 --cfactor 4
--relax FCF --fwd-iters 3 --bwd-iters 2``. Why (``experiments/results/studies/gru/``, ``sweep.md``):
as training proceeds the GRU's MGRIT convergence slows (with 2 forward / 1 adjoint cycles the
mean final forward residual of the training steps grows 7-20x over 10 epochs), the biased
gradients leave the training loss behind serial's, and one of three seeds ended 1.9 points
below serial; 3/2 cycles keep the residual 14-19x lower and every seed within a point.
F-relaxation on the fine level (the job's ResNet default ``--relax F,FCF``) is worse still and
warns.

``--dataset adding``: the adding problem (:func:`data.sequences.make_adding_problem`;
Hochreiter & Schmidhuber 1997), ``--seq-len`` steps of 2 features, ``--limit-train`` (default
:data:`ADDING_TRAIN`) training and ``--limit-test`` (default :data:`ADDING_TEST`) test
sequences generated from ``--seed`` (streams 0 and 1). It is a regression: one output, mean
squared error loss (:func:`regression_loss`), no accuracy (``NaN`` in the metrics); the constant
prediction 1 scores MSE 1/6.

Depends on torch, mpi4py, :mod:`mgrit.nn` and :mod:`data`.
"""
from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from data.sequences import ADDING_BASELINE_MSE, make_adding_problem

from ..nn.gru.classifier import GRUSequenceClassifier, image_rows
from ..options import MGRITOptions
from .options import mgrit_options

__all__ = ["GRUNet", "SerialGRUNet", "GRUSolverLog", "sequence_shape", "as_sequences",
           "load_sequence_task", "regression_loss", "SEQUENCE_TASKS", "ADDING_TRAIN",
           "ADDING_TEST", "ADDING_BASELINE_MSE"]

#: The generated sequence tasks (``--dataset``) of ``--model gru``.
SEQUENCE_TASKS = ("adding",)
#: Default numbers of generated training / test sequences of ``--dataset adding``.
ADDING_TRAIN, ADDING_TEST = 4000, 1000


def sequence_shape(in_shape) -> tuple[int, int]:
    """``(time steps, features per step)`` of samples of shape ``in_shape``: ``(1, H, W)``
    images -> ``(H, W)``; ``(T, F)`` sequences -> ``(T, F)``.

    Raises:
        ValueError: any other shape (naming the flag).
    """
    in_shape = tuple(int(d) for d in in_shape)
    if len(in_shape) == 3 and in_shape[0] == 1:
        return in_shape[1], in_shape[2]
    if len(in_shape) == 2:
        return in_shape
    raise ValueError(f"--model gru reads sequences (T, F) or single-channel images (1, H, W) row "
                     f"by row; the data set has samples of shape {in_shape}: use --dataset "
                     f"mnist5k, digits, mnist, fashion-mnist or adding")


def as_sequences(x: torch.Tensor) -> torch.Tensor:
    """A batch as ``(batch, T, F)``: images ``(n, 1, H, W)`` row by row, sequences as given."""
    return image_rows(x) if x.dim() == 4 else x


class GRUNet(GRUSequenceClassifier):
    """``head(h_T)`` of a GRU parallel in time over ``comm``, with inputs as in
    :func:`as_sequences` and evaluation forwards to a tolerance (see the module doc).

    Args:
        input_size, hidden_size, n_outputs, comm: of
            :class:`~mgrit.nn.gru.classifier.GRUSequenceClassifier`.
        eval_options: :class:`~mgrit.options.MGRITOptions` of forwards in ``eval()`` mode
            without grad (None: the training forward options).
        **gru_kwargs: ``forward``, ``backward``, ``warm_start``, ``coarse`` of
            :class:`~mgrit.nn.gru.ParallelGRU`.

    Shapes: input ``(batch, 1, H, W)`` or ``(batch, T, F)`` on every rank, the same; output
    ``(batch, n_outputs)`` on the last time rank (a placeholder elsewhere: use :meth:`loss`).
    """

    def __init__(self, input_size: int, hidden_size: int, n_outputs: int,
                 comm: MPI.Comm | None = None, eval_options: MGRITOptions | None = None,
                 **gru_kwargs):
        super().__init__(input_size, hidden_size, n_outputs, comm=comm, **gru_kwargs)
        if eval_options is not None and not isinstance(eval_options, MGRITOptions):
            raise ValueError(f"eval_options={eval_options!r} is not allowed: use MGRITOptions "
                             f"or None")
        self.eval_options = eval_options

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
        x = as_sequences(x)
        if self.training or torch.is_grad_enabled() or self.eval_options is None:
            return super().forward(x, h0)
        train_opts = self.gru.fwd_opts
        self.gru.fwd_opts = self.eval_options  # read by the solver built for this forward
        try:
            return super().forward(x, h0)
        finally:
            self.gru.fwd_opts = train_opts


class _GRUWeights(nn.Module):
    """The parameters of :class:`~mgrit.nn.gru.ParallelGRU` (same names, shapes, order and
    initialization) run by PyTorch's fused ``nn.GRU`` through ``torch.func.functional_call``."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        H = hidden_size
        self.weight_ih = nn.Parameter(torch.empty(3 * H, input_size))
        self.weight_hh = nn.Parameter(torch.empty(3 * H, H))
        self.bias_ih = nn.Parameter(torch.empty(3 * H))
        self.bias_hh = nn.Parameter(torch.empty(3 * H))
        std = 1.0 / math.sqrt(H)
        with torch.no_grad():
            for p in self.parameters():  # ParallelGRU.reset_parameters' order
                p.uniform_(-std, std)
        with torch.random.fork_rng(devices=[]):  # its own weights are never used: keep the
            # caller's random numbers for the head, as ParallelGRU does
            self._rnn = [nn.GRU(input_size, H, batch_first=True)]  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden state ``(batch, H)`` of ``x`` ``(batch, T, F)``."""
        rnn = self._rnn[0]
        weights = {"weight_ih_l0": self.weight_ih, "weight_hh_l0": self.weight_hh,
                   "bias_ih_l0": self.bias_ih, "bias_hh_l0": self.bias_hh}
        return functional_call(rnn, weights, (x,))[1][0]


class SerialGRUNet(nn.Module):
    """The serial reference of :class:`GRUNet`: ``head(h_T)`` with ``nn.GRU``; the same
    parameter names (``gru.weight_ih``, ..., ``head.weight``, ``head.bias``) and, built after
    the same ``torch.manual_seed``, the same initial weights."""

    def __init__(self, input_size: int, hidden_size: int, n_outputs: int):
        super().__init__()
        self.gru = _GRUWeights(input_size, hidden_size)
        self.head = nn.Linear(hidden_size, n_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(as_sequences(x)))


def _eval_options(cfg) -> MGRITOptions | None:
    """FCF to ``rtol = cfg.gru_eval_rtol`` (at most 50 cycles) in inexact mode; None (the
    training options) in exact mode or with ``gru_eval_rtol = 0``."""
    if cfg.tol > 0 or cfg.gru_eval_rtol <= 0:
        return None
    return MGRITOptions(max_levels=cfg.levels, cfactor=cfg.cfactor, relax="FCF", tol=0.0,
                        rtol=cfg.gru_eval_rtol, max_iter=50)


def build_gru(cfg, in_shape, num_classes, comm=None, form="network"):
    """``--model gru`` (module doc): ``cfg.hidden`` units, ``num_classes`` outputs (1 for a
    regression), weights from ``manual_seed(cfg.seed)``; layer-parallel over ``comm`` (time
    ranks) with :func:`~mgrit.models.mgrit_options`, ``cfg.warm_start``,
    ``cfg.gru_coarse`` and evaluation to ``cfg.gru_eval_rtol``; :class:`SerialGRUNet` when
    ``comm`` is None.

    Raises:
        ValueError: ``form="layers"`` (no layer-wise form), samples that are not sequences or
            single-channel images, fewer time steps than time ranks -- on every rank, before
            any communication.
    """
    if form == "layers":
        raise ValueError("--model gru has no layer-wise form: use --method mgrit or serial")
    steps, features = sequence_shape(in_shape)
    if comm is not None and steps < comm.Get_size():
        raise ValueError(f"the sequences have {steps} time steps, fewer than the "
                         f"{comm.Get_size()} time (layer) ranks: use fewer ranks or --dp")
    torch.manual_seed(cfg.seed)
    if comm is None:
        return SerialGRUNet(features, cfg.hidden, num_classes)
    fwd, bwd = mgrit_options(cfg)
    if fwd.sweeps(0) == 0 and comm.Get_rank() == 0:
        warnings.warn("--model gru with F-relaxation on the fine level: trained GRUs converge "
                      "slowly under MGRIT and inexact F-relaxed cycles train worse than serial; "
                      "use --relax FCF (see mgrit.models.recurrent)", stacklevel=2)
    return GRUNet(features, cfg.hidden, num_classes, comm=comm, eval_options=_eval_options(cfg),
                  forward=fwd, backward=bwd, warm_start=cfg.warm_start, coarse=cfg.gru_coarse)


# -- the adding problem ------------------------------------------------------------------------
def load_sequence_task(cfg):
    """``(train, test)`` of ``--dataset adding``: objects with ``x`` float32 ``(n, T, 2)``,
    ``y`` float32 ``(n,)`` and ``num_classes = 1`` (one regression output); ``n`` from
    ``--limit-train`` / ``--limit-test`` (defaults :data:`ADDING_TRAIN` / :data:`ADDING_TEST`),
    ``T = cfg.seq_len``, seeded by ``cfg.seed`` (train stream 0, test stream 1)."""
    if cfg.dataset not in SEQUENCE_TASKS:
        raise ValueError(f"--dataset {cfg.dataset!r} is not a sequence task: use one of "
                         f"{SEQUENCE_TASKS}")
    out = []
    for stream, n in ((0, cfg.limit_train or ADDING_TRAIN), (1, cfg.limit_test or ADDING_TEST)):
        x, y = make_adding_problem(n, cfg.seq_len, seed=cfg.seed, stream=stream)
        out.append(SimpleNamespace(x=x, y=y, num_classes=1))
    return tuple(out)


def regression_loss(out: torch.Tensor, target: torch.Tensor,
                    reduction: str = "mean") -> torch.Tensor:
    """Mean squared error of a one-output network ``out`` ``(batch, 1)`` against ``target``
    ``(batch,)`` (``reduction`` as ``F.mse_loss``; the training loop sums for evaluation)."""
    return F.mse_loss(out.squeeze(-1), target, reduction=reduction)


# -- solver statistics -------------------------------------------------------------------------
class GRUSolverLog:
    """Training-loop callback: the MGRIT cycles and final residuals of a :class:`GRUNet`'s
    training forwards and adjoint solves, per epoch (the loop's own MGRIT columns cover
    :class:`~mgrit.nn.LayerParallelNet` segments only). Appends one dict per epoch to
    ``extra["gru_solver"]`` (e.g. a :class:`~mgrit.training.MetricsWriter`'s ``extra``: it
    lands in ``summary.json``) and prints one line per epoch on the root rank.

    Args:
        extra: dict to append to (default: a new one, :attr:`extra`).
        print_fn: output (default ``print(..., flush=True)``); None: silent.
    """

    def __init__(self, extra: dict | None = None, print_fn=print):
        self.extra = {} if extra is None else extra
        self.print_fn = print_fn
        self._fres, self._bres, self._fits = [], [], []

    def on_step_end(self, trainer, record) -> None:
        gru = getattr(trainer.net, "gru", None)
        f, b = getattr(gru, "last_forward", None), getattr(gru, "last_backward", None)
        if f is None or not record.samples:
            return
        self._fits.append(f.iterations)
        if f.residuals:
            self._fres.append(float(f.residuals[-1]))
        if b is not None and b.residuals:
            self._bres.append(float(b.residuals[-1]))

    def on_epoch_end(self, trainer, record) -> None:
        if not self._fits:
            return
        entry = {"epoch": record.epoch, "fwd_iters": int(self._fits[-1]),
                 "fwd_residual_mean": float(np.mean(self._fres)) if self._fres else None,
                 "fwd_residual_last": self._fres[-1] if self._fres else None,
                 "bwd_residual_mean": float(np.mean(self._bres)) if self._bres else None}
        self.extra.setdefault("gru_solver", []).append(entry)
        self._fres, self._bres, self._fits = [], [], []
        if trainer.is_root and self.print_fn is not None:
            fm, bm = entry["fwd_residual_mean"], entry["bwd_residual_mean"]
            self.print_fn(f"[train] GRU MGRIT epoch {record.epoch}: {entry['fwd_iters']} fwd "
                          f"cycle(s), mean final residual fwd "
                          f"{'-' if fm is None else f'{fm:.2e}'} bwd "
                          f"{'-' if bm is None else f'{bm:.2e}'}")
