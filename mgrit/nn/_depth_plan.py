"""Internals of :mod:`mgrit.nn.depth`: a network seen as segments of residual layers and
ordinary modules in order (:class:`View`), the agreed structure/signature checks
(:func:`check_pair`), and the routing of per-layer tensors between differently partitioned ranks
(:class:`Plan`: one ``alltoall`` carrying only the layers each destination rank's stencils
touch).

Keys: layer ``k`` of segment ``s`` is ``(s, k)``; the ``i``-th ordinary module (counted over the
whole network, in order) is ``("module", i)`` -- both independent of depths and rank counts, so
a network and its ``to_serial()`` copy have the same keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from mpi4py import MPI
from torch import nn

from ..grid import Partition
from .net import LayerParallelNet
from .resnet import LayerParallelResNet
from .steps import ResidualStep

__all__ = ["View", "Segment", "Plan", "check_pair", "param_keys"]


@dataclass
class Segment:
    """One chain of residual layers: depth, step, final time, ownership (``None``: serial,
    every rank holds every layer) and the segment module (layer-parallel only)."""

    n_layers: int
    h: float
    T: float
    partition: Partition | None = None
    module: LayerParallelResNet | None = None


def _signature(module: nn.Module) -> tuple:
    """Class, structure (``repr``: submodules and their settings) and state shapes/dtypes."""
    return (type(module).__qualname__, repr(module),
            tuple((n, tuple(t.shape), str(t.dtype)) for n, t in module.state_dict().items()))


class View:
    """A network as ``order`` (``("segment", s)`` / ``("module", i)`` entries), ``segments``,
    this rank's ``layers`` ``{(s, k): F}`` and ordinary ``modules`` ``{("module", i): module}``,
    and ``owners`` of the ordinary modules (rank, ``None`` for every rank). Collective for a
    :class:`LayerParallelNet` (one small ``allgather`` finds which rank runs which module)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: dict = {}
        self.modules: dict = {}
        self.owners: dict = {}
        if isinstance(model, LayerParallelNet):
            self._net(model)
        elif isinstance(model, LayerParallelResNet):
            self.comm, self.order = model.comm, [("segment", 0)]
            self._segments([model])
        elif isinstance(model, nn.Sequential):
            self._sequential(model)
        else:
            raise TypeError(f"depth transfer of a {type(model).__name__} is not supported: use a "
                            f"LayerParallelResNet, LayerParallelNet or nn.Sequential with "
                            f"ResidualStep layers")

    def _segments(self, segs) -> None:
        self.segments = [Segment(s.n_layers, s.h, s.T, s.partition, s) for s in segs]
        for i, seg in enumerate(segs):
            self.layers.update({(i, seg.first + j): f for j, f in enumerate(seg.steps)})

    def _net(self, net: LayerParallelNet) -> None:
        """Global order from the serial indices of the ordinary modules (``"{o}"`` in
        :meth:`LayerParallelNet.named_global_modules`) gathered from every rank."""
        self.comm = net.comm
        segs = list(net.segments)
        self._segments(segs)
        mine = {int(name): m for name, m in net.named_global_modules() if not name.endswith(".F")}
        held = sorted((o, r) for r, got in enumerate(self.comm.allgather(sorted(mine)))
                      for o in got)
        index = {o: i for i, (o, _) in enumerate(held)}
        self.owners = {("module", i): r for i, (_, r) in enumerate(held)}
        self.modules = {("module", index[o]): m for o, m in mine.items()}
        self.order, pos, s = [], 0, 0
        while s < len(segs) or pos in index:
            if pos in index:
                self.order.append(("module", index[pos]))
                pos += 1
            else:
                self.order.append(("segment", s))
                pos += segs[s].n_layers
                s += 1

    def _sequential(self, seq: nn.Sequential) -> None:
        """Segments: maximal runs of ``ResidualStep`` layers with one step size."""
        self.comm, self.order, self.segments = None, [], []
        runs: list[list[ResidualStep]] = []
        for m in seq:
            if isinstance(m, ResidualStep):
                if self.order and self.order[-1][0] == "segment" and runs[-1][0].h == m.h:
                    runs[-1].append(m)
                    continue
                runs.append([m])
                self.order.append(("segment", len(runs) - 1))
            else:
                key = ("module", len(self.modules))
                self.modules[key], self.owners[key] = m, None
                self.order.append(key)
        if not runs:
            raise ValueError("depth transfer needs residual layers: the nn.Sequential has no "
                             "ResidualStep")
        for s, run in enumerate(runs):
            h = run[0].h
            self.segments.append(Segment(len(run), h, h * len(run)))
            self.layers.update({(s, k): step.F for k, step in enumerate(run)})

    def owner(self, key) -> int | None:
        """Rank holding layer/module ``key``; ``None``: every rank (a serial network)."""
        if key[0] == "module":
            return self.owners[key]
        part = self.segments[key[0]].partition
        return None if part is None else part.owner(key[1])

    def all_modules(self) -> dict:
        return {**self.layers, **self.modules}


def common_comm(src: View, dst: View) -> MPI.Comm | None:
    comms = [v.comm for v in (src, dst) if v.comm is not None]
    if len(comms) == 2 and MPI.Comm.Compare(comms[0], comms[1]) not in (MPI.IDENT, MPI.CONGRUENT):
        raise ValueError("the two networks live on different communicators: depth transfer "
                         "needs both on the same layer communicator (or one serial)")
    return comms[0] if comms else None


def check_pair(src: View, dst: View, comm) -> None:
    """Agree on structure and signatures over ``comm``; raise the same ValueError on every
    rank (one ``allgather``)."""
    def sigs(view):
        out: dict = {}
        for (s, _), m in view.layers.items():
            out.setdefault(s, set()).add(_signature(m))
        return out

    local = (sigs(src), sigs(dst), {k: _signature(m) for k, m in src.modules.items()},
             {k: _signature(m) for k, m in dst.modules.items()})
    parts = [local] if comm is None or comm.Get_size() == 1 else comm.allgather(local)
    ssig, dsig, smod, dmod = {}, {}, {}, {}
    for a, b, c, d in parts:
        for s, v in a.items():
            ssig.setdefault(s, set()).update(v)
        for s, v in b.items():
            dsig.setdefault(s, set()).update(v)
        smod.update(c)
        dmod.update(d)

    def short(sig):
        return f"{sig[0]} with state {list(sig[2])}"

    error = None
    if src.order != dst.order:
        error = (f"the networks' structures differ: source {src.order}, destination "
                 f"{dst.order} (segments of residual layers and ordinary modules, in order)")
    for s in sorted(ssig) if error is None else ():
        for which, got in (("source", ssig[s]), ("destination", dsig[s])):
            if len(got) > 1:
                error = (f"the {which} network's residual steps in segment {s} differ in class, "
                         f"structure or parameter shapes ({'; '.join(sorted(map(short, got)))}): "
                         f"depth transfer needs one step class with equal shapes per segment")
                break
        if error is None and ssig[s] != dsig[s]:
            error = (f"step classes/shapes differ between source ({short(next(iter(ssig[s])))}) "
                     f"and destination ({short(next(iter(dsig[s])))}) in segment {s}")
        if error:
            break
    for key in sorted(smod) if error is None else ():
        if smod[key] != dmod.get(key, smod[key]):
            error = (f"ordinary module {key[1]} differs: source {short(smod[key])}, destination "
                     f"{short(dmod[key])}")
            break
    if error is not None:
        raise ValueError(error)


def _combine(terms, values: dict, like: torch.Tensor, device) -> torch.Tensor:
    """``sum_w w * values[src]`` over ``terms`` on ``device`` (a single unit term is a copy;
    equal weights: pairwise sum times the weight, exact for equal terms and power-of-two
    counts; no terms: zeros like ``like``)."""
    if not terms:
        return torch.zeros_like(like)
    ts = [values[s].to(device) for s, _ in terms]
    ws = [w for _, w in terms]
    if not ts[0].is_floating_point() and not ts[0].is_complex():
        return ts[max(range(len(ws)), key=ws.__getitem__)].clone()
    if len(ts) == 1 and ws[0] == 1.0:
        return ts[0].clone()
    if all(w == ws[0] for w in ws):
        while len(ts) > 1:
            ts = [ts[i] + ts[i + 1] if i + 1 < len(ts) else ts[i] for i in range(0, len(ts), 2)]
        return ts[0] * ws[0]
    acc = ts[0] * ws[0]
    for t, w in zip(ts[1:], ws[1:]):
        acc = acc + t * w
    return acc


class Plan:
    """Stencils over all keys (``{dst key: [(src key, weight)]}``; ordinary modules: identity)
    and the routing of values between ranks."""

    def __init__(self, src: View, dst: View, stencils: list, comm):
        """``stencils[s]``: segment ``s``'s stencil (:func:`mgrit.nn.depth.depth_stencil`)."""
        self.src, self.dst, self.comm = src, dst, comm
        self.stencil = {(s, k): [((s, j), w) for j, w in terms]
                        for s, st in enumerate(stencils) for k, terms in enumerate(st)}
        self.stencil.update({key: [(key, 1.0)] for key in dst.owners})

    def transposed(self) -> "Plan":
        t = Plan.__new__(Plan)
        t.src, t.dst, t.comm = self.dst, self.src, self.comm
        rows: dict = {(s, k): [] for s, seg in enumerate(self.src.segments)
                      for k in range(seg.n_layers)}
        rows.update({key: [] for key in self.src.owners})
        for k, terms in self.stencil.items():
            for j, w in terms:
                rows[j].append((k, w))
        t.stencil = rows
        return t

    def run(self, values: dict, like: dict) -> dict:
        """``values``: ``{src key: {name: tensor}}`` for this rank's source keys; ``like``:
        ``{dst key: {name: tensor}}`` templates of this rank's destination keys. Returns
        ``{dst key: {name: tensor}}`` (collective over the common communicator)."""
        comm = self.comm
        if comm is not None and comm.Get_size() > 1 and self.src.comm is not None:
            me, P = comm.Get_rank(), comm.Get_size()
            sends = [dict() for _ in range(P)]
            for dk, terms in self.stencil.items():
                owner = self.dst.owner(dk)
                dests = range(P) if owner is None else (owner,)
                for sk, _ in terms:
                    if self.src.owner(sk) == me:
                        for r in dests:
                            if r != me:
                                sends[r][sk] = {n: t.detach().cpu().clone()
                                                for n, t in values.get(sk, {}).items()}
            got = dict(values)
            for piece in comm.alltoall(sends):
                got.update(piece)
        else:
            got = values
        out = {}
        for dk, names in like.items():
            terms = self.stencil[dk]
            out[dk] = {n: _combine(terms, {s: got[s][n] for s, _ in terms}, t, t.device)
                       for n, t in names.items()}
        return out


def param_keys(view: View) -> tuple[list[tuple], str | None]:
    """``(key, name)`` of each of the model's parameters on this rank, in ``parameters()``
    order, and an error message (or ``None``)."""
    where: dict[int, tuple] = {}
    for key, mod in view.all_modules().items():
        for name, p in mod.named_parameters():
            if id(p) in where:
                return [], (f"parameter {key}.{name} is shared with {where[id(p)]}: tied "
                            f"weights cannot be transferred in depth")
            where[id(p)] = (key, name)
    keys = []
    for p in view.model.parameters():
        if id(p) not in where:
            return [], ("the network has a parameter outside its residual steps and ordinary "
                        "modules: depth transfer cannot place it")
        keys.append(where[id(p)])
    return keys, None
