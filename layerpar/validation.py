"""The allowed values of the main job's settings and their validation
(:meth:`~layerpar.jobconfig.JobConfig.validated` calls :func:`validate`): each flag checked
against what is allowed, by concern (numbers, training knobs, process layout, data set,
model, initial guess, multilevel schedule and sequences, run folder). Needs no communication
and gives the same verdict on every rank; every error names the flag and the allowed values."""
from __future__ import annotations

import importlib.util
import math
import os

import torch

from data import available_datasets
from data.text import TEXT_CORPORA

from mgrit.models import LANGUAGE_MODELS  # models trained on a text corpus, next-token loss
from mgrit.models.recurrent import SEQUENCE_TASKS  # generated sequence tasks (--model gru)
from mgrit.multilevel.initialization import depth_schedule, epoch_schedule
from mgrit.nn.depth import PROLONGATIONS
from mgrit.nn.gru.chains import COARSE_PROPAGATORS
from mgrit.options import relaxation_sweeps
from mgrit.training.checkpoint.io import read_file
from mgrit.training.lrschedule import SCHEDULES

from .runfolder import never_trained
from .spatialflags import (SPATIAL_PROLONGATIONS, SPATIAL_RESTRICTIONS, check_spatial,
                           spatial_levels)

__all__ = ["validate", "METHODS", "BUNDLED", "LANGUAGE_MODELS", "SEQUENCE_TASKS", "BIAS_ACTIONS",
           "DEVICES", "OPTIMIZER_NAMES", "SPATIAL_RESTRICTIONS", "SPATIAL_PROLONGATIONS",
           "spatial_levels"]

METHODS = ("serial", "mgrit", "sequential", "decoupled")
BUNDLED = ("mnist5k", "digits", "peaks", "voxels", "voxels31")
#: ``--bias-monitor`` choices: off, or a :class:`~mgrit.training.bias.BiasMonitor` action.
BIAS_ACTIONS = ("off", "log", "raise", "serial")
#: ``--device`` choices (mgrit.parallel.device_for_rank for auto / cuda).
DEVICES = ("auto", "cpu", "cuda")
#: ``--optimizer`` choices (built in layerpar.job.OPTIMIZERS).
OPTIMIZER_NAMES = ("adam", "adamw", "sgd")
_POSITIVE = ("layers", "width", "channels", "kernel", "levels", "fwd_iters", "bwd_iters",
             "epochs", "batch_size", "eval_batch_size")
_NON_NEGATIVE = ("limit_train", "limit_test", "seed", "threads", "dp", "stages",
                 "checkpoint_every")


def validate(c, world: int) -> None:
    """Check the settings of ``c`` (a :class:`~layerpar.jobconfig.JobConfig`, changed in
    place: ``method``, ``dp``, ``stages`` and ``warm_start`` resolved) for a world of
    ``world`` ranks. Raises ValueError naming the first setting that is not allowed as its
    flag, with the allowed values (the same on every rank; no communication)."""
    if c.serial:
        if c.method not in ("mgrit", "serial"):
            raise ValueError(f"--serial conflicts with --method {c.method}")
        c.method, c.serial = "serial", False
    if c.method not in METHODS:
        raise ValueError(f"--method={c.method!r} is not allowed: use one of {list(METHODS)}")
    for name in _POSITIVE:
        if getattr(c, name) < 1:
            raise ValueError(f"{_flag(name)}={getattr(c, name)} is not allowed: use an int >= 1")
    for name in _NON_NEGATIVE:
        if getattr(c, name) < 0:
            raise ValueError(f"{_flag(name)}={getattr(c, name)} is not allowed: use an int >= 0")
    if c.cfactor < 2:
        raise ValueError(f"--cfactor={c.cfactor} is not allowed: use an int >= 2")
    if c.kernel % 2 == 0:
        raise ValueError(f"--kernel={c.kernel} is not allowed: use an odd int")
    if c.resume and not os.path.isfile(c.resume):
        raise ValueError(f"--resume={c.resume!r}: no such checkpoint file")
    check_out(c)
    check_resume_position(c)
    if c.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package: pip install "
                         "'layerpar[tensorboard]' (or pip install tensorboard)")
    for name in ("T", "lr"):
        v = getattr(c, name)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{name}={v} is not allowed: use a finite number > 0")
    if not (math.isfinite(c.tol) and c.tol >= 0):
        raise ValueError(f"--tol={c.tol} is not allowed: use 0 (inexact) or a number > 0")
    if not (math.isfinite(c.clip_grad_norm) and c.clip_grad_norm >= 0):
        raise ValueError(f"--clip-grad-norm={c.clip_grad_norm} is not allowed: use 0 (off) "
                         f"or a finite number > 0")
    if c.clip_grad_norm and c.method not in ("mgrit", "serial"):
        raise ValueError(f"--clip-grad-norm needs --method mgrit or serial (--method "
                         f"{c.method} trains with its own per-stage updates)")
    if not (math.isfinite(c.momentum) and 0 <= c.momentum < 1):
        raise ValueError(f"--momentum={c.momentum} is not allowed: use a number in [0, 1)")
    check_training_knobs(c)
    if c.bias_monitor not in BIAS_ACTIONS:
        raise ValueError(f"--bias-monitor={c.bias_monitor!r} is not allowed: use one of "
                         f"{list(BIAS_ACTIONS)}")
    if c.bias_monitor != "off" and c.method != "mgrit":
        raise ValueError(f"--bias-monitor {c.bias_monitor} needs --method mgrit (got "
                         f"--method {c.method}: its gradients have no solver bias)")
    for name in ("bias_every", "bias_window"):
        if getattr(c, name) < 1:
            raise ValueError(f"{_flag(name)}={getattr(c, name)} is not allowed: use an int >= 1")
    if not (math.isfinite(c.bias_ratio) and c.bias_ratio > 0):
        raise ValueError(f"--bias-ratio={c.bias_ratio} is not allowed: use a finite number > 0")
    if not 0 < c.test_fraction < 1:
        raise ValueError(f"--test-fraction={c.test_fraction} is not allowed: use a number "
                         f"in (0, 1)")
    if not (isinstance(c.val_fraction, (int, float)) and math.isfinite(c.val_fraction)
            and 0 <= c.val_fraction < 1):
        raise ValueError(f"--val-fraction={c.val_fraction} is not allowed: use a number in "
                         f"[0, 1) (0 = no validation split)")
    for r in c.relax.split(","):
        try:
            relaxation_sweeps(r.strip())
        except ValueError as e:
            raise ValueError(f"--relax={c.relax!r}: {e}") from None
    check_layout(c, world)
    check_dataset(c)
    check_model(c)
    check_initial_guess(c)
    check_schedule_and_sequences(c, world // c.dp)
    check_spatial(c)
    check_conflicts(c)



def check_training_knobs(c) -> None:
    """--optimizer, --weight-decay, --lr-schedule, --warmup-epochs, --lr-step-epochs,
    --lr-gamma, --device, --tied."""
    if c.optimizer not in OPTIMIZER_NAMES:
        raise ValueError(f"--optimizer={c.optimizer!r} is not allowed: use one of "
                         f"{list(OPTIMIZER_NAMES)}")
    if not (math.isfinite(c.weight_decay) and c.weight_decay >= 0):
        raise ValueError(f"--weight-decay={c.weight_decay} is not allowed: use a finite "
                         f"number >= 0")
    if c.lr_schedule not in SCHEDULES:
        raise ValueError(f"--lr-schedule={c.lr_schedule!r} is not allowed: use one of "
                         f"{list(SCHEDULES)}")
    if c.warmup_epochs < 0:
        raise ValueError(f"--warmup-epochs={c.warmup_epochs} is not allowed: use an int >= 0")
    if c.lr_step_epochs < 1:
        raise ValueError(f"--lr-step-epochs={c.lr_step_epochs} is not allowed: use an int "
                         f">= 1")
    if not (math.isfinite(c.lr_gamma) and 0 < c.lr_gamma <= 1):
        raise ValueError(f"--lr-gamma={c.lr_gamma} is not allowed: use a number in (0, 1]")
    if c.warmup_epochs and (c.warmup_epochs > c.epochs or (
            c.warmup_epochs == c.epochs and c.lr_schedule != "none")):
        raise ValueError(f"--warmup-epochs={c.warmup_epochs} leaves no epoch of the "
                         f"{c.lr_schedule} schedule (--epochs {c.epochs}): use fewer "
                         f"warm-up epochs")
    if c.device not in DEVICES:
        raise ValueError(f"--device={c.device!r} is not allowed: use one of {list(DEVICES)}")
    if c.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device is available to this process (torch "
                         f"{torch.__version__}): use --device cpu or auto")
    layerwise = c.method in ("sequential", "decoupled")
    scheduled = c.lr_schedule != "none" or c.warmup_epochs
    if layerwise and (scheduled or c.optimizer == "adamw" or c.device != "cpu" or c.tied):
        what = ("--lr-schedule/--warmup-epochs" if scheduled else "--optimizer adamw"
                if c.optimizer == "adamw" else "--tied" if c.tied else "--device")
        raise ValueError(f"{what} is not available with --method {c.method} (layer-wise "
                         f"training runs its own optimizers on CPU): use --method mgrit or "
                         f"serial")
    if scheduled and c.multilevel_init:
        raise ValueError("--lr-schedule/--warmup-epochs cannot be combined with "
                         "--multilevel-init (each depth is its own fit): use one of them")
    if c.tied and (c.model != "resnet" or c.multilevel_init):
        raise ValueError(f"--tied is the weight-tied --model resnet (every layer one step "
                         f"module): not --model {c.model}"
                         + (" with --multilevel-init" if c.multilevel_init else ""))

def check_layout(c, world: int) -> None:
    if c.dp == 0:
        c.dp = world if c.method in ("serial", "sequential") else 1
    if world % c.dp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"--dp={c.dp} does not divide the world size {world}: use one of "
                         f"{divisors}")
    P_L = world // c.dp
    if c.method in ("serial", "sequential") and P_L != 1:
        raise ValueError(f"--method {c.method} has no layer parallelism: use --dp {world} "
                         f"(= world size; replicas only), got --dp {c.dp}")
    if c.method == "mgrit" and c.layers < P_L:
        raise ValueError(f"--layers={c.layers} is smaller than the {P_L} layer ranks (world "
                         f"{world} / dp {c.dp}): use --layers >= {P_L} or fewer ranks")
    if c.method == "decoupled":
        K = c.stages or P_L
        if K % P_L:
            raise ValueError(f"--stages={K} is not a multiple of the {P_L} layer ranks "
                             f"(world {world} / dp {c.dp})")
        if K > c.layers + 1:
            raise ValueError(f"--stages={K} exceeds the {c.layers + 1} layers (opening + "
                             f"{c.layers} steps)")
        c.stages = K
    if c.batch_size < c.dp and c.method in ("sequential", "decoupled"):
        raise ValueError(f"--batch-size={c.batch_size} is smaller than --dp={c.dp}: "
                         f"layer-wise training needs a sample of every batch per replica")

def check_dataset(c) -> None:
    if c.dataset in BUNDLED or c.dataset == "hdf5" or c.dataset in TEXT_CORPORA \
            or c.dataset in SEQUENCE_TASKS:
        return
    names = available_datasets()
    if c.dataset not in names:
        raise ValueError(f"--dataset={c.dataset!r} is unknown: use one of "
                         f"{sorted(set(names) | {'hdf5'})} (images), "
                         f"{list(TEXT_CORPORA)} (text, --model gpt) or "
                         f"{list(SEQUENCE_TASKS)} (sequences, --model gru)")

def check_initial_guess(c) -> None:
    """--nested-iteration builds every solve's initial guess itself: no warm start."""
    if not c.nested_iteration:
        return
    if c.warm_start or c.warm_start_adjoint:
        raise ValueError("--nested-iteration builds each MGRIT solve's initial guess from "
                         "the coarsest level: it cannot be combined with --warm-start or "
                         "--warm-start-adjoint (use --no-warm-start)")
    c.warm_start = False

def check_model(c) -> None:
    """Settings of --model staged-resnet|vit|gpt (mgrit.models.transformer)."""
    for name in ("d_model", "heads", "patch", "context"):
        if getattr(c, name) < 1:
            raise ValueError(f"{_flag(name)}={getattr(c, name)} is not allowed: use an int >= 1")
    for name in ("d_ff", "buffer_layers"):
        if getattr(c, name) < 0:
            raise ValueError(f"{_flag(name)}={getattr(c, name)} is not allowed: use an int >= 0")
    for name in ("dropout", "drop_path"):
        v = getattr(c, name)
        if not 0 <= v < 1:
            raise ValueError(f"{_flag(name)}={v} is not allowed: use a probability in [0, 1)")
        if v and c.model not in ("vit", "gpt"):
            raise ValueError(f"{_flag(name)}={v} applies to the transformers only: use "
                             f"--model vit or gpt, got --model {c.model}")
    if c.model in ("vit", "gpt") and c.d_model % c.heads:
        divisors = [h for h in range(1, c.d_model + 1) if c.d_model % h == 0]
        raise ValueError(f"--d-model={c.d_model} is not divisible by --heads={c.heads}: use "
                         f"a number of heads that divides d_model (one of {divisors})")
    if c.model == "staged-resnet" and c.step == "dense":
        raise ValueError("--model staged-resnet is a convolutional ResNet: use --step conv "
                         "or twoconv")
    text, lm = c.dataset in TEXT_CORPORA, c.model in LANGUAGE_MODELS
    if lm and not text:
        raise ValueError(f"--model {c.model} is a language model: use a text corpus "
                         f"(--dataset {' or '.join(TEXT_CORPORA)}), got --dataset {c.dataset}")
    if text and not lm:
        raise ValueError(f"--dataset {c.dataset} is a text corpus: use a language model "
                         f"(--model {' or '.join(LANGUAGE_MODELS)}), got --model {c.model}")
    if c.model in ("staged-resnet", "cifar-resnet", "vit", "gpt") and \
            c.method in ("sequential", "decoupled"):
        raise ValueError(f"--method {c.method} has no --model {c.model}: use --method mgrit "
                         f"or serial")

def check_schedule_and_sequences(c, P_L: int) -> None:
    """--multilevel-init (mgrit.multilevel.initialization) and --model gru / --dataset
    adding (mgrit.models.recurrent)."""
    if c.multilevel_init < 0:
        raise ValueError(f"--multilevel-init={c.multilevel_init} is not allowed: use 0 (off) "
                         f"or the number of depths L >= 1")
    if c.multilevel_init:
        if c.method not in ("mgrit", "serial") or c.model == "gru":
            raise ValueError(f"--multilevel-init refines residual networks in depth (--method "
                             f"mgrit or serial): not --method {c.method} --model {c.model}")
        if c.prolong not in PROLONGATIONS:
            raise ValueError(f"--prolong={c.prolong!r} is not allowed: use one of "
                             f"{list(PROLONGATIONS)}")
        depths = depth_schedule(c.layers, c.multilevel_init)
        epoch_schedule(c.init_epochs, c.multilevel_init, c.epochs)
        if c.method == "mgrit" and depths[0] < P_L:
            raise ValueError(f"--multilevel-init {c.multilevel_init} starts at {depths[0]} "
                             f"layers, fewer than the {P_L} layer ranks: use fewer levels "
                             f"or ranks")
    for name, low in (("hidden", 1), ("seq_len", 2)):
        if getattr(c, name) < low:
            raise ValueError(f"{_flag(name)}={getattr(c, name)} is not allowed: use an int "
                             f">= {low}")
    if c.gru_coarse not in COARSE_PROPAGATORS:
        raise ValueError(f"--gru-coarse={c.gru_coarse!r} is not allowed: use one of "
                         f"{list(COARSE_PROPAGATORS)}")
    if not (math.isfinite(c.gru_eval_rtol) and c.gru_eval_rtol >= 0):
        raise ValueError(f"--gru-eval-rtol={c.gru_eval_rtol} is not allowed: use 0 (the "
                         f"training cycles) or a number > 0")
    if c.model == "gru" and c.method not in ("mgrit", "serial"):
        raise ValueError(f"--method {c.method} has no --model gru: use --method mgrit or "
                         f"serial")
    if c.dataset in SEQUENCE_TASKS and c.model != "gru":
        raise ValueError(f"--dataset {c.dataset} is a sequence regression: use --model gru, "
                         f"got --model {c.model}")
    if c.dataset in SEQUENCE_TASKS and c.method == "mgrit" and c.seq_len < P_L:
        raise ValueError(f"--seq-len={c.seq_len} is smaller than the {P_L} time (layer) "
                         f"ranks: use --seq-len >= {P_L} or fewer ranks")


def check_out(c) -> None:
    """--out: an existing non-empty folder only with --overwrite, with --resume of a checkpoint
    in that folder (the run continues there), or when no job trained there (only the config and
    logs of a job that failed before its first step: re-used); --resume into another run's
    folder needs --overwrite (same verdict on every rank of a shared file system; no
    communication)."""
    home = os.path.dirname(os.path.realpath(c.resume)) if c.resume else None
    same = bool(c.out) and home == os.path.realpath(c.out)  # the checkpoint's own folder
    if c.overwrite and c.resume and (same or not c.out):
        raise ValueError("--overwrite deletes the run folder's results and --resume continues "
                         "them: pass one of them")
    if not c.out or c.overwrite or not os.path.isdir(c.out) or same:
        return
    entries = sorted(os.listdir(c.out))
    if entries and not never_trained(c.out):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        if c.resume:
            raise ValueError(f"--out={c.out!r} is another run's folder ({len(entries)} "
                             f"entries: {shown}; the checkpoint is in {home}): resume into "
                             f"a new folder or {home}, or pass --overwrite (deletes the "
                             f"results in --out)")
        raise ValueError(f"--out={c.out!r} exists and is not empty ({len(entries)} entries: "
                         f"{shown}): choose a new run folder, or pass --overwrite (deletes its "
                         f"results) or --resume CHECKPOINT (continues the run there)")


def check_resume_position(c) -> None:
    """--resume of a readable file that is no training checkpoint (a run's final model.pt) or
    whose position leaves nothing to train under --epochs: refused before any output (the run
    folder's files stay those of the run that wrote it). Unreadable files are left to the
    loader's own errors; --multilevel-init resumes at a level's end by design."""
    if not c.resume or c.multilevel_init:
        return
    ckpt, _ = read_file(c.resume)
    extra = ckpt.get("extra") if isinstance(ckpt, dict) else None
    if isinstance(extra, dict) and not extra:
        raise ValueError(f"--resume={c.resume!r} is not a training checkpoint: it holds weights "
                         f"only (e.g. a run's final model.pt): resume from the checkpoint.pt "
                         f"a run writes with --checkpoint-every K")
    pos = extra.get("position") if isinstance(extra, dict) else None
    if pos and int(pos[0]) >= c.epochs:
        raise ValueError(f"--resume {c.resume} is at the end of epoch {int(pos[0])} of the "
                         f"run's {c.epochs}: nothing is left to train (--epochs counts from the "
                         f"start of the run): pass --epochs > {int(pos[0])} to train more")


def check_conflicts(c) -> None:
    """Settings that would otherwise be ignored: --stages outside --method decoupled, an empty
    --out."""
    if c.stages and c.method != "decoupled":
        raise ValueError(f"--stages={c.stages} sets the stages of --method decoupled: it has "
                         f"no effect with --method {c.method} (leave it out)")
    if c.out is not None and not str(c.out).strip():
        raise ValueError(f"--out={c.out!r} names no folder: give a run folder, or leave --out "
                         f"out for runs/<method>-<timestamp>")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
