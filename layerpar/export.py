"""A run folder of the main job as a plain PyTorch model: :func:`load_run` builds the network
its ``config.json`` describes in its serial form (for ``--model resnet`` an ``nn.Sequential``
of the opening layer, the ``N`` residual steps and the closing layer; the other models' serial
modules; for ``--method sequential|decoupled`` every layer, then the last stage's head) and
loads the final weights (``model.pt``, written at the end of every run; or ``checkpoint.pt``).
The result needs no MPI and no layerpar solver at run time: ``model(x)`` on
``(batch, *input_shape)`` inputs of the run's dtype gives the serial network's output -- the
limit the layer-parallel forward approximates (exactly with one level or an MGRIT tolerance;
the run's ``summary.json`` key ``test_metrics_from`` says which forward produced its reported
test metrics). Its modules are layerpar's classes, so it needs layerpar installed;
:func:`export_run` writes it as TorchScript, which loads with PyTorch alone.

Command line (TorchScript; load it with ``torch.jit.load(path)``, no layerpar needed)::

    python -m layerpar.export RUN_DIR model_serial.pt [--checkpoint checkpoint.pt]

Reading the run folder runs no code from it (JSON, and checkpoints loaded with
``weights_only=True``).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from layerwise import build_method
from mgrit.models import LANGUAGE_MODELS, build_model
from mgrit.models.recurrent import SerialGRUNet, as_sequences
from mgrit.training.checkpoint import load_checkpoint

from .jobconfig import JobConfig, read_config, run_facts

__all__ = ["load_run", "export_run", "main"]


def load_run(run_dir, checkpoint: str | None = None) -> nn.Module:
    """The trained network of the run folder ``run_dir`` as a plain serial PyTorch module, in
    eval mode, with the run's dtype (``--dtype``).

    Args:
        run_dir: a run folder of ``experiments/train.py`` (any ``--method``; a layer-wise run
            gives its combined network: every layer, then the last stage's head -- the serial
            forward its test metrics come from).
        checkpoint: the weights file (default ``RUN/model.pt``, else ``RUN/checkpoint.pt``).

    Raises:
        FileNotFoundError: no ``config.json`` or no weights file in ``run_dir``.
        ValueError: a config without the input shape (a run that stopped before loading its
            data), a weights file that does not match the network (named by the checkpoint
            loader).
    """
    run = Path(run_dir)
    raw = read_config(run)
    cfg, facts = JobConfig.from_dict(raw), run_facts(raw)
    if "input_shape" not in facts or "num_classes" not in facts:
        raise ValueError(f"{run / 'config.json'} has no input_shape/num_classes: the run "
                         f"stopped before loading its data (nothing was trained)")
    if checkpoint is None:
        found = [p for p in (run / "model.pt", run / "checkpoint.pt") if p.is_file()]
        if not found:
            raise FileNotFoundError(f"{run}: no model.pt or checkpoint.pt (the run has not "
                                    f"finished; --checkpoint-every K keeps a checkpoint)")
        checkpoint = found[0]
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    shape, classes = tuple(facts["input_shape"]), int(facts["num_classes"])
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build as the job did (its default dtype)
    try:
        if cfg.method in ("sequential", "decoupled"):
            layers = build_model(cfg.model, cfg, shape, classes, form="layers")
            kw = {"num_stages": cfg.stages} if cfg.method == "decoupled" else {}
            net = build_method(cfg.method, layers, classes, shape, epochs=cfg.epochs,
                               optimizer=cfg.optimizer, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay, seed=cfg.seed, **kw)
        else:
            net = build_model(cfg.model, cfg, shape, classes, comm=None).to(dtype)
    finally:
        torch.set_default_dtype(before)
    load_checkpoint(os.fspath(checkpoint), net, None, restore_rng=False, restore_warm=False,
                    restore_options=False)
    if cfg.method == "sequential":
        net = net.network  # the layers, then the output head
    elif cfg.method == "decoupled":
        net = nn.Sequential(*net.model.bodies, net.model.heads[-1])
    return net.eval()


class _PlainGRU(nn.Module):
    """:class:`~mgrit.models.recurrent.SerialGRUNet` with a ``torch.nn.GRU`` holding its
    weights (it runs them through ``torch.func``, which TorchScript cannot trace)."""

    def __init__(self, net):
        super().__init__()
        g, H = net.gru, net.gru.weight_hh.shape[1]
        self.rnn = nn.GRU(g.weight_ih.shape[1], H, batch_first=True)
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(self.rnn, name + "_l0").copy_(getattr(g, name))
        self.head = net.head
        self.to(g.weight_ih.dtype)

    def forward(self, x):
        return self.head(self.rnn(as_sequences(x))[1][0])


def _examples(cfg, shape, classes, dtype) -> tuple:
    """Two inputs of the run's kind: the one traced with and another batch size (and, for a
    language model, a shorter context) the trace must give the same outputs for."""
    g = torch.Generator().manual_seed(0)
    if cfg.model in LANGUAGE_MODELS:
        T = shape[0]
        return (torch.randint(0, classes, (2, T), generator=g),
                torch.randint(0, classes, (3, max(1, T // 2)), generator=g))
    return (torch.randn(2, *shape, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(3, *shape, generator=g, dtype=torch.float64).to(dtype))


def export_run(run_dir, out, checkpoint: str | None = None) -> torch.jit.ScriptModule:
    """Write the network of :func:`load_run` as TorchScript to ``out``: it loads with PyTorch
    alone (``torch.jit.load(out)``; no layerpar, no MPI) and maps inputs of any batch size
    (a language model: any context up to the run's) to the outputs of :func:`load_run`'s
    module. Returns the traced module.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_run`; ValueError also when the traced
            module's outputs differ from the module's on a second input (not exportable).
    """
    model = load_run(run_dir, checkpoint)
    raw = read_config(run_dir)
    cfg, facts = JobConfig.from_dict(raw), run_facts(raw)
    dtype = next(model.parameters()).dtype
    plain = _PlainGRU(model) if isinstance(model, SerialGRUNet) else model
    first, second = _examples(cfg, tuple(facts["input_shape"]), int(facts["num_classes"]), dtype)
    with torch.no_grad(), warnings.catch_warnings():
        # TorchScript is deprecated in favour of torch.export, but still the format that
        # loads with PyTorch alone for every model here (torch.jit.load)
        warnings.simplefilter("ignore", DeprecationWarning)
        # shape checks traced as constants: the trace is compared on a second input below
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(plain, first, check_trace=False)
        for x in (first, second):
            want, got = model(x), traced(x)
            if not torch.allclose(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-12,
                                  atol=0.0):
                raise ValueError(f"{run_dir}: the TorchScript trace of the --model {cfg.model} "
                                 f"network differs from it on inputs of shape "
                                 f"{tuple(x.shape)} (max difference "
                                 f"{(got - want).abs().max().item():.3g}): use load_run() "
                                 f"in Python instead")
        torch.jit.save(traced, os.fspath(out))
    return traced


def main(argv=None) -> int:
    """``python -m layerpar.export RUN_DIR OUT.pt [--checkpoint FILE]``."""
    p = argparse.ArgumentParser(prog="python -m layerpar.export",
                                description="Save a run folder's trained network, load_run(RUN_DIR), "
                                            "as TorchScript (loads with torch.jit.load, "
                                            "PyTorch alone).")
    p.add_argument("run_dir", help="run folder of experiments/train.py (--out)")
    p.add_argument("out", help="file to write (TorchScript; torch.jit.load(OUT))")
    p.add_argument("--checkpoint", default=None, help="weights file (default RUN_DIR/model.pt, "
                   "else RUN_DIR/checkpoint.pt)")
    a = p.parse_args(argv)
    try:
        model = export_run(a.run_dir, a.out, a.checkpoint)
    except (OSError, ValueError) as exc:
        p.exit(1, f"{p.prog}: error: {exc}\n")
    n = sum(t.numel() for t in model.parameters())
    print(f"saved the network of {a.run_dir} ({n} parameters) as TorchScript to {a.out}; load "
          f"it with PyTorch alone: torch.jit.load({a.out!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
