"""Rank 0's side of loading a checkpoint: what does not match this run
(:func:`mismatches`), and what each rank of the new grid takes (:func:`payloads`).
Pure functions of the checkpoint dict and the ranks' wishes; no communication."""
from __future__ import annotations

import torch

__all__ = ["not_resumable", "mismatches", "payloads"]

_MAX_SHOWN = 5
_DROPPED = "warm-start states missing from the checkpoint for some layers: those start cold"


def _plain(v):
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _keys(names) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def not_resumable(ckpt: dict, expect: dict) -> str | None:
    """Why ``ckpt`` cannot be resumed at all (None: it can be compared): a weights-only file
    (no ``expect`` key recorded, e.g. a run's final ``model.pt``)."""
    saved_extra = ckpt.get("extra", {})
    if expect and not any(k in saved_extra for k in expect):
        return ("is not a training checkpoint: it holds weights only, no training position "
                "(e.g. a run's final model.pt): resume from the checkpoint a training run "
                "writes (checkpoint.pt: --checkpoint-every K, Trainer(checkpoint=...))")
    return None


def mismatches(ckpt: dict, head: dict, wants: list) -> str | None:
    """Everything in which ``ckpt`` differs from this run, as one message (None if nothing).

    ``head``: ``{"net": net_meta of the model, "expect": {key: value}, "optimizer_type": name
    or None}``; ``wants``: per rank ``{"model": {key: shape}}``."""
    diffs = []
    saved_extra = ckpt.get("extra", {})
    for k, v in head["expect"].items():
        s = saved_extra.get(k, "<not recorded>")
        if _plain(s) != _plain(v):
            diffs.append(f"{k}: {s} in the checkpoint, {v} in this run")
    saved, cur = ckpt["net"], head["net"]
    if saved.get("kind") == cur.get("kind") == "layer-parallel":  # other pairs: keys decide
        for k, what in (("n_layers", "residual layers"), ("state_shape", "state shapes")):
            if _plain(saved.get(k)) != _plain(cur[k]):
                diffs.append(f"{what}: {saved.get(k)} in the checkpoint, {cur[k]} in the model")
    s_opt, c_opt = ckpt["optimizer"]["type"], head["optimizer_type"]
    layerwise = [t == "MethodOptimizer" for t in (s_opt, c_opt)]  # a TrainingMethod's view
    if s_opt is not None and c_opt is not None and layerwise[0] != layerwise[1]:
        saved_by = ("a layer-wise training method (--method sequential or decoupled)"
                    if layerwise[0] else f"one network trained with {s_opt} (--method mgrit "
                                         f"or serial)")
        this = ("a layer-wise training method" if layerwise[1]
                else f"one network trained with {c_opt}")
        return (f"the checkpoint was written by {saved_by}, this run is {this}: resume with "
                f"the method that wrote it")
    if s_opt is not None and c_opt is not None and s_opt != c_opt:
        diffs.append(f"optimizer: {s_opt} in the checkpoint, {c_opt} in this run (the saved "
                     f"state does not fit {c_opt}: resume with {s_opt})")
    if not diffs:  # parameter details only when the architecture claims to match
        wanted = {}
        for w in wants:
            wanted.update(w["model"])
        model = ckpt["model"]
        missing = set(wanted) - set(model)
        unexpected = set(model) - set(wanted)
        shapes = [k for k in sorted(set(wanted) & set(model))
                  if list(model[k].shape) != list(wanted[k])]
        if missing:
            diffs.append(f"the model has entries the checkpoint lacks: {_keys(missing)}")
        if unexpected:
            diffs.append(f"the checkpoint has entries the model lacks: {_keys(unexpected)}")
        for k in shapes[:3]:
            diffs.append(f"{k!r} has shape {tuple(model[k].shape)} in the checkpoint, "
                         f"{tuple(wanted[k])} in the model")
        if len(shapes) > 3:
            diffs.append(f"{len(shapes) - 3} more entries differ in shape")
    if not diffs:
        return None
    more = f" (and {len(diffs) - _MAX_SHOWN} more)" if len(diffs) > _MAX_SHOWN else ""
    return "; ".join(diffs[:_MAX_SHOWN]) + more


def _span(a: int, b: int) -> str:
    """'rank a' or 'ranks a..b' (inclusive)."""
    return f"rank {a}" if a == b else f"ranks {a}..{b}"


def _notes(saved_grid, new_grid, has_warm, kinds) -> list:
    (sL, sD), (L, D) = saved_grid, new_grid
    P_old, P_new = sL * sD, L * D
    notes = []
    if kinds[0] != kinds[1]:
        notes.append(f"checkpoint of a {kinds[0]} network loaded into a {kinds[1]} one (same "
                     f"global keys)")
    if (sL, sD) != (L, D):
        notes.append(f"checkpoint written on {P_old} rank(s) ({sL} layer x {sD} data), loaded "
                     f"on {P_new} ({L} x {D}): layers re-partitioned by global layer index")
    if P_new < P_old:
        notes.append(f"RNG and per-rank states of {_span(0, P_new - 1)} restored from the same "
                     f"saved ranks; those of saved {_span(P_new, P_old - 1)} are not used")
    elif P_new > P_old:
        verb = "starts" if P_new - P_old == 1 else "start"
        notes.append(f"RNG and per-rank states of {_span(0, P_old - 1)} restored from the same "
                     f"saved ranks; {_span(P_old, P_new - 1)} (new) {verb} from saved rank 0's "
                     f"states")
    if has_warm and D > sD:
        notes.append(f"warm-start states of replicas {sD}..{D - 1} (new) taken from replica 0")
    return notes


def payloads(ckpt: dict, wants: list, new_grid: tuple, restore_warm: bool, kind: str) -> list:
    """Per rank of the new grid: its model entries, optimizer state, options, warm-start
    states (per segment), RNG state, per-rank extra, the saved extra and the notes (same for
    all). ``kind``: the loading network's kind (``"serial"`` / ``"layer-parallel"``)."""
    saved_grid = tuple(ckpt["grid"])
    notes = _notes(saved_grid, new_grid, ckpt["warm"] is not None, (ckpt["net"]["kind"], kind))
    ranks = ckpt["ranks"]
    opt = ckpt["optimizer"]
    out = []
    for r, w in enumerate(wants):
        warm = [None] * len(w["points"])
        if restore_warm and ckpt["warm"] is not None:
            replica = ckpt["warm"].get(w["data_rank"], ckpt["warm"].get(0, []))
            for k, (lo, hi) in enumerate(w["points"]):
                seg = replica[k] if k < len(replica) else {}
                if all(i in seg for i in range(lo, hi)):
                    warm[k] = torch.stack([seg[i] for i in range(lo, hi)])
                elif _DROPPED not in notes:
                    notes.append(_DROPPED)
        keys = w["model"]
        src = ranks[r] if r < len(ranks) else ranks[0]
        pkeys = set(keys) | set(w.get("params", ()))  # tied parameters: canonical keys
        out.append({"model": {k: ckpt["model"][k] for k in keys},
                    "optimizer": {"state": {k: v for k, v in opt["state"].items() if k in pkeys},
                                  "groups": {k: v for k, v in opt["groups"].items()
                                             if k in pkeys}},
                    "options": ckpt["options"], "warm": warm, "rng": src["rng"],
                    "rank_extra": src["extra"], "extra": ckpt["extra"], "notes": notes,
                    "saved_grid": saved_grid})
    return out
