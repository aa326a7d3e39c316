"""Atomic, re-partitionable checkpoints of layer-parallel training.

One file, written by the root rank: ``torch.save`` to ``PATH.tmp``, ``fsync``, ``os.replace``
onto ``PATH``, ``fsync`` of the directory. A crash or ``kill -9`` while saving leaves the
previous ``PATH`` intact (at worst a stale ``PATH.tmp``, overwritten next time).

Contents (format version 1), every per-layer item under **global** keys so that a checkpoint
saved with ``P`` ranks loads with any other ``P'`` (layers are re-partitioned):

* ``model``: ``"{k}.{name}"`` for residual layer ``k`` (as
  :meth:`LayerParallelResNet.gather_state_dict`), ``"opening.{name}"``, ``"closing.{name}"``;
* ``optimizer``: state (momentum buffers, Adam moments, step counts) per global parameter key
  ``"resnet.{k}.{name}"`` / ``"opening.{name}"`` / ``"closing.{name}"``, plus each
  parameter's group hyper-parameters (lr, momentum, ...);
* ``rng``: torch (and CUDA), numpy and Python ``random`` states of every rank;
* ``warm``: warm-start states per global fine point (re-partitionable);
* ``options``: the forward/backward :class:`MGRITOptions` in use (a convergence guard may have
  changed them); ``extra``: the caller's dict (data position: ``epoch``, ``batch``,
  ``sampler_seed``; guard state; anything picklable), returned by :func:`load_checkpoint`.

Loading on the same ``P`` restores everything and resuming is bitwise identical to an
uninterrupted run. On another ``P`` the RNG state of rank ``r`` comes from saved rank ``r``
(rank 0's for new ranks beyond the old ``P``) and the notes returned say so.

Usage (every rank of the layer communicator)::

    save_checkpoint(os.path.join(run_dir, "ckpt.pt"), resnet, opt,
                    {"epoch": e, "batch": b + 1, "sampler_seed": seed}, comm,
                    opening=net.opening, closing=net.closing)
    ...
    extra = load_checkpoint(path, resnet, opt, comm, opening=net.opening, closing=net.closing)
    start_epoch, start_batch = extra["epoch"], extra["batch"]
"""
from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import torch
from mpi4py import MPI

from .faults import phase
from ..options import MGRITOptions

__all__ = ["save_checkpoint", "load_checkpoint", "FORMAT"]

FORMAT = "layerpar-checkpoint-1"


def _param_keys(resnet, opening, closing) -> dict:
    """id(parameter) -> global key for this rank's parameters."""
    keys = {}
    for j, s in enumerate(resnet.steps):
        for n, p in s.named_parameters():
            keys[id(p)] = f"resnet.{resnet.first + j}.{n}"
    for prefix, mod in (("opening", opening), ("closing", closing)):
        if mod is not None:
            for n, p in mod.named_parameters():
                keys.setdefault(id(p), f"{prefix}.{n}")
    return keys


def _optimizer_local(optimizer, keys) -> dict:
    if optimizer is None:
        return {"state": {}, "groups": {}}
    sd = optimizer.state_dict()
    state, groups = {}, {}
    for g, gsd in zip(optimizer.param_groups, sd["param_groups"]):
        hyper = {k: v for k, v in gsd.items() if k != "params"}
        for p, i in zip(g["params"], gsd["params"]):
            key = keys.get(id(p))
            if key is None:
                raise ValueError("the optimizer holds a parameter that is neither in the resnet "
                                 "nor in opening/closing: pass the modules it optimizes")
            groups[key] = hyper
            if i in sd["state"]:
                state[key] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                              for k, v in sd["state"][i].items()}
    return {"state": state, "groups": groups}


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _options_dict(o: MGRITOptions) -> dict:
    return {f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.init}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _dump(obj, fh) -> None:
    """Serialize ``obj`` into the open file (tests replace this to simulate slow writes)."""
    torch.save(obj, fh)


def _write_atomic(path: str, obj) -> None:
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(tmp, "wb") as fh:
        _dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _agree(comm: MPI.Comm, root: int, error, exc_type=ValueError) -> None:
    """Raise the root's error (a string) on every rank."""
    error = comm.bcast(error, root=root)
    if error:
        raise exc_type(error)


def _check_args(path, resnet, comm, root):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"checkpoint path {path!r} is not allowed: use a non-empty path")
    if not hasattr(resnet, "steps") or not hasattr(resnet, "partition"):
        raise ValueError(f"resnet must be a LayerParallelResNet, got {type(resnet).__name__}")
    comm = resnet.comm if comm is None else comm
    if comm.Get_size() != resnet.comm.Get_size():
        raise ValueError(f"comm has {comm.Get_size()} ranks but the resnet's layer communicator "
                         f"has {resnet.comm.Get_size()}: pass the layer communicator")
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < comm.Get_size():
        raise ValueError(f"root={root!r} is not allowed: use a rank 0..{comm.Get_size() - 1}")
    return os.fspath(path), comm


def save_checkpoint(path, resnet, optimizer, extra: dict | None = None, comm: MPI.Comm | None = None,
                    opening=None, closing=None, root: int = 0) -> None:
    """Save model, optimizer, RNG states, warm-start states and ``extra`` atomically (collective
    over ``comm``, the resnet's layer communicator; default ``resnet.comm``).

    Args:
        path: checkpoint file (written by ``root`` via ``PATH.tmp`` + ``os.replace``).
        resnet: this rank's :class:`~mgrit.nn.LayerParallelResNet`.
        optimizer: this rank's optimizer over its resnet layers (and opening/closing), or None.
        extra: picklable dict (data position, guard state, ...), stored as given by ``root``.
        opening, closing: the modules around the resnet on the first/last layer rank (None
            elsewhere, e.g. ``net.opening``/``net.closing`` of a LayerParallelNet).

    Raises:
        ValueError: bad arguments (every rank, before communicating); an ``OSError`` text of
            the root's write, re-raised as ``OSError`` on every rank.
    """
    path, comm = _check_args(path, resnet, comm, root)
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict or None, got {type(extra).__name__}")
    with phase("checkpoint"):
        keys = _param_keys(resnet, opening, closing)
        local = {
            "model": resnet.gather_state_dict(root=root),
            "mods": {p: {n: t.detach().cpu().clone() for n, t in m.state_dict().items()}
                     for p, m in (("opening", opening), ("closing", closing)) if m is not None},
            "optimizer": _optimizer_local(optimizer, keys),
            "rng": _rng_state(),
            "warm": None,
        }
        warm = getattr(resnet, "_warm", None)
        if warm is not None:
            lo = resnet._fsolver.hierarchy.levels[0].lo
            local["warm"] = {lo + i: warm[i].detach().cpu().clone() for i in range(warm.shape[0])}
        model = local.pop("model")
        parts = comm.gather(local, root=root)
        error = None
        if comm.Get_rank() == root:
            ckpt = {"format": FORMAT, "n_layers": resnet.n_layers, "nprocs": comm.Get_size(),
                    "state_shape": tuple(resnet.state_shape), "dtype": str(resnet.dtype),
                    "model": dict(model), "optimizer": {"state": {}, "groups": {}},
                    "rng": [p["rng"] for p in parts], "warm": None,
                    "options": {"forward": _options_dict(resnet.fwd_opts),
                                "backward": _options_dict(resnet.bwd_opts)},
                    "extra": dict(extra or {})}
            for p in parts:
                for prefix, sd in p["mods"].items():
                    ckpt["model"].update({f"{prefix}.{n}": t for n, t in sd.items()})
                ckpt["optimizer"]["state"].update(p["optimizer"]["state"])
                ckpt["optimizer"]["groups"].update(p["optimizer"]["groups"])
                if p["warm"] is not None:
                    ckpt["warm"] = ckpt["warm"] or {}
                    ckpt["warm"].update(p["warm"])
            try:
                _write_atomic(path, ckpt)
            except OSError as exc:
                error = f"could not write checkpoint {path!r}: {exc}"
        _agree(comm, root, error, OSError)


def _read(path: str):
    if not os.path.exists(path):
        return None, f"checkpoint {path!r} does not exist"
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
        return None, f"checkpoint {path!r} is not readable ({type(exc).__name__}: {exc})"
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        return None, f"checkpoint {path!r} is not a {FORMAT} file"
    return ckpt, None


def load_checkpoint(path, resnet, optimizer, comm: MPI.Comm | None = None, opening=None,
                    closing=None, root: int = 0, restore_rng: bool = True,
                    restore_warm: bool = True, restore_options: bool = True) -> dict:
    """Load a checkpoint of :func:`save_checkpoint` into this rank's layers (collective over
    the layer communicator). Works with any number of ranks: each rank takes its layers,
    their optimizer state and the warm-start states of its fine points by global index.

    Args:
        restore_rng: set this rank's RNG states (saved rank ``r``'s; rank 0's for ranks
            beyond the saved ``P``).
        restore_warm: restore warm-start states (when saved).
        restore_options: rebuild the MGRIT solvers with the saved forward/backward options
            when they differ (e.g. a guard switched to serial propagation).

    Returns:
        the saved ``extra`` dict plus ``"_notes"`` (list of strings about re-partitioning) and
        ``"_nprocs"`` (the ``P`` it was saved with).

    Raises:
        FileNotFoundError: ``path`` missing; ValueError: not a checkpoint, a different number
            of layers, state shape or dtype, or a missing layer/parameter -- on every rank.
    """
    path, comm = _check_args(path, resnet, comm, root)
    rank, P = comm.Get_rank(), comm.Get_size()
    with phase("checkpoint"):
        keys = _param_keys(resnet, opening, closing)
        lv = resnet._fsolver.hierarchy.levels[0]
        want = {"layers": [(f"{resnet.first + j}.{n}") for j, s in enumerate(resnet.steps)
                           for n in s.state_dict()],
                "mods": {p: list(m.state_dict()) for p, m in (("opening", opening), ("closing", closing))
                         if m is not None},
                "points": (lv.lo, lv.hi)}
        wants = comm.gather(want, root=root)
        ckpt, error, payloads = None, None, None
        if rank == root:
            if not os.path.exists(path):
                error = ("missing", f"checkpoint {path!r} does not exist")
            else:
                ckpt, msg = _read(path)
                if msg:
                    error = ("bad", msg)
                elif ckpt["n_layers"] != resnet.n_layers:
                    error = ("bad", f"checkpoint {path!r} has {ckpt['n_layers']} layers, the model "
                                    f"{resnet.n_layers}")
                elif tuple(ckpt["state_shape"]) != tuple(resnet.state_shape):
                    error = ("bad", f"checkpoint {path!r} has state shape {tuple(ckpt['state_shape'])}, "
                                    f"the model {tuple(resnet.state_shape)}")
                else:
                    missing = [k for w in wants for k in w["layers"] if k not in ckpt["model"]]
                    missing += [f"{p}.{n}" for w in wants for p, ns in w["mods"].items() for n in ns
                                if f"{p}.{n}" not in ckpt["model"]]
                    if missing:
                        error = ("bad", f"checkpoint {path!r} lacks {len(missing)} entries, e.g. "
                                        f"{missing[:3]}")
        error = comm.bcast(error, root=root)
        if error:
            raise (FileNotFoundError if error[0] == "missing" else ValueError)(error[1])
        if rank == root:
            old_P = ckpt["nprocs"]
            notes = []
            if old_P != P:
                notes.append(f"checkpoint saved with P={old_P}, loaded with P={P}: layers "
                             f"re-partitioned; RNG states of ranks >= {old_P} taken from rank 0")
            payloads = []
            for r, w in enumerate(wants):
                lo, hi = w["points"]
                warm = None
                if restore_warm and ckpt["warm"] is not None:
                    if all(i in ckpt["warm"] for i in range(lo, hi)):
                        warm = torch.stack([ckpt["warm"][i] for i in range(lo, hi)])
                    elif r == 0:
                        notes.append("warm-start states incomplete in the checkpoint: dropped")
                payloads.append({
                    "model": {k: ckpt["model"][k] for k in w["layers"]},
                    "mods": {p: {n: ckpt["model"][f"{p}.{n}"] for n in ns} for p, ns in w["mods"].items()},
                    "optimizer": ckpt["optimizer"],
                    "rng": ckpt["rng"][r] if r < old_P else ckpt["rng"][0],
                    "warm": warm, "options": ckpt["options"],
                    "extra": {**ckpt["extra"], "_notes": notes, "_nprocs": old_P}})
        mine = comm.scatter(payloads, root=root)
        for j, s in enumerate(resnet.steps):
            k = resnet.first + j
            s.load_state_dict({n: mine["model"][f"{k}.{n}"] for n in s.state_dict()})
        for p, m in (("opening", opening), ("closing", closing)):
            if m is not None:
                m.load_state_dict(mine["mods"][p])
        if optimizer is not None:
            _load_optimizer(optimizer, mine["optimizer"], keys)
        if restore_options:
            from .guard import _replace_solver
            for which, cur in (("forward", resnet.fwd_opts), ("backward", resnet.bwd_opts)):
                saved = MGRITOptions(**mine["options"][which])
                if _options_dict(saved) != _options_dict(cur):
                    _replace_solver(resnet, which, saved)
        if restore_warm:
            w = mine["warm"]
            resnet._warm = None if w is None else w.to(device=resnet.device, dtype=resnet.dtype)
        if restore_rng:
            _set_rng_state(mine["rng"])
        return mine["extra"]


def _load_optimizer(optimizer, saved: dict, keys: dict) -> None:
    sd = optimizer.state_dict()
    state, groups = {}, []
    for g, gsd in zip(optimizer.param_groups, sd["param_groups"]):
        hyper = {k: v for k, v in gsd.items() if k != "params"}
        for p in g["params"]:
            key = keys.get(id(p))
            if key is not None and key in saved["groups"]:
                hyper = {**hyper, **saved["groups"][key]}
                break
        ids = []
        for p, i in zip(g["params"], gsd["params"]):
            key = keys.get(id(p))
            if key is None:
                raise ValueError("the optimizer holds a parameter that is neither in the resnet "
                                 "nor in opening/closing: pass the modules it optimizes")
            if key in saved["state"]:
                state[i] = saved["state"][key]
            ids.append(i)
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
