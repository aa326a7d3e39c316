"""Layout and checks of a network made of ordinary modules and layer-parallel segments.

:func:`layout` turns the parts of :class:`~mgrit.nn.net.LayerParallelNet` into :class:`Part`
records (kind, owner rank, index in ``to_serial()``) and the gaps between segments into
:class:`Gap` records (the ordinary modules run by one rank between two segments, before the
first or after the last). Where ordinary modules live:

* before the first segment: on the rank holding its layer 0 (its *first layer rank*), which
  also consumes the input batch;
* after segment ``i``: on the rank holding its final state (its *last layer rank*); the result
  is then sent to segment ``i + 1``'s first layer rank (one message, after the transition, which
  is usually smaller than the state before it: strided convolutions, pooling).

The checks return an error message (or ``None``) for the rank they run on; the network agrees
them over the layer communicator (:func:`mgrit.comm.raise_agreed`), so bad input is the same
``ValueError`` on every rank before any message. Output shapes are found by running a module on
a batch of 2 zero samples without a trace (no graph, buffers copied, RNG states restored).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from mpi4py import MPI
from torch import nn
from torch.func import functional_call

from .resnet import LayerParallelResNet

__all__ = ["Part", "Gap", "layout", "first_rank", "last_rank", "probe", "structure_error",
           "gap_error", "steps_error"]

_PROBE_BATCH = 2  # BatchNorm in training mode refuses a batch of one


@dataclass
class Part:
    """One entry of the network.

    Attributes:
        index: position in the parts given to the network.
        module: the ordinary module (``None`` parts become ``nn.Identity``) or the segment.
        segment: index among the segments, or ``None`` for an ordinary module.
        offset: index of its (first) layer in ``to_serial()``; global state-dict keys start
            with it.
        owner: rank of the layer communicator that runs an ordinary module (``None`` for a
            segment, which runs on every rank).
    """

    index: int
    module: nn.Module
    segment: int | None
    offset: int
    owner: int | None = None

    @property
    def is_segment(self) -> bool:
        return self.segment is not None


@dataclass
class Gap:
    """The ordinary modules between segment ``after`` and segment ``before`` (``None``: the
    network's input / output), all run by ``owner``."""

    parts: list = field(default_factory=list)
    after: int | None = None
    before: int | None = None
    owner: int = 0


def first_rank(seg: LayerParallelResNet) -> int:
    """Rank holding the segment's input state (layer 0)."""
    return seg.partition.owner(0)


def last_rank(seg: LayerParallelResNet) -> int:
    """Rank holding the segment's final state ``x_N``."""
    return seg.partition.owner(seg.n_layers)


def structure_error(parts) -> str | None:
    """Rank-independent checks of the parts (types, at least one segment, no module twice,
    one layer communicator). Returns a message or ``None``."""
    if len(parts) == 1 and isinstance(parts[0], (list, tuple)):
        return ("LayerParallelNet takes the parts as separate arguments: use "
                "LayerParallelNet(*parts)")
    if not parts:
        return "LayerParallelNet needs at least one part (a LayerParallelResNet segment)"
    for i, p in enumerate(parts):
        if p is not None and not isinstance(p, nn.Module):
            return (f"part {i} is a {type(p).__name__}: use an nn.Module, a LayerParallelResNet "
                    f"segment or None (the identity)")
        if p is not None and not isinstance(p, LayerParallelResNet) and any(
                isinstance(m, LayerParallelResNet) for m in p.modules()):
            return (f"part {i} ({type(p).__name__}) contains a LayerParallelResNet: pass "
                    f"segments as parts of their own")
    segs = [p for p in parts if isinstance(p, LayerParallelResNet)]
    if not segs:
        return ("LayerParallelNet needs at least one LayerParallelResNet segment; for a purely "
                "serial network use nn.Sequential")
    seen = {}
    for i, p in enumerate(parts):
        if p is None:
            continue
        if id(p) in seen:
            return (f"part {i} is the same module object as part {seen[id(p)]}: every part must "
                    f"be its own module (parameters of ordinary modules live on one rank)")
        seen[id(p)] = i
    comm = segs[0].comm
    for j, s in enumerate(segs[1:], 1):
        same = MPI.Comm.Compare(comm, s.comm) in (MPI.IDENT, MPI.CONGRUENT)
        if not same:
            return (f"segment {j} runs on another communicator than segment 0 (sizes "
                    f"{s.comm.Get_size()} and {comm.Get_size()}): build every segment on the "
                    f"same layer communicator")
    return None


def layout(parts) -> tuple[list[Part], list[LayerParallelResNet], list[Gap]]:
    """Parts with owners and serial offsets, the segments in order, and the gaps (one before
    the first segment, one between each two, one after the last; possibly empty)."""
    segs = [p for p in parts if isinstance(p, LayerParallelResNet)]
    out, gaps = [], [Gap(before=0, owner=first_rank(segs[0]))]
    offset, k = 0, 0
    for i, p in enumerate(parts):
        if isinstance(p, LayerParallelResNet):
            out.append(Part(i, p, k, offset))
            offset += p.n_layers
            k += 1
            gaps.append(Gap(after=k - 1, before=k if k < len(segs) else None,
                            owner=last_rank(p)))
        else:
            part = Part(i, nn.Identity() if p is None else p, None, offset, gaps[-1].owner)
            out.append(part)
            gaps[-1].parts.append(part)
            offset += 1
    return out, segs, gaps


def probe(module: nn.Module, shape, dtype: torch.dtype, device=None) -> tuple[tuple, torch.dtype]:
    """``(per-sample output shape, dtype)`` of ``module`` on a batch of 2 zero samples of
    ``shape`` and ``dtype`` (on the module's device, else ``device``, else CPU).

    The module runs for real (exactly what PyTorch accepts, dtype checks included) but leaves
    no trace: no autograd graph, copies of its buffers (BatchNorm statistics stay as they
    were), and the RNG states it draws from (dropout) are restored. Raises whatever the module
    raises on such an input (wrong sizes or dtypes), and ValueError when it returns something
    else than a tensor or changes the batch size."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    dev = first.device if first is not None else torch.device(device or "cpu")
    buffers = {n: b.clone() for n, b in module.named_buffers(remove_duplicate=False)}
    x = torch.zeros((_PROBE_BATCH, *shape), dtype=dtype, device=dev)
    cuda = [dev.index or 0] if dev.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        y = functional_call(module, buffers, (x,), tie_weights=False)
    if not torch.is_tensor(y):
        raise ValueError(f"returns a {type(y).__name__}, not a tensor")
    if y.dim() == 0 or y.shape[0] != _PROBE_BATCH:
        raise ValueError(f"maps a batch of {_PROBE_BATCH} to shape {tuple(y.shape)}: the first "
                         f"dimension must stay the batch")
    return tuple(y.shape[1:]), y.dtype


def _name(part: Part) -> str:
    return f"part {part.index} ({type(part.module).__name__})"


def _own_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    p = next((t for t in itertools.chain(module.parameters(), module.buffers())
              if t.is_floating_point()), None)
    return default if p is None else p.dtype


def gap_error(gap: Gap, segs, in_shape, in_dtype, check_dtype: bool) -> str | None:
    """Run on ``gap.owner``: the gap's modules applied to states ``(batch, *in_shape)`` of
    ``in_dtype`` must produce the next segment's state (shape; dtype when ``check_dtype``,
    else each module is probed in its own parameters' dtype)."""
    shape, dtype = tuple(in_shape), in_dtype
    for part in gap.parts:
        if not check_dtype and dtype.is_floating_point:  # shapes only (at construction,
            dtype = _own_dtype(part.module, dtype)  # maybe before net.double()): own dtype
        try:
            shape, dtype = probe(part.module, shape, dtype)
        except Exception as exc:  # noqa: BLE001 - reported as the agreed error of every rank
            return f"{_name(part)} fails on an input (batch, {', '.join(map(str, shape))}) " \
                   f"{dtype}: {type(exc).__name__}: {exc}"
    if gap.before is None:
        return None
    seg = segs[gap.before]
    what = (_name(gap.parts[-1]) + " produces" if gap.parts else
            ("the input is" if gap.after is None else f"segment {gap.after}'s state is"))
    if shape != tuple(seg.state_shape):
        return (f"{what} (batch, {', '.join(map(str, shape))}) but segment {gap.before} has "
                f"state_shape {tuple(seg.state_shape)}: make them equal")
    if check_dtype and dtype != seg.dtype:
        if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda")):
            return (f"{what} {dtype} under torch.autocast but segment {gap.before}'s states are "
                    f"{seg.dtype}: a layer-parallel segment keeps its states in its layers' "
                    f"dtype (autocast inside its layers is supported, with serial semantics); "
                    f"return {seg.dtype} from the module before the segment (e.g. end it "
                    f"with .to({seg.dtype}) or run it outside autocast)")
        return (f"{what} {dtype} but segment {gap.before}'s layers are {seg.dtype}: convert "
                f"the modules (e.g. net.double()) or the input")
    return None


def steps_error(k: int, seg: LayerParallelResNet) -> str | None:
    """This rank's layers of segment ``k`` must keep the state shape."""
    shape = tuple(seg.state_shape)
    for j, step in enumerate(seg.steps):
        try:
            out, _ = probe(step, shape, seg.dtype)
        except Exception as exc:  # noqa: BLE001 - reported as the agreed error of every rank
            return (f"segment {k} layer {seg.first + j} ({type(step).__name__}) fails on its "
                    f"state (batch, {', '.join(map(str, shape))}): {type(exc).__name__}: {exc}")
        if out != shape:
            return (f"segment {k} layer {seg.first + j} ({type(step).__name__}) maps the state "
                    f"{shape} to {out}: the steps of a segment must keep the state shape "
                    f"(change shapes in an ordinary module between two segments)")
    return None
