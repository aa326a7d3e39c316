"""Evaluation of a :class:`~layerwise.pipeline.DecoupledPipeline` on a test set: chunks
flow along each replica's pipeline (layer rank 0 reads the inputs and targets, every rank
applies its stages and their heads and sends the features, the targets and -- for the head
ensemble -- the running sum of the heads' predictions to the next rank); the per-stage sums
are then summed over the whole grid (one ``Allreduce``). The results equal
:func:`layerwise.evaluate.evaluate` of the full model up to rounding.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

from .common import check_int, correct_count, mse_loss, shard

__all__ = ["evaluate_pipeline"]

_TAG_EACT, _TAG_ELAB, _TAG_EPRED = 201, 202, 203


def evaluate_pipeline(pipe, x: torch.Tensor | None, y: torch.Tensor | None, *,
                      batch_size: int = 1024, ensemble: bool = False) -> dict:
    """Evaluate the combined network of ``pipe`` (and optionally the head ensemble).

    Args:
        pipe: the :class:`~layerwise.pipeline.DecoupledPipeline` (collective over its grid).
        x, y: test inputs ``(n, *in_shape)`` and targets (int64 labels ``(n,)``, or float
            ``(n, D)`` when the model's loss is ``"mse"``), read on layer rank 0 only (None
            elsewhere is fine). Every replica takes its contiguous share of the samples.
        batch_size: chunk size (default 1024).
        ensemble: also evaluate the ensemble of all heads: classification ``ensemble_acc``
            (argmax of the summed softmax); regression ``ensemble_loss`` (MSE of the mean of
            the heads' outputs) and ``ensemble_acc`` None.

    Returns:
        on every rank, as :func:`layerwise.evaluate.evaluate`: ``{"loss", "acc"}`` of the
        output head (``acc`` None for MSE), ``stage_loss`` / ``stage_acc`` of every head, and
        the ensemble entries if asked.

    Raises:
        ValueError: ``batch_size < 1``; targets of the wrong dtype or shape for the model's
            loss (checked on layer rank 0, the same error on every rank before any message).
    """
    m, g = pipe.model, pipe.grid
    check_int("batch_size", batch_size)
    y = pipe._agreed_targets(y if pipe._first else None)
    mse = m.loss == "mse"
    K, C = m.num_stages, m.num_classes
    n = g.layer_comm.bcast(len(y) if pipe._first else None, root=0)
    local = shard(np.arange(n, dtype=np.int64), g.data_rank, g.data_size)
    chunks = [local[i:i + batch_size] for i in range(0, len(local), batch_size)]
    tot = np.zeros((K + 1, 3))  # rows: stages (loss_sum, correct, n), ensemble
    specs = None if pipe._first else [
        (_TAG_EACT, m.dtype, m.in_shapes[pipe.owned[0]], batch_size),
        (_TAG_ELAB, *pipe._target_spec(), batch_size)]
    if specs and ensemble:
        specs.append((_TAG_EPRED, m.dtype, (C,), batch_size))
    mods = pipe._modules_owned()
    modes = [mod.training for mod in mods]
    for mod in mods:
        mod.eval()

    def add(row, out, yb):
        correct = correct_count(out, yb, m.loss)
        loss = mse_loss(out, yb, reduction="sum") if mse else \
            F.cross_entropy(out, yb, reduction="sum")
        tot[row] += (float(loss), np.nan if correct is None else correct, len(yb))

    try:
        recv = pipe._post(specs) if specs and chunks else None
        with torch.no_grad():
            for i, idx in enumerate(chunks):
                if pipe._first:
                    t = torch.as_tensor(idx)
                    xb, yb = x[t], y[t]
                    pb = torch.zeros((len(idx), C), dtype=m.dtype)
                else:
                    got = recv.wait(pipe.comm_stats)
                    xb, yb = got[0], got[1]
                    pb = got[2].clone() if ensemble else None
                    recv = pipe._post(specs) if i + 1 < len(chunks) else None
                for k in pipe.owned:
                    xb = m.bodies[k](xb)
                    out = m.heads[k](xb)
                    add(k, out, yb)
                    if ensemble:
                        pb += out if mse else F.softmax(out, dim=1)
                if not pipe._last:
                    pipe._sender.send([xb, yb, pb] if ensemble else [xb, yb],
                                      [_TAG_EACT, _TAG_ELAB, _TAG_EPRED])
                elif ensemble:
                    add(K, pb / K, yb)
        if pipe._sender is not None:
            pipe._sender.flush()
    finally:
        for mod, t in zip(mods, modes):
            mod.train(t)
    g.comm.Allreduce(MPI.IN_PLACE, [tot, MPI.DOUBLE], op=MPI.SUM)
    cnt = np.maximum(tot[:, 2], 1)
    loss, acc = tot[:, 0] / cnt, tot[:, 1] / cnt
    num = lambda v: None if np.isnan(v) else float(v)  # noqa: E731
    res = {"loss": float(loss[K - 1]), "acc": num(acc[K - 1]),
           "stage_loss": [float(v) for v in loss[:K]], "stage_acc": [num(v) for v in acc[:K]]}
    if ensemble:
        res["ensemble_acc"] = num(acc[K])
        if mse:
            res["ensemble_loss"] = float(loss[K])
    return res
