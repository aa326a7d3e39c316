"""The network protocol: what the training runtime (:mod:`mgrit.training`: the loop, the
checkpoints, the convergence guard, the gradient-bias monitor) asks of a network.

A network plugs into :class:`~mgrit.training.Trainer` and
:func:`~mgrit.training.checkpoint.save_checkpoint` by implementing :class:`TrainableNet`. Two
kinds of members:

**Required** (what differs between network kinds; a new network type implements these):

* ``comm`` (``mpi4py.MPI.Comm``): the layer communicator the network spans (``COMM_SELF`` for
  a serial network); the loop checks its size against the grid's ``layer_size``.
* ``is_last`` (bool): whether this rank holds the network's output.
* ``loss(out, target, fn) -> Tensor``: the scalar loss ``fn(out, target)`` on the output rank;
  on the other layer ranks a scalar whose ``backward()`` runs their part of the backward pass.
* ``from_last(value)``: the output rank's Python ``value`` on every layer rank (``value``
  itself with one rank).
* ``global_modules() -> list[(prefix, nn.Module)]``: the modules this rank holds with the key
  prefix of their parameters and buffers in the serial network (``""`` for a serial module:
  its own state-dict keys; ``"0."`` opening, ``"{1+k}.F."`` residual layer ``k``, ... for a
  :class:`~mgrit.nn.LayerParallelNet`). Checkpoints store every tensor under ``prefix + key``,
  so a checkpoint re-partitions by key and loads into the serial network. Local.
* ``tied_prefixes() -> dict[str, str]``: weight-tied layers' key prefixes -> the prefix of
  their group's first layer (checkpoints store one copy per group); ``{}`` without ties.
* ``solver_segments() -> list[LayerParallelResNet]``: the MGRIT chains of the network on this
  rank, in order (``[]`` for a network without MGRIT solves). The guard and the bias monitor
  change their solver options through :meth:`LayerParallelResNet.set_options
  <mgrit.nn.LayerParallelResNet.set_options>`; checkpoints save their options and forward
  warm starts.
* ``replicated_parameters() -> list[Parameter]``: this rank's parameters that every layer rank
  holds with identical gradients (a :class:`~mgrit.nn.ParallelGRU`'s weights); every other
  parameter lives on one layer rank (global-norm clipping counts these once).

**Provided** by :class:`NetMixin` from the required ones (inherit it and the network has
them; for a network without segments they are empty lists, None or no-ops):
:meth:`~NetMixin.checkpoint_meta`, :meth:`~NetMixin.solver_results`,
:meth:`~NetMixin.solver_options`, :meth:`~NetMixin.exact_tolerance`,
:meth:`~NetMixin.describe_solvers`, :meth:`~NetMixin.solver_summary`,
:meth:`~NetMixin.owned_points`, :meth:`~NetMixin.warm_states`,
:meth:`~NetMixin.set_warm_states`, :meth:`~NetMixin.tied_duplicates`,
:meth:`~NetMixin.check_tied_replicas`. ``NetMixin``'s defaults of the required views are
those of a module that is one piece on every rank (``global_modules``: ``[("", self)]``,
no ties, no segments, the ParallelGRU weights replicated) or, for a network that contains
networks of this protocol (a wrapper around a :class:`~mgrit.nn.LayerParallelNet`), the
composition of theirs under the wrapper's key prefixes; :class:`LayerParallelNetMixin`
overrides them for :class:`~mgrit.nn.LayerParallelNet`. Checkpoints refuse a network whose
layer ranks give the same key twice (other than declared replicated parameters).

Implementations: :class:`~mgrit.nn.LayerParallelNet` (:class:`LayerParallelNetMixin`),
:class:`~mgrit.nn.GRUSequenceClassifier`, :class:`~mgrit.training.method.TrainingMethod`
(layer-wise training) and, for any plain ``nn.Module``, the runtime's thin adapter
:class:`~mgrit.training.support.nets.SerialNet` (one rank, ``is_last = True``).

Depends on torch, mpi4py (annotations) and the public accessors of
:class:`~mgrit.nn.LayerParallelResNet` (``forward_solver``, ``backward_solver``,
``warm_state``, ``set_warm_state``, ``fwd_opts``, ``bwd_opts``, ``last_forward``,
``last_backward``, ``check_tied_replicas``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only
    from mpi4py import MPI

    from ..options import MGRITOptions
    from ..solver import MGRITResult

__all__ = ["TrainableNet", "NetMixin", "LayerParallelNetMixin", "REQUIRED", "PROVIDED", "subnets",
           "shared_parameters"]

#: The members a network type implements itself (module doc).
REQUIRED = ("comm", "is_last", "loss", "from_last", "global_modules", "tied_prefixes",
            "solver_segments", "replicated_parameters")
#: The members :class:`NetMixin` provides from the required ones.
PROVIDED = ("checkpoint_meta", "solver_results", "solver_options", "exact_tolerance",
            "describe_solvers", "solver_summary", "owned_points", "warm_states",
            "set_warm_states", "tied_duplicates", "check_tied_replicas")


@runtime_checkable
class TrainableNet(Protocol):
    """The members the training runtime uses (module doc: required ones first). ``isinstance``
    checks that they exist, not their signatures."""

    comm: MPI.Comm

    @property
    def is_last(self) -> bool: ...

    def loss(self, out: torch.Tensor, target: torch.Tensor, fn: Callable) -> torch.Tensor: ...

    def from_last(self, value: Any) -> Any: ...

    def global_modules(self) -> list: ...

    def tied_prefixes(self) -> dict: ...

    def solver_segments(self) -> list: ...

    def replicated_parameters(self) -> list: ...

    # provided by NetMixin
    def checkpoint_meta(self) -> dict: ...

    def solver_results(self) -> list: ...

    def solver_options(self) -> list: ...

    def exact_tolerance(self) -> float | None: ...

    def describe_solvers(self) -> list: ...

    def solver_summary(self) -> str | None: ...

    def owned_points(self) -> list: ...

    def warm_states(self) -> list: ...

    def set_warm_states(self, states: list) -> None: ...

    def tied_duplicates(self) -> list: ...

    def check_tied_replicas(self) -> None: ...


class NetMixin:
    """The provided members of :class:`TrainableNet`, built on the required views, and the
    defaults of those views for a network that is one piece on every rank. Mix it in before
    ``nn.Module`` (``class MyNet(NetMixin, nn.Module)``)."""

    # -- required views: defaults --------------------------------------------------------
    def global_modules(self) -> list:
        """``[("", module)]``: this module under its own state-dict keys (a
        ``torch.compile``\\ d module as the module it wraps). A network that contains
        networks of this protocol (e.g. a wrapper around a
        :class:`~mgrit.nn.LayerParallelNet` held as ``self.net``) gets their global modules
        under its own key prefix (``"net.0."``, ``"net.{1+k}.F."``, ...) and its other
        modules and own tensors under their keys (the keys of the wrapper around the serial
        network)."""
        from .chains.compiled import plain_module
        me = plain_module(self)
        if not subnets(me):
            return [("", me)]
        out: list = []
        _pieces(me, "", out)
        return out

    def tied_prefixes(self) -> dict:
        """The weight-tied prefixes of the contained networks of this protocol, under their
        key prefix (``{}`` without ties)."""
        from .chains.compiled import plain_module
        return {pre + k: pre + v for pre, sub in subnets(plain_module(self))
                for k, v in sub.tied_prefixes().items()}

    def solver_segments(self) -> list:
        """The segments of the contained networks of this protocol, in registration order
        (``[]``: no MGRIT chains)."""
        from .chains.compiled import plain_module
        return [seg for _, sub in subnets(plain_module(self)) for seg in sub.solver_segments()]

    def replicated_parameters(self) -> list:
        """The weights of every module inside that declares ``replicated_weights = True``
        (:class:`~mgrit.nn.ParallelGRU`: summed over its time ranks in backward, identical on
        every layer rank)."""
        return [p for m in self.modules() if getattr(m, "replicated_weights", False)
                for p in m.parameters()]

    # -- provided ------------------------------------------------------------------------
    def checkpoint_meta(self) -> dict:
        """Plain description saved in checkpoints: ``{"kind": "serial"}``, or
        ``{"kind": "layer-parallel", "n_layers": [per segment], "state_shape": [[...]]}``."""
        segs = self.solver_segments()
        if not segs:
            return {"kind": "serial"}
        return {"kind": "layer-parallel", "n_layers": [int(s.n_layers) for s in segs],
                "state_shape": [[int(d) for d in s.state_shape] for s in segs]}

    def solver_results(self) -> list[tuple[MGRITResult | None, MGRITResult | None]]:
        """``[(forward, backward)]`` MGRITResults of the latest solves, one pair per segment."""
        return [(s.last_forward, s.last_backward) for s in self.solver_segments()]

    def solver_options(self) -> list[tuple[MGRITOptions, MGRITOptions]]:
        """``[(forward, backward)]`` MGRITOptions in use, one pair per segment."""
        return [(s.fwd_opts, s.bwd_opts) for s in self.solver_segments()]

    def exact_tolerance(self) -> float | None:
        """The forward tolerance when every segment iterates MGRIT to one (exact mode; the
        largest of them), else None (also without segments)."""
        tols = []
        for fwd, _ in self.solver_options():
            if fwd.tol == 0 and fwd.rtol == 0:
                return None
            tols.append(fwd.tol if fwd.tol > 0 else fwd.rtol)
        return max(tols) if tols else None

    def describe_solvers(self) -> list[str]:
        """One line per MGRIT solver: levels, intervals per level, relaxation, mode."""
        segs = self.solver_segments()
        lines = []
        for k, seg in enumerate(segs):
            where = f" (segment {k + 1}/{len(segs)})" if len(segs) > 1 else ""
            for name, s in (("forward", seg.forward_solver), ("adjoint", seg.backward_solver)):
                lv, o = s.hierarchy.levels, s.options
                mode = (f"tol {o.tol:g} (exact mode, <= {o.max_iter} cycles)" if o.tol > 0
                        else f"{o.max_iter} cycle(s) (inexact)")
                lines.append(f"MGRIT {name}{where}: {len(lv)} level(s), intervals per level "
                             f"{[x.n_intervals for x in lv]}, relax {o.relax}, {mode}")
        return lines

    def solver_summary(self) -> str | None:
        """Counters of this rank's forward solver(s) over all solves (None without
        segments)."""
        segs = self.solver_segments()
        if not segs:
            return None
        return " || ".join(s.forward_solver.stats.summary() for s in segs)

    def owned_points(self) -> list[tuple[int, int]]:
        """``[(lo, hi)]``: fine points of this rank's forward solver, per segment."""
        out = []
        for seg in self.solver_segments():
            lv = seg.forward_solver.hierarchy.levels[0]
            out.append((lv.lo, lv.hi))
        return out

    def warm_states(self) -> list[dict[int, torch.Tensor] | None]:
        """Per segment: ``{fine point: state}`` (detached CPU copies, each of the segment's
        ``state_shape`` plus the batch dimension) of this rank's forward warm start, or None."""
        out = []
        for seg, (lo, _) in zip(self.solver_segments(), self.owned_points()):
            w = seg.warm_state()
            out.append(None if w is None else {lo + i: w[i].detach().cpu().clone()
                                               for i in range(w.shape[0])})
        return out

    def set_warm_states(self, states: list) -> None:
        """Set (or clear, with None entries) each segment's forward warm-start states (tensors
        with one row per owned fine point)."""
        for seg, w in zip(self.solver_segments(), states):
            seg.set_warm_state(w)

    def tied_duplicates(self) -> list[nn.Parameter]:
        """This rank's replicas of weight-tied groups (``LayerParallelResNet(tie=...)``)
        spanning layer ranks whose group's first layer lives on another rank: that rank counts
        their (identical, summed) gradient in a global norm (the ``counted_elsewhere``
        argument of :func:`mgrit.parallel.clip_grad_norm_`). Local."""
        return _tied_duplicates(self.solver_segments())

    def check_tied_replicas(self) -> None:
        """ValueError on every rank if a segment's weight-tied replicas differ across its
        layer ranks (:meth:`LayerParallelResNet.check_tied_replicas`; collective, cheap: one
        ``allgather`` per segment with ties spanning ranks, nothing otherwise)."""
        for seg in self.solver_segments():
            seg.check_tied_replicas()


def _tied_duplicates(segments) -> list:
    out = []
    for seg in segments:
        tied = getattr(seg, "_tied", None)
        if tied is None:
            continue
        me = seg.comm.Get_rank()
        for g in tied.spanning:
            if g in tied.params and tied.root[g] != me:
                out.extend(tied.params[g])
    return out


def shared_parameters(module: nn.Module) -> tuple[list, list]:
    """``(replicated, counted_elsewhere)`` of ``module`` for a global gradient norm
    (:func:`mgrit.parallel.clip_grad_norm_`): the parameters every layer rank holds with
    identical gradients, and this rank's replicas of weight-tied groups counted on another
    rank. A network of this protocol is asked (``replicated_parameters()``,
    ``tied_duplicates()``); any other module is searched for ``replicated_weights`` modules
    (:class:`~mgrit.nn.ParallelGRU`) and segments with ties. Local."""
    if isinstance(module, NetMixin) or (hasattr(module, "replicated_parameters")
                                        and hasattr(module, "tied_duplicates")):
        return list(module.replicated_parameters()), list(module.tied_duplicates())
    from .resnet import LayerParallelResNet
    rep = [p for m in module.modules() if getattr(m, "replicated_weights", False)
           for p in m.parameters()]
    return rep, _tied_duplicates([m for m in module.modules()
                                  if isinstance(m, LayerParallelResNet)])


def subnets(module: nn.Module, prefix: str = "") -> list:
    """``[(key prefix, net)]``: the outermost modules inside ``module`` (not itself) that
    implement this protocol (:class:`NetMixin`), in registration order."""
    out = []
    for name, child in module._modules.items():
        if child is None:
            continue
        if isinstance(child, NetMixin):
            out.append((f"{prefix}{name}.", child))
        else:
            out.extend(subnets(child, f"{prefix}{name}."))
    return out


class _Own(nn.Module):
    """A module's own parameters and buffers without its submodules (the same tensor
    objects, so saving and loading it reads and writes the module's)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        for n, p in module._parameters.items():
            if p is not None:
                self.register_parameter(n, p)
        for n, b in module._buffers.items():
            if b is not None:
                self.register_buffer(n, b, persistent=n not in module._non_persistent_buffers_set)


def _pieces(module: nn.Module, prefix: str, out: list) -> None:
    """Append ``(key prefix, module)`` pieces covering ``module``'s state once each: the
    protocol networks inside through their own ``global_modules()``."""
    own = _Own(module)
    if len(own.state_dict()):
        out.append((prefix, own))
    for name, child in module._modules.items():
        if child is None:
            continue
        pre = f"{prefix}{name}."
        if isinstance(child, NetMixin):
            out.extend((pre + p, m) for p, m in child.global_modules())
        elif subnets(child):
            _pieces(child, pre, out)
        else:
            out.append((pre, child))


class LayerParallelNetMixin(NetMixin):
    """:class:`TrainableNet` for :class:`~mgrit.nn.LayerParallelNet`: its global modules
    (``named_global_modules``, the keys of ``to_serial()``) and its segments."""

    def global_modules(self) -> list:
        """``[(f"{global name}.", module)]`` for this rank's modules
        (:meth:`~mgrit.nn.LayerParallelNet.named_global_modules`)."""
        return [(f"{name}.", m) for name, m in self.named_global_modules()]

    def solver_segments(self) -> list:
        """The :class:`~mgrit.nn.LayerParallelResNet` segments (``net.segments``)."""
        return list(self.segments)
