"""The flags of the main job (``experiments/train.py``): one argparse group per concern (data,
network, transformers, recurrent, multilevel initialization, MGRIT, training, parallelism,
reliability and output), each flag with its default (from :class:`JobConfig`) and advice.
:func:`job_parser` gives the :class:`~layerpar.cli.JobParser`; a script's ``main`` calls
its ``parse_config`` and :func:`layerpar.job.run_job`."""
from __future__ import annotations

import argparse

from data import TEXT_CORPORA
from mgrit.models import MODELS

from .cli import JobParser
from .job import OPTIMIZERS
from .jobconfig import BIAS_ACTIONS, BUNDLED, METHODS, JobConfig
from .validation import SPATIAL_PROLONGATIONS, SPATIAL_RESTRICTIONS

__all__ = ["job_parser", "MODEL_DEFAULTS"]

D = JobConfig()  # the defaults

#: ``--model`` -> the defaults that differ for it (a flag given on the command line wins).
#: gpt: its text corpus, and the records' quick setting (experiments/records/
#: transformer_records.py: 8 blocks, 32 characters, Adam 2e-3, 5,000 windows; about 27 s per
#: epoch on 2 ranks); vit and gpt: nested iteration, as the README recommends for transformers
#: (not with an explicit --warm-start or --warm-start-adjoint).
MODEL_DEFAULTS = {
    "gpt": {"dataset": TEXT_CORPORA[0], "layers": 8, "context": 32, "optimizer": "adam",
            "lr": 2e-3, "limit_train": 5000, "limit_test": 1000, "levels": 2, "cfactor": 2,
            "nested_iteration": True},
    "vit": {"nested_iteration": True},
}


def _model_defaults_epilog() -> str:
    return "per-model defaults (flags given win): " + "; ".join(
        f"--model {m}: " + ", ".join(f"--{k.replace('_', '-')} {v}" if v is not True
                                     else f"--{k.replace('_', '-')}" for k, v in d.items())
        for m, d in MODEL_DEFAULTS.items())


def _fill_model_defaults(ns, unset) -> None:
    """Set the flags left ``unset`` to the model's default (:data:`MODEL_DEFAULTS`) or the
    general one."""
    own = dict(MODEL_DEFAULTS.get(ns.model, {}))
    if ns.warm_start not in (None, unset) or ns.warm_start_adjoint not in (False, unset):
        own.pop("nested_iteration", None)  # the user chose the warm start
    for dest in _dependent():
        if getattr(ns, dest) is unset:
            setattr(ns, dest, own.get(dest, getattr(D, dest)))


def _dependent() -> set:
    deps = {k for d in MODEL_DEFAULTS.values() for k in d}
    return deps | {"warm_start", "warm_start_adjoint"}


def job_parser(prog: str = "experiments/train.py") -> JobParser:
    """The main job's parser: every flag of :class:`~layerpar.jobconfig.JobConfig` with
    its default and advice (``experiments/train.py --help`` prints it); ``parse_config`` turns
    the flags into a validated config."""
    p = JobParser(prog=prog, description="Train a deep ResNet layer-parallel "
                  "with MGRIT over MPI (or serially / layer-wise). Run as: mpiexec -n P python "
                  "-m mpi4py experiments/train.py ...", epilog=_model_defaults_epilog())
    p.model_defaults = (_dependent(), _fill_model_defaults)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=D.dataset, help=f"data set name (bundled, no download: "
                   f"{', '.join(BUNDLED)}; others from data.available_datasets() and hdf5 need "
                   f"--data-root; text corpus for --model gpt: {', '.join(TEXT_CORPORA)}; "
                   f"default: {D.dataset}, for --model gpt {TEXT_CORPORA[0]})")
    g.add_argument("--data-root", default=D.data_root, help="folder with the data set's files "
                   "(mnist, fashion-mnist, cifar10, hdf5); ignored by bundled sets")
    g.add_argument("--test-fraction", type=float, default=D.test_fraction,
                   help="test share for sets without a shipped split (seeded stratified split)")
    g.add_argument("--limit-train", type=int, default=D.limit_train,
                   help="use only the first N training samples (0 = all)")
    g.add_argument("--val-fraction", type=float, default=D.val_fraction,
                   help="validation share in [0, 1): the last round(F x n) of the n training "
                        "samples (after --limit-train) are held out, never trained on, and "
                        "evaluated after every epoch (val_acc, val_loss in metrics.h5 and "
                        "summary.json); make choices (cycles, coarsening, epochs) on them, not "
                        "on the test set (default 0 = none; e.g. 0.2)")
    g.add_argument("--limit-test", type=int, default=D.limit_test,
                   help="use only the first N test samples (0 = all)")
    g = p.add_argument_group("network")
    g.add_argument("--model", choices=sorted(MODELS), default=D.model,
                   help="network family (mgrit.models)")
    g.add_argument("--step", choices=("dense", "conv", "twoconv"), default=D.step,
                   help="residual step F: dense act(Wx+b), conv act(K*x+b), twoconv "
                        "act(K2*act(K1*x)) (TorchBraid's MNIST block)")
    g.add_argument("--layers", type=int, default=D.layers, help="N, number of residual steps "
                   "(staged-resnet, cifar-resnet: per stage; gpt: of the layer-parallel stack)")
    g.add_argument("--width", type=int, default=D.width, help="state width of dense steps")
    g.add_argument("--channels", type=int, default=D.channels, help="channels of conv steps "
                   "(cifar-resnet: of the first stage; He et al. use 16)")
    g.add_argument("--kernel", type=int, default=D.kernel, help="kernel size of conv steps (odd)")
    g.add_argument("--T", type=float, default=D.T, help="final time; step size h = T / N "
                   "(transformers: --T N gives h = 1, the standard pre-LN transformer)")
    g.add_argument("--activation", choices=("tanh", "relu", "smoothrelu"), default=D.activation,
                   help="activation of the steps and the opening layer")
    g.add_argument("--tied", action="store_true", help="--model resnet with weight-tied "
                   "layers: every residual layer uses one step module (a time-invariant "
                   "neural ODE; LayerParallelResNet tie=..., each layer rank a replica, "
                   "gradients summed over the layer ranks in the backward)")
    g = p.add_argument_group("transformers and staged ResNet (--model vit|gpt|staged-resnet)")
    g.add_argument("--d-model", type=int, default=D.d_model, help="transformer width")
    g.add_argument("--heads", type=int, default=D.heads, help="attention heads (divide --d-model)")
    g.add_argument("--d-ff", type=int, default=D.d_ff, help="MLP hidden width (0 = 4 d_model)")
    g.add_argument("--patch", type=int, default=D.patch, help="vit: patch side (divides the "
                   "image size)")
    g.add_argument("--context", type=int, default=D.context, help="gpt: characters per sample "
                   "and model positions")
    g.add_argument("--buffer-layers", type=int, default=D.buffer_layers, help="gpt: serial "
                   "decoder blocks before and after the layer-parallel stack (each side)")
    g.add_argument("--dropout", type=float, default=D.dropout, help="vit/gpt: dropout "
                   "probability on the attention probabilities, both residual branches and the "
                   "MLP hidden layer of every block (0 = off; one mask per forward and layer, the "
                   "same in every MGRIT sweep: mgrit.nn.steps.stochastic)")
    g.add_argument("--drop-path", type=float, default=D.drop_path, help="vit/gpt: stochastic "
                   "depth, probability of dropping a block's branch per sample (0 = off; ViTs "
                   "use 0.1 for deep models)")
    g = p.add_argument_group("recurrent (--model gru; mgrit.models.recurrent)")
    g.add_argument("--hidden", type=int, default=D.hidden, help="GRU hidden size")
    g.add_argument("--seq-len", type=int, default=D.seq_len, help="--dataset adding: time "
                   "steps per sequence")
    g.add_argument("--gru-coarse", choices=("power", "implicit"), default=D.gru_coarse,
                   help="coarse-level GRU step of MGRIT in time")
    g.add_argument("--gru-eval-rtol", type=float, default=D.gru_eval_rtol, help="inexact mode: "
                   "evaluation forwards iterate to this relative residual (FCF, <= 50 cycles); "
                   "0 = the training cycles")
    g = p.add_argument_group("multilevel initialization in depth (Cyr et al. 2019)")
    g.add_argument("--multilevel-init", type=int, default=D.multilevel_init, metavar="L",
                   help="train at depths N/2^(L-1), ..., N/2, N, prolonging the weights between "
                        "them (0 = off; 1 = depth N only)")
    g.add_argument("--init-epochs", default=D.init_epochs, help="epochs per coarse depth, "
                   "coarsest first, comma separated, last repeated (--epochs at depth N)")
    g.add_argument("--prolong", choices=("constant", "linear"), default=D.prolong,
                   help="prolongation of the weights in depth")
    g = p.add_argument_group("MGRIT (--method mgrit)")
    g.add_argument("--levels", type=int, default=D.levels, help="maximum number of MGRIT levels")
    g.add_argument("--cfactor", type=int, default=D.cfactor, help="coarsening factor")
    g.add_argument("--fwd-iters", type=int, default=D.fwd_iters, help="forward MGRIT cycles "
                   "(with --tol 0: exactly this many; with --tol > 0 the cap is max(this, 50))")
    g.add_argument("--bwd-iters", type=int, default=D.bwd_iters, help="backward (adjoint) MGRIT "
                   "cycles (with --tol 0: exactly this many; with --tol > 0 the cap is max(this, 50))")
    g.add_argument("--relax", default=D.relax, help="relaxation per level, comma separated, last "
                   "repeated (F, FCF, FCFCF...)")
    g.add_argument("--tol", type=float, default=D.tol, help="0 = inexact training (fixed "
                   "--fwd-iters/--bwd-iters cycles); > 0 = iterate to this absolute residual "
                   "tolerance (exact mode)")
    g.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=D.warm_start,
                   help="start each forward solve from the previous batch's states (default: on "
                        "in inexact mode, off with --tol > 0)")
    g.add_argument("--warm-start-adjoint", action="store_true", help="also start each adjoint "
                   "solve from the previous batch's adjoints (Guenther et al. 2020)")
    g.add_argument("--nested-iteration", action="store_true", help="start each forward and "
                   "adjoint solve from the coarsest level's solution interpolated up (PyMGRIT's "
                   "default) instead of the warm start (implies --no-warm-start); better for "
                   "transformers, whose states differ from batch to batch")
    g.add_argument("--adjoint", choices=("mgrit", "serial"), default=D.adjoint,
                   help="backward solve: adjoint MGRIT, or a serial sweep across ranks")
    g.add_argument("--skip-first-relaxation", action="store_true",
                   help="XBraid's skip: no work on the first down-cycle, the first cycle starts "
                        "from the coarse-grid solution (cheaper; discards the warm start, so "
                        "pair it with --no-warm-start or --tol > 0)")
    g = p.add_argument_group("spatial coarsening (--method mgrit, --step conv|twoconv; "
                             "docs/features/spatial_coarsening.rst)")
    g.add_argument("--spatial-coarsening", default=D.spatial_coarsening, metavar="LEVELS",
                   help="MGRIT levels whose states live on a grid coarsened by 2 per spatial "
                        "dimension, comma separated (e.g. 1 or 1,2; level 0 is the fine grid; "
                        "a coarse step then costs 1/4 (2-D) or 1/8 (3-D) of a fine one); "
                        "default: none (time-only coarsening)")
    g.add_argument("--spatial-restrict", choices=SPATIAL_RESTRICTIONS, default=None,
                   help="restriction of the states to a coarser grid (default full_weighting, "
                        "the scaled transpose of the interpolation; injection takes the coarse "
                        "points' values); needs --spatial-coarsening")
    g.add_argument("--spatial-prolong", choices=SPATIAL_PROLONGATIONS, default=None,
                   help="prolongation of the coarse-grid correction (default linear: "
                        "bi-/trilinear; constant: piecewise constant); needs "
                        "--spatial-coarsening")
    g = p.add_argument_group("training")
    g.add_argument("--method", choices=METHODS, default=None,
                   help=f"training method (default: {D.method})")
    g.add_argument("--serial", action="store_true", help="shortcut for --method serial (not "
                   "with another --method)")
    g.add_argument("--epochs", type=int, default=D.epochs,
                   help="epochs (sequential: epochs per layer)")
    g.add_argument("--batch-size", type=int, default=D.batch_size, help="global batch size")
    g.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=D.optimizer,
                   help=f"optimizer: torch.optim SGD (with --momentum), Adam or AdamW (decoupled "
                        f"weight decay; with --weight-decay 0 it equals Adam) (default: "
                        f"{D.optimizer})")
    g.add_argument("--lr", type=float, default=D.lr, help="learning rate (the peak rate with "
                   "--lr-schedule / --warmup-epochs)")
    g.add_argument("--momentum", type=float, default=D.momentum, help="SGD momentum")
    g.add_argument("--weight-decay", type=float, default=D.weight_decay, help="weight decay of "
                   "the optimizer (sgd, adam: L2 added to the gradient; adamw: decoupled); "
                   "typical 5e-4 (sgd) / 0.01-0.05 (adamw)")
    g.add_argument("--lr-schedule", choices=("none", "cosine", "step"), default=D.lr_schedule,
                   help="learning-rate schedule (torch.optim.lr_scheduler, stepped after every "
                        "optimizer step; lengths in epochs x batches per epoch; "
                        "mgrit.training.lrschedule): cosine = CosineAnnealingLR to 0 at the end, "
                        "step = StepLR (x --lr-gamma every --lr-step-epochs); saved in "
                        "checkpoints, so --resume continues it exactly")
    g.add_argument("--warmup-epochs", type=int, default=D.warmup_epochs, help="linear warm-up "
                   "from lr/steps to lr over this many epochs before the schedule (LinearLR + "
                   "SequentialLR); 0 = none")
    g.add_argument("--lr-step-epochs", type=int, default=D.lr_step_epochs, help="--lr-schedule "
                   "step: epochs between decays (counted after the warm-up)")
    g.add_argument("--lr-gamma", type=float, default=D.lr_gamma, help="--lr-schedule step: "
                   "decay factor in (0, 1]")
    g.add_argument("--clip-grad-norm", type=float, default=D.clip_grad_norm, metavar="MAX",
                   help="clip the gradients to this global 2-norm before every optimizer step "
                        "(over all layer ranks, after the data-parallel averaging: equal to "
                        "torch.nn.utils.clip_grad_norm_ on the serial model; a per-rank call "
                        "would clip each rank's layers by their own norm); 0 = off; --method "
                        "mgrit or serial")
    g.add_argument("--seed", type=int, default=D.seed, help="seed of data split, batches and "
                   "weights")
    g.add_argument("--dtype", choices=("float32", "float64"), default=D.dtype,
                   help="parameter and state dtype")
    g.add_argument("--eval-batch-size", type=int, default=D.eval_batch_size,
                   help="batch size of the test-set evaluation")
    g.add_argument("--stages", type=int, default=D.stages,
                   help="decoupled: number of stages K (0 = one per layer rank)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--dp", type=int, default=D.dp, help="data-parallel replicas P_D (P_L = world "
                   "size / dp); 0 = 1 for mgrit and decoupled, world size for serial and sequential")
    g.add_argument("--threads", type=int, default=D.threads, help="torch intra-op threads per "
                   "rank (0 = 1 when world size > 1, else torch's default)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default=D.device,
                   help="where each rank computes: cuda puts each rank on its node-local GPU "
                        "(local rank from MPI's shared-memory split, cuda:local_rank %% "
                        "device_count); auto = cuda when available, else cpu. The GPU path is "
                        "NOT measured or tested in this repository (CPU-only machines)")
    g = p.add_argument_group("reliability and output")
    g.add_argument("--guard", choices=("off", "warn", "add_iterations", "serial"), default=D.guard,
                   help="--method mgrit: action when an MGRIT residual grows over 3 cycles "
                        "(logged to RUN/guard.jsonl). Independently of it, a NaN/Inf residual "
                        "stops the run naming the first layer whose state is not finite")
    g.add_argument("--bias-monitor", choices=BIAS_ACTIONS, default=D.bias_monitor,
                   help="--method mgrit, inexact mode: every --bias-every steps compare the "
                        "step's gradient with a serial-equivalent solve of its batch (cost about "
                        "one serial step per check); when the bias exceeds --bias-ratio x the SGD "
                        "noise in --bias-window checks in a row: raise (+1 forward/backward cycle, "
                        "up to 8, then serial), serial (one-level exact solves from then on) or "
                        "log only; every check is logged to RUN/bias.jsonl "
                        "(mgrit.training.bias)")
    g.add_argument("--bias-every", type=int, default=D.bias_every, help="steps between bias "
                   "checks (20-100 keeps the overhead at a few percent)")
    g.add_argument("--bias-ratio", type=float, default=D.bias_ratio, help="bias dominates when "
                   "bias > ratio x noise; below 1 because the bias adds up over steps while "
                   "the noise averages out (smaller reacts earlier)")
    g.add_argument("--bias-window", type=int, default=D.bias_window, help="consecutive "
                   "dominated checks before acting")
    g.add_argument("--checkpoint-every", type=int, default=D.checkpoint_every,
                   help="save RUN/checkpoint.pt every K optimizer steps and after every epoch "
                        "(0 = no checkpoints); atomic; every method (layer-wise: the stages, "
                        "heads and optimizer states; the asynchronous DGL pipeline's replay "
                        "buffers are not saved)")
    g.add_argument("--resume", default=D.resume, help="checkpoint to continue from (same "
                   "method, data, batch size and seed; mgrit and serial: any number of ranks, "
                   "and their checkpoints load into each other); --epochs counts from the "
                   "start of the run; changed --lr/--momentum/--weight-decay and schedule "
                   "flags take effect (the schedule is re-planned; docs/features/resume.rst); "
                   "--out another run's non-empty folder only with --overwrite")
    g.add_argument("--out", default=D.out, help="run directory (default runs/<method>-<timestamp>)")
    g.add_argument("--overwrite", action="store_true", help="reuse an existing non-empty --out: "
                   "delete the results a previous run wrote there (config, metrics, summary, "
                   "curves, checkpoint, model, logs; other files are kept); without it (or "
                   "--resume of a checkpoint in that folder) such a folder is refused, unless "
                   "no job trained there (a failed start's config and logs are replaced)")
    g.add_argument("--tensorboard", action="store_true", help="also log the per-step and "
                   "per-epoch metrics to RUN/tensorboard (torch.utils.tensorboard; needs the "
                   "optional extra: pip install 'layerpar[tensorboard]')")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    g.add_argument("--debug", action="store_true", help="on failure, print the full traceback "
                   "too (it is always kept in RUN/error-rank-R.log)")
    return p
