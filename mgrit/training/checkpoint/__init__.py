"""Atomic, re-partitionable checkpoints of training (layer-parallel, serial, data-parallel).

One file (:mod:`~mgrit.training.checkpoint.io`: plain contents, atomic write, loaded with
``weights_only=True``), written by rank 0 of the grid. Contents (format 2), every per-layer
item under a **global** key (``net.global_modules()``, :mod:`mgrit.nn.protocol`), so a
checkpoint saved on ``P_L x P_D`` ranks loads on any other grid (layers are re-partitioned):

* ``model``: weights and buffers under the keys of ``net.to_serial().state_dict()`` (``"0.*"``
  opening, ``"{1+k}.F.*"`` layer ``k``, ``"{N+1}.*"`` closing; a serial network's own keys,
  so the main job's serial and layer-parallel networks load each other's checkpoints), from
  replica 0;
* ``optimizer``: its class name, per-parameter state and group hyper-parameters by key;
* ``net``: kind, layers and state shape per segment; ``grid``: ``P_L``, ``P_D``;
* ``options``: forward/backward MGRIT options per segment (a guard may have changed them);
* ``warm``: warm-start states per replica, segment and global fine point;
* ``ranks``: per rank the torch/numpy/Python RNG states and the caller's ``rank_extra``;
* ``extra``: the caller's dict (data position, history, ...), plain contents only.

Every failure while saving -- on any rank, of any type (torch's serializer raises
``RuntimeError`` when a file-size limit is hit mid-write) -- reaches every rank as one
:class:`CheckpointError` (one gather and one broadcast), and the previous file stays intact.
Loading checks the file, the caller's ``expect`` values (e.g. the training data), the kind of
network, layer count, parameter keys and shapes and the optimizer type on rank 0 and raises
the same ``ValueError`` on every rank before anything is changed.

Usage (every rank of the grid)::

    save_checkpoint(path, net, optimizer, grid, extra={"epoch": e, "batch": b})
    loaded = load_checkpoint(path, net, optimizer, grid)
    loaded.extra["epoch"], loaded.notes
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from ...collective import agreed, rendezvous
from ...options import MGRITOptions
from .io import FORMAT, check_plain, read_file, rng_state, set_rng_state, write_atomic
from .match import mismatches, not_resumable, payloads
from ..support import interrupts
from ..support.faults import phase
from ...nn.net import alias_tied, tied_conflict, tied_source
from ..support.nets import as_net
from ..support.solvers import replace_solver

__all__ = ["save_checkpoint", "load_checkpoint", "LoadedCheckpoint", "CheckpointError", "FORMAT"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (raised on every rank; the previous file is intact)."""


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns (identical on every rank except ``rank_extra``).

    Attributes:
        extra: the saved ``extra`` dict. rank_extra: this rank's saved ``rank_extra`` (saved
            rank ``r``'s, rank 0's for ranks beyond the saved grid; see ``notes``).
        notes: what loading on another grid changed (re-partitioned layers, RNG states).
        saved_grid: ``(P_L, P_D)`` of the run that wrote it. path: the file.
    """

    extra: dict
    rank_extra: dict
    notes: list = field(default_factory=list)
    saved_grid: tuple = (1, 1)
    path: str = ""


def _grid_info(grid):
    if grid is None:
        return MPI.COMM_SELF, 0, 0, 1, 1
    return grid.comm, grid.layer_rank, grid.data_rank, grid.layer_size, grid.data_size


def _check_path(path) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise agreed(ValueError(f"checkpoint path {path!r} is not allowed: use a non-empty "
                                f"path"))
    return os.path.abspath(os.fspath(path))


def _describe(exc: BaseException, rank: int) -> str:
    return f"rank {rank}: {type(exc).__name__}: {' '.join(str(exc).split())}"


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
                raise ValueError("the optimizer holds a parameter that is not part of the "
                                 "network: pass the network it optimizes")
            groups[key] = hyper
            if i in sd["state"]:
                state[key] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                              for k, v in sd["state"][i].items()}
    return {"state": state, "groups": groups}


def _param_keys(net) -> dict:
    """Global key of each of this rank's parameters; a weight-tied parameter gets its group's
    first layer's key (the same on every rank holding it, whatever the partition)."""
    tied = net.tied_prefixes()
    return {id(p): _canonical(prefix + n, tied) for prefix, m in net.global_modules()
            for n, p in m.named_parameters()}


def _canonical(key: str, tied: dict) -> str:
    src = tied_source(key, tied)
    return key if src is None else src


def _local_part(net, optimizer, grid, rank_extra) -> dict:
    comm, lrank, drank, _, _ = _grid_info(grid)
    part = {"rng": rng_state(), "extra": dict(rank_extra or {}), "data_rank": drank,
            "model": None, "optimizer": None, "warm": None}
    if drank == 0:
        copies, model = {}, {}  # one copy of a tensor listed under several keys (tied)
        for prefix, m in net.global_modules():
            for n, t in m.state_dict(keep_vars=True).items():  # the tensors: stable ids
                if id(t) not in copies:
                    copies[id(t)] = t.detach().cpu().clone()
                model[prefix + n] = copies[id(t)]
        part["model"] = model
        keys = _param_keys(net)
        part["optimizer"] = _optimizer_local(optimizer, keys)
        # keys every layer rank may hold (identical replicas): not a collision when they meet
        part["replicated"] = sorted({keys[id(p)] for p in net.replicated_parameters()
                                     if id(p) in keys})
    ws = net.warm_states()
    if any(w is not None for w in ws):
        part["warm"] = ws
    if comm.Get_rank() == 0:
        part["head"] = {"net": net.checkpoint_meta(), "tied": net.tied_prefixes(),
                        "optimizer_type": None if optimizer is None else type(optimizer).__name__,
                        "options": [{"forward": _options_dict(f), "backward": _options_dict(b)}
                                    for f, b in net.solver_options()]}
    check_plain(part, f"rank {comm.Get_rank()}'s part of the checkpoint")
    return part


def _options_dict(o: MGRITOptions) -> dict:
    return {f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.init}


def save_checkpoint(path, net, optimizer, grid=None, extra: dict | None = None,
                    rank_extra: dict | None = None) -> None:
    """Save model, optimizer, RNG states, warm-start states and ``extra`` atomically
    (collective over ``grid.comm``; ``grid=None``: one process).

    Args:
        path: the checkpoint file (written by grid rank 0 via ``PATH.tmp`` + ``os.replace``).
        net: this rank's network (LayerParallelNet or a serial module).
        optimizer: this rank's optimizer over ``net``'s parameters, or None.
        grid: the :class:`~mgrit.parallel.ProcessGrid` of the run (replica 0's model is saved).
        extra: plain dict (tensors, dict/list/tuple, str/int/float/bool/None), rank 0's kept.
        rank_extra: plain dict kept per rank (e.g. callback states).

    Raises:
        ValueError: a bad path (every rank, before communicating).
        CheckpointError: any failure on any rank while preparing or writing (every rank).
        ~mgrit.collective.CollectiveTimeout: ranks of the grid that never called it within
            :func:`~mgrit.collective.collective_timeout` (named).
        KeyboardInterrupt: Ctrl-C cut the write (every rank; the message says the previous
            file is intact); with :func:`mgrit.training.support.interrupts.install` the write
            ends first and the interrupt follows at the next check.
    """
    path = _check_path(path)
    comm = _grid_info(grid)[0]
    with interrupts.deferred(comm):  # a Ctrl-C waits for the write to end (where installed)
        _save(path, comm, net, optimizer, grid, extra, rank_extra)


def _save(path, comm, net, optimizer, grid, extra, rank_extra) -> None:
    rendezvous(comm, "saving a checkpoint")  # every rank, or the missing ones named
    net = as_net(net)
    rank = comm.Get_rank()
    failure, local, error = None, None, None
    try:
        with phase("checkpoint"):
            local = _local_part(net, optimizer, grid, rank_extra)
            if rank == 0:
                check_plain(extra or {}, "extra")
    except Exception as exc:  # noqa: BLE001 - any failure must reach every rank
        failure, local = exc, None
    parts = comm.gather((None if failure is None else _describe(failure, rank), local), root=0)
    stop = None
    if rank == 0:
        errors = [e for e, _ in parts if e]
        error = "; ".join(errors) or None
        if error is None:
            try:
                write_atomic(path, _assemble(parts, grid, extra))
            except KeyboardInterrupt as exc:  # not deferred: said on every rank
                stop = str(exc) or f"the checkpoint write to {path} was interrupted"
            except Exception as exc:  # noqa: BLE001 - e.g. RuntimeError of torch's writer
                failure, error = exc, _describe(exc, rank)
    error, stop = comm.bcast((error, stop), root=0)
    if stop:
        raise KeyboardInterrupt(stop)
    if error:
        with phase("checkpoint"):
            raise agreed(CheckpointError(f"checkpoint {path!r} was not written ({error}); "
                                         f"the previous checkpoint file, if any, is "
                                         f"unchanged")) from failure


def _assemble(parts, grid, extra) -> dict:
    _, _, _, P_L, P_D = _grid_info(grid)
    head = parts[0][1]["head"]
    ckpt = {"format": FORMAT, "grid": [P_L, P_D], "net": head["net"], "model": {},
            "optimizer": {"type": head["optimizer_type"], "state": {}, "groups": {}},
            "options": head["options"], "warm": None, "ranks": [], "extra": dict(extra or {})}
    tied = head.get("tied") or {}
    _refuse_collisions(parts)
    for _, p in parts:
        ckpt["ranks"].append({"rng": p["rng"], "extra": p["extra"]})
        if p["model"] is not None:
            ckpt["model"].update(p["model"])
            ckpt["optimizer"]["state"].update(p["optimizer"]["state"])
            ckpt["optimizer"]["groups"].update(p["optimizer"]["groups"])
        if p["warm"] is not None:
            ckpt["warm"] = ckpt["warm"] or {}
            merged = ckpt["warm"].setdefault(p["data_rank"], [{} for _ in p["warm"]])
            for k, w in enumerate(p["warm"]):
                merged[k].update(w or {})
    alias_tied(ckpt["model"], tied)  # weight-tied layers: one tensor object, saved once
    return ckpt


def _refuse_collisions(parts) -> None:
    """ValueError naming the keys that two layer ranks both give (other than declared
    replicated parameters): their ``global_modules()`` are not global keys, and merging them
    would keep one rank's tensors and drop the other's."""
    owner, clashes = {}, {}
    for r, (_, p) in enumerate(parts):
        if p is None or p["model"] is None:
            continue
        shared = set(p.get("replicated", ()))
        for key in p["model"]:
            if key in owner and not (key in shared and key in owner[key][1]):
                clashes.setdefault(key, [owner[key][0]]).append(r)
            else:
                owner.setdefault(key, (r, shared))
    if clashes:
        named = ", ".join(f"{k!r} (ranks {v})" for k, v in list(clashes.items())[:6])
        more = f" and {len(clashes) - 6} more" if len(clashes) > 6 else ""
        raise ValueError(f"{len(clashes)} key(s) of the network's global_modules() are given by "
                         f"several layer ranks: {named}{more}; a checkpoint would keep one "
                         f"rank's tensors and drop the others'. global_modules() must list "
                         f"each module under its key in the serial network (NetMixin's "
                         f"default, [('', self)], is for a network that is one piece on every "
                         f"rank; a network containing a LayerParallelNet gets the keys of its "
                         f"parts; parameters every layer rank holds with identical values must "
                         f"be declared in replicated_parameters())")


def load_checkpoint(path, net, optimizer, grid=None, *, expect: dict | None = None,
                    restore_rng: bool = True, restore_warm: bool = True,
                    restore_options: bool = True) -> LoadedCheckpoint:
    """Load a checkpoint of :func:`save_checkpoint` into this rank's part of ``net`` and
    ``optimizer`` (collective over ``grid.comm``), on any grid.

    Args:
        expect: ``{key: value}`` that must equal the saved ``extra[key]`` (e.g. a description
            of the training data, the batch size); differences are named in the error.
        restore_rng: set this rank's RNG states (saved rank ``r``'s; rank 0's for new ranks).
        restore_warm: restore the forward warm-start states (when saved).
        restore_options: rebuild the MGRIT solvers with the saved options when they differ
            (e.g. a guard switched to serial propagation); the differences are named in
            ``notes``.

    Raises:
        FileNotFoundError: ``path`` missing. ValueError: not a layerpar checkpoint, a file
            holding objects other than tensors and plain containers (refused, nothing run),
            or a checkpoint that does not match: ``expect``, kind of network, layer count,
            parameter keys/shapes, optimizer type -- the same message on every rank.
    """
    path = _check_path(path)
    net = as_net(net)
    comm, lrank, drank, P_L, P_D = _grid_info(grid)
    rendezvous(comm, "loading a checkpoint")  # every rank, or the missing ones named
    rank = comm.Get_rank()
    keys = _param_keys(net)
    want = {"model": {prefix + n: list(t.shape) for prefix, m in net.global_modules()
                      for n, t in m.state_dict().items()},
            "points": net.owned_points(), "data_rank": drank,
            "params": sorted(set(keys.values())),
            "replicated": sorted({keys[id(p)] for p in net.replicated_parameters()
                                  if id(p) in keys})}
    wants = comm.gather(want, root=0)
    error, plans = None, None
    if rank == 0:
        try:
            _refuse_collisions([(None, w if w["data_rank"] == 0 else {"model": None})
                                for w in wants])
        except ValueError as exc:
            error = ("bad", f"checkpoint {path!r} cannot be loaded into this network: {exc}")
    if rank == 0 and error is None:
        ckpt, error = read_file(path)
        if error is None:
            head = {"net": net.checkpoint_meta(), "expect": dict(expect or {}),
                    "optimizer_type": None if optimizer is None else type(optimizer).__name__}
            bad = mismatches(ckpt, head, wants) or tied_conflict(ckpt["model"], net.tied_prefixes())
            if bad:
                error = ("bad", f"checkpoint {path!r} does not match this run: {bad}")
            if not_resumable(ckpt, head["expect"]):
                error = ("bad", f"{path!r} {not_resumable(ckpt, head['expect'])}")
        if error is None:
            plans = payloads(ckpt, wants, (P_L, P_D), restore_warm, net.checkpoint_meta()["kind"])
    error = comm.bcast(error, root=0)
    if error:
        raise agreed((FileNotFoundError if error[0] == "missing" else ValueError)(error[1]))
    mine = comm.scatter(plans, root=0)
    failure = None
    try:
        _apply(mine, net, optimizer, restore_rng, restore_warm, restore_options)
    except Exception as exc:  # noqa: BLE001 - agreed below, so no rank goes on alone
        failure = exc
    errors = comm.allgather(None if failure is None else _describe(failure, rank))
    if any(errors):
        raise agreed(ValueError(f"checkpoint {path!r} could not be loaded: "
                                + "; ".join(e for e in errors if e))) from failure
    return LoadedCheckpoint(extra=mine["extra"], rank_extra=mine["rank_extra"],
                            notes=mine["notes"], saved_grid=tuple(mine["saved_grid"]), path=path)


def _apply(mine, net, optimizer, restore_rng, restore_warm, restore_options) -> None:
    for prefix, m in net.global_modules():
        m.load_state_dict({n: mine["model"][prefix + n] for n in m.state_dict()})
    if optimizer is not None:
        _load_optimizer(optimizer, mine["optimizer"], _param_keys(net))
    segs = net.solver_segments()
    if restore_options and len(mine["options"]) == len(segs):
        kept = []
        for k, (seg, saved_k, current) in enumerate(zip(segs, mine["options"],
                                                        net.solver_options())):
            for which, cur in zip(("forward", "backward"), current):
                saved = MGRITOptions(**saved_k[which])
                a, b = _options_dict(saved), _options_dict(cur)
                if a != b:
                    replace_solver(seg, which, saved)
                    seg_name = f"segment {k} " if len(segs) > 1 else ""
                    kept.append(f"{seg_name}{which} " + ", ".join(
                        f"{n} {a[n]} (this run: {b[n]})" for n in a if a[n] != b.get(n)))
        if kept:  # (the same on every rank: the options are global)
            mine["notes"].append(f"the checkpoint's MGRIT options continue (a convergence "
                                 f"guard or bias monitor may have changed them): "
                                 f"{'; '.join(kept)}")
    if restore_warm and segs:
        net.set_warm_states(mine["warm"])
    if restore_rng:
        set_rng_state(mine["rng"])


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
                raise ValueError("the optimizer holds a parameter that is not part of the "
                                 "network: pass the network it optimizes")
            if key in saved["state"]:
                state[i] = saved["state"][key]
            ids.append(i)
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
