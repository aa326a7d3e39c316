"""Residual-network weights in depth: prolongation ``N -> fN`` layers, restriction ``fN -> N``.

A forward-Euler ResNet ``x_{k+1} = x_k + h F(x_k; theta_k)``, ``h = T/N``, discretizes
``dx/dt = F(x; theta(t))`` on ``[0, T]``; layer ``k`` sits at ``t_k = k h``. Refining in depth
keeps ``T`` and the control ``theta(t)`` and divides the step: the nested iteration in depth of
Cyr, Guenther & Schroder 2019 ("Multilevel initialization for layer-parallel deep neural
network training", arXiv 1912.08974) trains a shallow network with a large step, interpolates its
weights to ``f`` times the layers at ``1/f`` the step and continues. The same operators are the
grid transfers of MG/Opt (:mod:`mgrit.multilevel.mgopt`).

Operators (factor ``f >= 1``; coarse layer ``j`` at ``t = j f h``; fine layer ``k = f j + i``,
``0 <= i < f``), applied to every parameter and floating buffer of the step modules:

* prolongation ``"constant"``: ``theta_{fj+i} = Theta_j``;
* prolongation ``"linear"`` (piecewise linear in ``t``): ``theta_{fj+i} = (1 - i/f) Theta_j +
  (i/f) Theta_{j+1}``; the last coarse interval extrapolates constantly (there is no
  ``Theta_{N_H}``);
* restriction ``"injection"``: ``Theta_j = theta_{fj}``;
* restriction ``"average"``: ``Theta_j = (1/f) sum_i theta_{fj+i}``.

Restriction after prolongation returns the coarse weights bitwise for injection after either
prolongation, and for average after constant when ``f`` is a power of two (equal terms are summed
pairwise, which is exact). A network prolonged with ``"constant"`` reproduces the coarse network's
output to ``O(h)`` for any weights (two half steps of one layer vs one full step); ``"linear"``
does so when the coarse weights are smooth in ``t`` (trained weights, not independent random ones).
Non-integer buffers are combined like parameters; integer buffers are taken from the term of
largest weight.

Networks: :class:`LayerParallelResNet`, :class:`LayerParallelNet` (any number of segments: each
segment is transferred on its own, the ordinary modules -- opening, transitions, head -- are
copied unchanged) and ``nn.Sequential`` mixing ordinary modules and ``ResidualStep`` layers
(``to_serial()`` output; a run of ``ResidualStep`` layers with one step size is a segment), in
any pairing with the same structure (a serial network holds all layers on every rank). The steps
of one segment must share one class, structure and parameter shapes, in both networks (any step
class: dense, conv, transformer).

Parallel: source and destination may be partitioned differently over the same communicator. Each
destination rank receives only the source layers its stencils touch, in one ``alltoall`` (a
gather/broadcast of the whole global state dict would move all ``N`` layers to every rank); a
serial source needs no communication. All checks are agreed over the communicator before any
weight moves, so a bad pairing raises the same ``ValueError`` on every rank.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from mpi4py import MPI
from torch import nn

from ..comm import raise_agreed
from ..grid import Partition
from ._depth_plan import Plan, View, check_pair, common_comm, param_keys
from .net import LayerParallelNet
from .resnet import LayerParallelResNet
from .steps import ResidualStep

__all__ = ["PROLONGATIONS", "RESTRICTIONS", "depth_stencil", "DepthTransfer", "transfer_weights",
           "prolong", "restrict", "total_layers"]

PROLONGATIONS = ("constant", "linear")
RESTRICTIONS = ("injection", "average")


def depth_stencil(method: str, n_src: int, n_dst: int) -> list[list[tuple[int, float]]]:
    """The operator as stencils: for each destination layer, its ``(source layer, weight)`` terms.

    Raises:
        ValueError: unknown ``method``; a prolongation whose ``n_dst`` is not a multiple of
            ``n_src``, or a restriction whose ``n_src`` is not a multiple of ``n_dst``.
    """
    for name, n in (("n_src", n_src), ("n_dst", n_dst)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r} is not allowed: use an int >= 1")
    if method in PROLONGATIONS:
        if n_dst % n_src:
            raise ValueError(f"prolongation from N={n_src} to N={n_dst} layers is not allowed: "
                             f"the fine depth must be a multiple of the coarse depth (e.g. "
                             f"{2 * n_src})")
        f = n_dst // n_src
        if method == "constant":
            return [[(k // f, 1.0)] for k in range(n_dst)]
        out = []
        for k in range(n_dst):
            j, i = divmod(k, f)
            out.append([(j, 1.0)] if i == 0 or j + 1 == n_src
                       else [(j, (f - i) / f), (j + 1, i / f)])
        return out
    if method in RESTRICTIONS:
        if n_src % n_dst:
            raise ValueError(f"restriction from N={n_src} to N={n_dst} layers is not allowed: the "
                             f"fine depth must be a multiple of the coarse depth")
        f = n_src // n_dst
        if method == "injection":
            return [[(f * j, 1.0)] for j in range(n_dst)]
        return [[(f * j + i, 1.0 / f) for i in range(f)] for j in range(n_dst)]
    raise ValueError(f"depth transfer method {method!r} is not allowed: use a prolongation "
                     f"{PROLONGATIONS} or a restriction {RESTRICTIONS}")


def _plan(src: nn.Module, dst: nn.Module, method: str) -> Plan:
    """Views, checks (agreed on every rank) and the routing plan of a transfer ``src -> dst``."""
    s, d = View(src), View(dst)
    comm = common_comm(s, d)
    check_pair(s, d, comm)
    stencils = []
    for i, (a, b) in enumerate(zip(s.segments, d.segments)):
        stencils.append(depth_stencil(method, a.n_layers, b.n_layers))
        expect = a.T / b.n_layers
        if abs(b.h - expect) > 1e-12 * max(1.0, abs(expect)):
            raise ValueError(f"destination step h={b.h!r} of segment {i} does not follow the "
                             f"depth: with T={a.T!r} and N={b.n_layers} it must be "
                             f"T/N={expect!r}")
    return Plan(s, d, stencils, comm)


def transfer_weights(src: nn.Module, dst: nn.Module, method: str) -> None:
    """Set ``dst``'s weights from ``src``'s by a prolongation (``dst`` deeper) or restriction
    (``dst`` shallower) in depth of every segment; ordinary modules are copied. Collective over
    the networks' layer communicator; the partitions may differ.

    Args:
        src, dst: :class:`LayerParallelResNet`, :class:`LayerParallelNet` or ``nn.Sequential``
            with ``ResidualStep`` layers (see the module doc), same structure and step classes;
            each ``dst`` segment must have ``h = T/N_dst`` with the ``src`` segment's ``T``.
        method: ``"constant"`` / ``"linear"`` (prolongation) or ``"injection"`` / ``"average"``
            (restriction).

    Raises:
        ValueError: an unknown method, depths that are not multiples (see
            :func:`depth_stencil`), a step size that does not follow the depth, different
            structures, step classes/shapes or ordinary modules -- the same on every rank,
            before any weight moves.
        TypeError: an unsupported network type.
    """
    plan = _plan(src, dst, method)
    values = {k: m.state_dict() for k, m in plan.src.all_modules().items()}
    targets = plan.dst.all_modules()
    out = plan.run(values, {k: m.state_dict() for k, m in targets.items()})
    for k, state in out.items():
        targets[k].load_state_dict(state)


class DepthTransfer:
    """A depth transfer as a linear map of parameter-shaped tensors (weights, gradients,
    corrections), for MG/Opt: ``DepthTransfer(coarse, fine, "constant")`` is ``P``,
    ``DepthTransfer(fine, coarse, "average")`` is ``R``, and ``P.adjoint()`` is ``P^T``.

    Args:
        src, dst: the networks (see :func:`transfer_weights`); only their structure is used.
        method: as in :func:`transfer_weights`.

    Calling it with tensors aligned with ``list(src.parameters())`` on this rank returns new
    tensors aligned with ``list(dst.parameters())`` (collective). Parameters that are not part of
    a residual step or an ordinary module, and parameters shared between modules, raise
    ValueError (every rank).
    """

    def __init__(self, src: nn.Module, dst: nn.Module, method: str):
        self._plan = _plan(src, dst, method)
        (self._src_keys, e1), (self._dst_keys, e2) = (param_keys(self._plan.src),
                                                      param_keys(self._plan.dst))
        raise_agreed(MPI.COMM_SELF if self._plan.comm is None else self._plan.comm, e1 or e2)
        self._dst_like = list(dst.parameters())
        self._src_like = list(src.parameters())
        self.method = method

    def adjoint(self) -> "DepthTransfer":
        """The transpose ``dst -> src`` (``<T u, g> = <u, T^* g>`` with the plain dot product of
        all parameters)."""
        t = DepthTransfer.__new__(DepthTransfer)
        t._plan = self._plan.transposed()
        t._src_keys, t._dst_keys = self._dst_keys, self._src_keys
        t._src_like, t._dst_like = self._dst_like, self._src_like
        t.method = self.method + "^T"
        return t

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = list(tensors)
        if len(tensors) != len(self._src_keys):
            raise ValueError(f"got {len(tensors)} tensors: expected one per source parameter "
                             f"of this rank ({len(self._src_keys)})")
        values: dict = {}
        for (key, name), t, p in zip(self._src_keys, tensors, self._src_like):
            if t.shape != p.shape:
                raise ValueError(f"tensor for {key}.{name} has shape {tuple(t.shape)}, the "
                                 f"parameter {tuple(p.shape)}")
            values.setdefault(key, {})[name] = t.detach()
        like: dict = {}
        for (key, name), p in zip(self._dst_keys, self._dst_like):
            like.setdefault(key, {})[name] = p.detach()
        out = self._plan.run(values, like)
        return [out[key][name] for key, name in self._dst_keys]


def total_layers(model: nn.Module) -> int:
    """Number of residual layers of all segments (collective for a :class:`LayerParallelNet`)."""
    return sum(seg.n_layers for seg in View(model).segments)


def _rebuilt_segment(seg: LayerParallelResNet, n_new: int, overrides: dict) -> LayerParallelResNet:
    P = seg.comm.Get_size()
    raise_agreed(seg.comm, None if n_new >= P else
                 f"{n_new} layers cannot be split over {P} ranks: every rank needs a layer")
    inexact = seg.fwd_opts.tol == 0 and seg.fwd_opts.rtol == 0
    kw = dict(T=seg.T, comm=seg.comm, forward=seg.fwd_opts, backward=seg.bwd_opts,
              adjoint=seg.adjoint, warm_start_adjoint=seg.warm_start_adjoint,
              spatial=seg.spatial,
              # an explicit choice is kept; the default follows the (possibly new) options
              warm_start=None if seg.warm_start == inexact else seg.warm_start)
    kw.update(overrides)
    part = kw.pop("partition", None) or Partition.even(n_new, P)
    a, b = part.block(seg.comm.Get_rank())
    steps = [copy.deepcopy(seg.steps[0]) for _ in range(a, min(b, n_new))]
    return LayerParallelResNet(steps, n_new, seg.state_shape, partition=part, **kw)


def _rebuilt(model: nn.Module, depth, overrides: dict) -> nn.Module:
    """A network of ``model``'s structure with segment ``s`` of ``depth(s, n_s)`` layers (its
    weights are set by the caller)."""
    view = View(model)
    new = [depth(s, seg.n_layers) for s, seg in enumerate(view.segments)]
    if isinstance(model, nn.Sequential):
        if overrides:
            raise ValueError(f"options {sorted(overrides)} apply to layer-parallel networks only")
        layers = []
        for kind, i in view.order:
            if kind == "module":
                layers.append(copy.deepcopy(view.modules[(kind, i)]))
                continue
            seg, n = view.segments[i], new[i]  # h / f or h * f: exact for powers of two
            m = seg.n_layers
            h = seg.h / (n // m) if n % m == 0 else seg.h * (m // n)
            layers += [ResidualStep(copy.deepcopy(view.layers[(i, 0)]), h) for _ in range(n)]
        return nn.Sequential(*layers)
    if isinstance(model, LayerParallelResNet):
        return _rebuilt_segment(model, new[0], overrides)
    parts = []
    for kind, i in view.order:  # LayerParallelNet: ordinary modules from the rank running them
        if kind == "module":
            key = (kind, i)
            parts.append(copy.deepcopy(view.comm.bcast(view.modules.get(key),
                                                       root=view.owners[key])))
        else:
            parts.append(_rebuilt_segment(view.segments[i].module, new[i], overrides))
    return LayerParallelNet(*parts)


def _check_factor(factor) -> None:
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"factor={factor!r} is not allowed: use an int >= 1")


def prolong(model: nn.Module, factor: int = 2, method: str = "constant", **overrides) -> nn.Module:
    """A new network of the same kind whose segments have ``factor`` times the layers at
    ``1/factor`` the step, weights prolonged (Cyr et al. 2019's refinement step). Collective for
    layer-parallel networks.

    Args:
        model: see :func:`transfer_weights`.
        factor: int ``>= 1`` (default 2).
        method: ``"constant"`` (default) or ``"linear"``.
        **overrides: constructor arguments of the new :class:`LayerParallelResNet` segments
            (``forward``, ``backward``, ``partition``, ``warm_start``, ...; default: the old
            segment's, even partition).

    Raises:
        ValueError: bad ``factor`` or ``method`` (same on every rank).
    """
    if method not in PROLONGATIONS:
        raise ValueError(f"prolongation method {method!r} is not allowed: use one of "
                         f"{PROLONGATIONS}")
    _check_factor(factor)
    fine = _rebuilt(model, lambda s, n: n * factor, overrides)
    transfer_weights(model, fine, method)
    return fine


def restrict(model: nn.Module, factor: int = 2, method: str = "average", **overrides) -> nn.Module:
    """A new network whose segments have ``1/factor`` the layers at ``factor`` times the step,
    weights restricted. Arguments as :func:`prolong`; ``method`` ``"average"`` (default) or
    ``"injection"``.

    Raises:
        ValueError: bad ``factor`` or ``method``, a segment depth not divisible by ``factor``,
            or fewer coarse layers than layer ranks (same on every rank).
    """
    if method not in RESTRICTIONS:
        raise ValueError(f"restriction method {method!r} is not allowed: use one of "
                         f"{RESTRICTIONS}")
    _check_factor(factor)

    def depth(s, n):
        if n % factor:
            raise ValueError(f"restriction of N={n} layers (segment {s}) by factor {factor} is "
                             f"not allowed: the depth must be divisible by the factor")
        return n // factor

    coarse = _rebuilt(model, depth, overrides)
    transfer_weights(model, coarse, method)
    return coarse
