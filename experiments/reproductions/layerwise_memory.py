"""Training-memory accounting of the layer-wise study (``reproduce_layerwise.py``): what Kim's
abstract claims sequential training saves, measured per method on the study's MLPs.

For one training step on a batch, the bytes a method must hold are counted as

* **model state**: every trainable parameter 3 times (value, gradient, SGD momentum) plus every
  frozen parameter once;
* **activations**: the tensors autograd saves for the backward pass, measured with
  ``torch.autograd.graph.saved_tensors_hooks`` on a real forward of the trained modules
  (one entry per address and shape, parameters excluded);
* **feature cache** (sequential only): the cached outputs of the frozen layers for the whole
  training set, input and output of the stage while the cache is advanced.

Per method (``layers`` of the network, ``heads[k]`` the auxiliary/temporary head of layer k,
``out_head`` the output head):

* end-to-end: one stage, all layers + output head trained together;
* sequential (our reading of Kim 2019, grow-at-top): stage k trains layer k + a fresh head on
  the cached features; peak = the largest stage (earlier layers frozen, counted once);
* DGL (single process): all stages train at once, each keeps its own graph only until its own
  backward: all parameters 3 times + the largest stage's activations; DGL pipelined: one
  stage per rank, the largest rank's share (its stages run one after another).

The dataset itself (the same for every method) is not counted. Counts are deterministic
(float32, batch ``B``); they are not a process-RSS measurement.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["saved_bytes", "param_count", "memory_table"]


def param_count(modules: Sequence[nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def saved_bytes(modules: Sequence[nn.Module], x: torch.Tensor, loss_fn, y) -> int:
    """Bytes autograd saves for backward in ``loss_fn(Sequential(*modules)(x), y)``: saved
    tensors (elements of each, one entry per address and shape), excluding the modules'
    parameters. ``x`` (a batch, copied as training's fancy indexing copies it) needs no grad."""
    params = {p.data_ptr() for m in modules for p in m.parameters()}
    seen = {}

    def pack(t):
        # a saved view (e.g. a batch slice) holds its own elements only: count numel, not the
        # whole storage it points into; one entry per (address, shape)
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(nn.Sequential(*modules)(x.clone()), y)
    return sum(seen.values())


def memory_table(layers: Sequence[nn.Module], heads: Sequence[nn.Module], x: torch.Tensor,
                 y: torch.Tensor, loss_fn, n_train: int, ranks: int) -> dict:
    """Per-method memory (bytes) and trainable parameters per stage.

    Args:
        layers: the L layers; heads: L heads, ``heads[k]`` fits layer k's output (the last one
            is the output head); x: one training batch ``(B, in_dim)`` float32; y: its targets;
            loss_fn: ``(out, y) -> scalar``; n_train: training-set size (feature cache);
            ranks: P of the pipelined DGL row (stages split evenly, contiguous).

    Returns:
        ``{method: {"trainable_per_stage": [...], "state": int, "activations": int,
        "cache": int, "total": int}}`` for ``end-to-end``, ``sequential``, ``DGL`` and
        ``DGL pipelined (max over ranks)``.
    """
    L, b = len(layers), 4  # float32
    with torch.no_grad():
        feats = [x]
        for layer in layers:
            feats.append(layer(feats[-1]))
    acts = [saved_bytes([layers[k], heads[k]], feats[k], loss_fn, y) for k in range(L)]
    p_layer = [param_count([m]) for m in layers]
    p_head = [param_count([h]) for h in heads]
    out = {}
    e2e_act = saved_bytes([*layers, heads[-1]], x, loss_fn, y)
    p_all = sum(p_layer) + p_head[-1]
    out["end-to-end"] = dict(trainable_per_stage=[p_all], state=3 * b * p_all,
                             activations=e2e_act, cache=0)
    seq = []
    for k in range(L):
        state = b * (3 * (p_layer[k] + p_head[k]) + sum(p_layer[:k]))
        cache = 0 if k == 0 else b * n_train * (feats[k][0].numel() + feats[k + 1][0].numel())
        seq.append((state + acts[k] + cache, state, acts[k], cache))
    worst = max(seq)
    out["sequential"] = dict(trainable_per_stage=[p_layer[k] + p_head[k] for k in range(L)],
                             state=worst[1], activations=worst[2], cache=worst[3])
    p_dgl = sum(p_layer) + sum(p_head)
    out["DGL"] = dict(trainable_per_stage=[p_layer[k] + p_head[k] for k in range(L)],
                      state=3 * b * p_dgl, activations=max(acts), cache=0)
    per_rank = [list(range(r * L // ranks, (r + 1) * L // ranks)) for r in range(ranks)]
    shares = [(3 * b * sum(p_layer[k] + p_head[k] for k in ks), max(acts[k] for k in ks))
              for ks in per_rank if ks]
    st, ac = max(shares, key=sum)
    out[f"DGL pipelined (max over {ranks} ranks)"] = dict(
        trainable_per_stage=[p_layer[k] + p_head[k] for k in range(L)], state=st,
        activations=ac, cache=0)
    for v in out.values():
        v["total"] = v["state"] + v["activations"] + v["cache"]
    return out
