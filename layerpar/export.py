"""A run folder of the main job as a plain PyTorch model: :func:`load_run` builds the network
its ``config.json`` describes in its serial form (for ``--model resnet`` an ``nn.Sequential``
of the opening layer, the ``N`` residual steps and the closing layer; the other models' serial
modules) and loads the final weights (``model.pt``, written at the end of every ``--method
mgrit|serial`` run; or ``checkpoint.pt``). The result needs no MPI and no layerpar solver at
run time: ``model(x)`` on ``(batch, *input_shape)`` inputs of the run's dtype gives the serial
network's output -- the limit the layer-parallel forward approximates (exactly with one level
or an MGRIT tolerance; the run's ``summary.json`` key ``test_metrics_from`` says which forward
produced its reported test metrics).

Command line (saves the whole module with ``torch.save``; load it with
``torch.load(path, weights_only=False)``, or keep ``state_dict()`` for a safe load)::

    python -m layerpar.export RUN_DIR model_serial.pt [--checkpoint checkpoint.pt]

Reading the run folder runs no code from it (JSON, and checkpoints loaded with
``weights_only=True``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

from mgrit.models import build_model
from mgrit.training.checkpoint import load_checkpoint

from .jobconfig import JobConfig, read_config, run_facts

__all__ = ["load_run", "main"]


def load_run(run_dir, checkpoint: str | None = None) -> nn.Module:
    """The trained network of the run folder ``run_dir`` as a plain serial PyTorch module, in
    eval mode, with the run's dtype (``--dtype``).

    Args:
        run_dir: a run folder of ``experiments/train.py`` (``--method mgrit`` or ``serial``).
        checkpoint: the weights file (default ``RUN/model.pt``, else ``RUN/checkpoint.pt``).

    Raises:
        FileNotFoundError: no ``config.json`` or no weights file in ``run_dir``.
        ValueError: a run of a layer-wise method (its stages and heads are not one network),
            a config without the input shape (a run that stopped before loading its data), a
            weights file that does not match the network (named by the checkpoint loader).
    """
    run = Path(run_dir)
    raw = read_config(run)
    cfg, facts = JobConfig.from_dict(raw), run_facts(raw)
    if cfg.method in ("sequential", "decoupled"):
        raise ValueError(f"{run}: a --method {cfg.method} run trains stages with auxiliary "
                         f"heads, not one network: load_run exports --method mgrit or serial "
                         f"runs")
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
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build as the job did (its default dtype)
    try:
        net = build_model(cfg.model, cfg, tuple(facts["input_shape"]), int(facts["num_classes"]),
                          comm=None).to(dtype)
    finally:
        torch.set_default_dtype(before)
    load_checkpoint(os.fspath(checkpoint), net, None, restore_rng=False, restore_warm=False,
                    restore_options=False)
    return net.eval()


def main(argv=None) -> int:
    """``python -m layerpar.export RUN_DIR OUT.pt [--checkpoint FILE]``."""
    p = argparse.ArgumentParser(prog="python -m layerpar.export",
                                description="Save a run folder's trained network as a plain "
                                            "PyTorch module (torch.save of load_run(RUN_DIR)).")
    p.add_argument("run_dir", help="run folder of experiments/train.py (--out)")
    p.add_argument("out", help="file to write (torch.save of the nn.Module)")
    p.add_argument("--checkpoint", default=None, help="weights file (default RUN_DIR/model.pt, "
                   "else RUN_DIR/checkpoint.pt)")
    a = p.parse_args(argv)
    try:
        model = load_run(a.run_dir, a.checkpoint)
    except (OSError, ValueError) as exc:
        p.exit(1, f"{p.prog}: error: {exc}\n")
    torch.save(model, a.out)
    n = sum(t.numel() for t in model.parameters())
    print(f"saved {type(model).__name__} ({n} parameters) of {a.run_dir} to {a.out}; load with "
          f"torch.load({a.out!r}, weights_only=False)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
