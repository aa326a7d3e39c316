"""One interface for every network the training loop and the checkpoints handle.

A :class:`~mgrit.nn.LayerParallelNet` already has it: ``is_last``, ``loss(out, target, fn)``,
``from_last(value)`` and ``comm`` (its layer communicator). A serial ``nn.Module`` (e.g. the
``nn.Sequential`` reference) gets it from the thin adapter :class:`SerialNet`, so the loop
has no branch on the kind of network.

Global keys (:func:`blocks`) are those of ``LayerParallelNet.to_serial().state_dict()``
(``"0.*"`` opening, ``"{1+k}.F.*"`` residual layer ``k``, ``"{N+1}.*"`` closing), and a serial
module's own state-dict keys: the main job's serial network and its layer-parallel network
share them, so a checkpoint of one loads into the other and into any partition.

The MGRIT views (per segment: solver results, warm-start states, options, counters) are the
functions below; they return empty lists / do nothing for serial networks. They use the public
accessors of the nn classes (``LayerParallelNet.named_global_modules``,
``LayerParallelResNet.forward_solver/backward_solver/warm_state/set_warm_state/set_options``);
the one private read left is :func:`solver_states`' (the solver's state arrays after a failed
solve; it says which public accessor would replace it).

Depends on torch, mpi4py, the solver, :mod:`mgrit.nn` and :mod:`mgrit.training.faults`.
"""
from __future__ import annotations

from typing import Callable

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from ..nn import LayerParallelNet, LayerParallelResNet, ParallelGRU
from ..nn.chains.compiled import plain_module
from .faults import instrument_resnet, instrument_solver

__all__ = ["SerialNet", "as_net", "blocks", "segments", "solver_results", "solver_options",
           "exact_tolerance", "describe_solvers", "solver_summary", "warm_states",
           "set_warm_states", "owned_points", "replace_solver", "solver_states", "instrument",
           "net_meta", "replicated_parameters"]


class SerialNet(nn.Module):
    """Adapter giving a serial module the interface of :class:`~mgrit.nn.LayerParallelNet`:
    ``is_first = is_last = True``, ``loss(out, target, fn) = fn(out, target)``,
    ``from_last(v) = v``, ``comm = COMM_SELF``. Parameters are those of ``module`` (same order).
    """

    is_first = True
    is_last = True

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.comm = MPI.COMM_SELF

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def loss(self, out: torch.Tensor, target: torch.Tensor,
             fn: Callable = F.cross_entropy) -> torch.Tensor:
        return fn(out, target)

    def from_last(self, value):
        return value


def as_net(net: nn.Module) -> nn.Module:
    """``net`` itself if it has the LayerParallelNet interface, else ``SerialNet(net)``.

    Raises:
        TypeError: ``net`` is not an ``nn.Module``, or a bare LayerParallelResNet (wrap it in
            ``LayerParallelNet(opening, resnet, closing)``, which provides the loss on the last
            layer rank).
    """
    if isinstance(net, LayerParallelResNet):
        raise TypeError("a bare LayerParallelResNet cannot be trained directly: wrap it in "
                        "mgrit.nn.LayerParallelNet(opening, resnet, closing)")
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    if all(hasattr(type(net), a) for a in ("is_last", "loss", "from_last")):
        return net
    return SerialNet(net)


def blocks(net: nn.Module) -> list:
    """This rank's ``(global key prefix, module)`` pairs (see module doc); keys do not depend
    on the partition, so checkpoints re-partition by key."""
    if isinstance(net, LayerParallelNet):
        return [(f"{name}.", m) for name, m in net.named_global_modules()]
    if isinstance(net, SerialNet):  # a torch.compile wrapper: the keys of the plain module
        return [("", plain_module(net.module))]
    return [("", plain_module(net))]


def tied_prefixes(net: nn.Module) -> dict:
    """:meth:`LayerParallelNet.tied_prefixes` (weight-tied layers' key prefixes -> their
    group's first layer's); empty for serial networks."""
    return net.tied_prefixes() if isinstance(net, LayerParallelNet) else {}


def check_tied_replicas(net: nn.Module) -> None:
    """ValueError on every rank if a segment's weight-tied replicas differ across its layer
    ranks (:meth:`LayerParallelResNet.check_tied_replicas`; collective, cheap: one
    ``allgather`` per segment with ties spanning ranks, nothing otherwise)."""
    for seg in segments(net):
        seg.check_tied_replicas()


def tied_duplicates(net: nn.Module) -> list:
    """This rank's replicas of weight-tied groups (``LayerParallelResNet(tie=...)``) spanning
    layer ranks whose group's first layer lives on another rank: that rank counts their
    (identical, summed) gradient in a global norm (the ``counted_elsewhere`` argument of
    :func:`mgrit.parallel.clip_grad_norm_`). Local."""
    out = []
    for seg in segments(net):
        tied = getattr(seg, "_tied", None)
        if tied is None:
            continue
        me = seg.comm.Get_rank()
        for g in tied.spanning:
            if g in tied.params and tied.root[g] != me:
                out.extend(tied.params[g])
    return out


def replicated_parameters(net: nn.Module) -> list:
    """This rank's parameters that every layer rank holds with identical gradients (a
    :class:`~mgrit.nn.ParallelGRU`'s weights, summed over its time ranks in backward); every
    other parameter of a network lives on one layer rank (the ``replicated`` argument of
    :func:`mgrit.parallel.clip_grad_norm_`)."""
    return [p for m in net.modules() if isinstance(m, ParallelGRU) for p in m.parameters()]


def segments(net: nn.Module) -> list:
    """The LayerParallelResNet segments of ``net`` (empty for serial networks)."""
    return list(net.segments) if isinstance(net, LayerParallelNet) else []


def net_meta(net: nn.Module) -> dict:
    """Plain description saved in checkpoints (kind, layers per segment, state shapes)."""
    segs = segments(net)
    if not segs:
        return {"kind": "serial"}
    return {"kind": "layer-parallel", "n_layers": [int(s.n_layers) for s in segs],
            "state_shape": [[int(d) for d in s.state_shape] for s in segs]}


def solver_results(net: nn.Module) -> list:
    """``[(forward, backward)]`` MGRITResults of the latest solves, one pair per segment."""
    return [(s.last_forward, s.last_backward) for s in segments(net)]


def solver_options(net: nn.Module) -> list:
    """``[(forward, backward)]`` MGRITOptions in use, one pair per segment."""
    return [(s.fwd_opts, s.bwd_opts) for s in segments(net)]


def exact_tolerance(net: nn.Module) -> float | None:
    """The forward tolerance when every segment iterates MGRIT to one (exact mode), else None."""
    tols = []
    for fwd, _ in solver_options(net):
        if fwd.tol == 0 and fwd.rtol == 0:
            return None
        tols.append(fwd.tol if fwd.tol > 0 else fwd.rtol)
    return max(tols) if tols else None


def _solvers(seg) -> tuple:
    return seg.forward_solver, seg.backward_solver


def describe_solvers(net: nn.Module) -> list:
    """One line per MGRIT solver: levels, intervals per level, relaxation, mode."""
    segs = segments(net)
    lines = []
    for k, seg in enumerate(segs):
        where = f" (segment {k + 1}/{len(segs)})" if len(segs) > 1 else ""
        for name, s in zip(("forward", "adjoint"), _solvers(seg)):
            lv, o = s.hierarchy.levels, s.options
            mode = (f"tol {o.tol:g} (exact mode, <= {o.max_iter} cycles)" if o.tol > 0
                    else f"{o.max_iter} cycle(s) (inexact)")
            lines.append(f"MGRIT {name}{where}: {len(lv)} level(s), intervals per level "
                         f"{[x.n_intervals for x in lv]}, relax {o.relax}, {mode}")
    return lines


def solver_summary(net: nn.Module) -> str | None:
    """Counters of this rank's forward solver(s) over all solves (None for serial nets)."""
    segs = segments(net)
    if not segs:
        return None
    return " || ".join(_solvers(s)[0].stats.summary() for s in segs)


def owned_points(net: nn.Module) -> list:
    """``[(lo, hi)]``: fine points of this rank's forward solver, per segment."""
    out = []
    for seg in segments(net):
        lv = _solvers(seg)[0].hierarchy.levels[0]
        out.append((lv.lo, lv.hi))
    return out


def warm_states(net: nn.Module) -> list:
    """Per segment: ``{fine point: state}`` of this rank's forward warm start, or None."""
    out = []
    for seg, (lo, _) in zip(segments(net), owned_points(net)):
        w = seg.warm_state()
        out.append(None if w is None else {lo + i: w[i].detach().cpu().clone()
                                           for i in range(w.shape[0])})
    return out


def set_warm_states(net: nn.Module, states: list) -> None:
    """Set (or clear, with None entries) each segment's forward warm-start states (tensors
    with one row per owned fine point)."""
    for seg, w in zip(segments(net), states):
        seg.set_warm_state(w)


def replace_solver(resnet: LayerParallelResNet, which: str, options) -> None:
    """Rebuild the ``"forward"`` or ``"backward"`` MGRIT solver of ``resnet`` with ``options``
    (no communication: only the local hierarchy is recomputed). Keeps the accumulated
    counters and the phase tags (:meth:`LayerParallelResNet.set_options`, then
    :func:`~mgrit.training.faults.instrument_solver` again where the old solver had tags)."""
    if which not in ("forward", "backward"):
        raise ValueError(f"which={which!r} is not allowed: use 'forward' or 'backward'")
    old = _solvers(resnet)[0 if which == "forward" else 1]
    resnet.set_options(**{which: options})
    new = _solvers(resnet)[0 if which == "forward" else 1]
    phases = getattr(old, "_layerpar_phases", None)
    if phases is not None:
        instrument_solver(new, *phases)


def solver_states(seg: LayerParallelResNet, which: str) -> tuple | None:
    """``(states, lo)``: the current fine-level states of ``seg``'s ``"forward"`` or
    ``"backward"`` solver, also after the solve raised (NaN/Inf residual); None before any
    solve. Reads the solver's private state arrays: wanted instead a public
    ``MGRIT.current_states()`` (or the partial MGRITResult attached to its exception)."""
    st = getattr(_solvers(seg)[0 if which == "forward" else 1], "_st", None)
    return (st[0].u, st[0].lv.lo) if st else None


def instrument(net: nn.Module) -> None:
    """Phase tags on the MGRIT solves of every segment (see
    :func:`mgrit.training.faults.instrument_resnet`); no-op for serial networks."""
    for seg in segments(net):
        instrument_resnet(seg)
