"""A network of ordinary modules and layer-parallel segments, trained with ordinary autograd.

``LayerParallelNet(*parts)``: each part is an ordinary ``nn.Module`` (``None``: the identity)
or a :class:`~mgrit.nn.resnet.LayerParallelResNet` *segment*, applied in order, e.g.

* ``(opening, resnet, closing)``: the classic classifier around one segment;
* a staged conv ResNet: ``(stem, segment, strided conv, segment, strided conv, segment, head)``;
* serial "buffer" layers around a parallel segment (decoder-only transformers keep a few):
  ``(embedding, buffer, buffer, segment, buffer, head)``.

Every segment is its own MGRIT chain (forward solve, adjoint solve in backward) over the same
layer communicator; gradients through the ordinary modules come from ordinary autograd; the
adjoint solves run in reverse forward order (docs page ``features/segments``).

Where things live (layer ranks of the communicator the segments share):

* an ordinary module before the first segment runs on that segment's *first layer rank* (the
  rank holding its layer 0), which also consumes the input batch; one after segment ``i`` runs
  on segment ``i``'s *last layer rank* (the rank holding its final state). Its parameters exist
  and are registered there only (``None``/absent elsewhere): the optimizer of each rank sees
  exactly its own parameters, and every parameter lives on exactly one rank.
* Between two segments the state (after the transition modules) is sent to the next segment's
  first layer rank: one message of the exact bytes (any dtype), and its gradient back in
  backward (:mod:`mgrit.nn._p2p`).

Usage (every rank of the layer communicator)::

    out = net(x)                        # same batch x everywhere (elsewhere: only its size)
    net.loss(out, y).backward()         # real loss on the last layer rank, placeholder elsewhere
    optimizer.step()                    # over net.parameters(): this rank's parameters

Global names: :meth:`gather_state_dict`, :meth:`load_global_state_dict` and
:meth:`named_global_parameters` use the keys of ``net.to_serial().state_dict()``: ordinary part
at serial index ``o``: ``"{o}.{name}"``; layer ``k`` of a segment starting at serial index
``o``: ``"{o + k}.F.{name}"`` (``to_serial()`` wraps each step in a
:class:`~mgrit.nn.steps.ResidualStep`). They do not depend on the number of ranks, and a
gathered state dict loads into the serial network as it is. For ``(opening, resnet, closing)``:
``"0.*"``, ``"{1 + k}.F.*"``, ``"{N + 1}.*"``.
"""
from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from ..comm import raise_agreed
from ..stats import SolverStats
from ._p2p import join, recv, send, transfer_tag
from .chains.compiled import compile_neutral_keys, plain_module, share_parameter
from .chains.transforms import compile_disabled, transform_error
from .protocol import LayerParallelNetMixin
from .resnet.stacked_leaves import with_layer_parameters
from .segments import first_rank, gap_error, last_rank, layout, steps_error, structure_error
from .steps import ResidualStep
from .steps.stochastic import seed_serial, share_stream
from .tied_keys import alias_tied, tied_conflict, tied_source

__all__ = ["LayerParallelNet", "alias_tied", "tied_conflict", "tied_source"]


class LayerParallelNet(LayerParallelNetMixin, nn.Module):
    """Ordinary modules and layer-parallel segments applied in order (see the module docstring
    for where each part runs and the global key scheme).

    Args:
        *parts: each an ``nn.Module`` (an ordinary module: any shapes; ``None``: identity) or a
            :class:`LayerParallelResNet` (a segment: states ``(batch, *state_shape)`` in and
            out). At least one segment; all segments on the same layer communicator
            (identical or congruent); no module object twice. An ordinary module must map
            ``(batch, ...)`` to ``(batch, ...)``.

    Raises (every rank, before any message between ranks):
        ValueError: no segment, a part that is not a module, a module given twice, segments on
            different communicators; a step that changes its segment's state shape; a
            transition whose output shape differs from the next segment's ``state_shape`` (or
            that fails on the previous segment's state); two adjacent segments with different
            state shapes. :meth:`forward` checks the input, the opening modules and the dtypes
            the same way (one small ``allgather`` per call).

    Attributes:
        segments: the segments (``nn.ModuleList``, every rank). ``stages``: the ordinary
            modules this rank runs (``nn.ModuleDict`` keyed by part index). ``comm``: the layer
            communicator. ``first_rank``/``last_rank``: ranks consuming the input / holding the
            output. ``transfer_stats``: messages, bytes and wait time of the transfers between
            segments (:class:`~mgrit.stats.SolverStats`).
        resnet, opening, closing: for a network with one segment and at most one ordinary
            module on either side (the classic ``(opening, resnet, closing)``): the segment and
            the modules (``None`` on ranks that do not run them); ``AttributeError`` otherwise.
    """

    def __init__(self, *parts: nn.Module | None):
        super().__init__()
        error = structure_error(parts)
        if error:
            raise ValueError(error)
        self._parts, segs, self._gaps = layout(parts)
        self.comm = segs[0].comm
        self.rank = self.comm.Get_rank()
        self.segments = nn.ModuleList(segs)  # registered first: the classic parameter order
        self.stages = nn.ModuleDict({str(p.index): p.module for p in self._parts
                                     if not p.is_segment and p.owner == self.rank})
        for p in self._parts:  # other ranks' modules are not kept (they live on their owner)
            if not p.is_segment and p.owner != self.rank:
                p.module = None
        self.first_rank = first_rank(segs[0])
        self.last_rank = last_rank(segs[-1])
        self.transfer_stats = SolverStats()
        self._probed = {}
        compile_neutral_keys(self)  # state-dict keys without torch.compile's "_orig_mod."
        raise_agreed(self.comm, self._construction_error())

    # -- checks ------------------------------------------------------------------------------
    def _construction_error(self) -> str | None:
        segs = list(self.segments)
        for k, seg in enumerate(segs):
            error = steps_error(k, seg)
            if error:
                return error
        for gap in self._gaps:  # transitions: their input shape is known now
            if gap.after is not None and gap.owner == self.rank:
                seg = segs[gap.after]
                error = gap_error(gap, segs, seg.state_shape, seg.dtype, check_dtype=False)
                if error:
                    return error
        return None

    def _forward_error(self, x: torch.Tensor) -> str | None:
        """This rank's checks of a forward (cached per input shape and local dtypes)."""
        segs = list(self.segments)
        mods = [(str(p.dtype), str(p.device)) for m in self.stages.values()
                for p in list(m.parameters())[:1]]
        autocast = tuple(torch.is_autocast_enabled(t) for t in ("cpu", "cuda"))
        key = (tuple(x.shape[1:]), x.dtype, tuple(mods), tuple(str(s.dtype) for s in segs),
               autocast)
        if key not in self._probed:
            error = None
            for gap in self._gaps:
                if gap.owner != self.rank:
                    continue
                if gap.after is None:
                    shape, dtype = x.shape[1:], x.dtype
                else:
                    shape, dtype = segs[gap.after].state_shape, segs[gap.after].dtype
                error = error or gap_error(gap, segs, shape, dtype, check_dtype=True)
            self._probed[key] = error
        return self._probed[key]

    # -- forward -----------------------------------------------------------------------------
    @compile_disabled  # torch.compile(net): a graph break, the forward runs eagerly
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the input batch ``(batch, ...)`` on every rank (used on :attr:`first_rank`;
        elsewhere only ``x.shape[0]``). Returns the network's output on :attr:`last_rank`
        and an empty placeholder connected to this rank's parameters elsewhere (build the
        loss with :meth:`loss` on every rank and call ``.backward()`` on every rank).

        ``autograd.grad(loss, x)`` (``x`` requiring grad on every rank): the input gradient on
        :attr:`first_rank`, zeros elsewhere. ``torch.compile(net)`` runs this forward eagerly;
        functional calls: :meth:`LayerParallelResNet.forward`. Training on P > 1 ranks draws
        from one random stream, the serial one (:func:`~mgrit.nn.steps.stochastic.share_stream`).

        Raises:
            ValueError: (every rank, before any message) batch sizes that differ between
                ranks, an input or opening output that does not fit the first segment's
                ``state_shape``/dtype, a transition output dtype other than the next segment's;
                a functorch transform (``torch.func.vmap``, ``grad``, ``jvp``, ...) or
                forward-mode AD dual tensors (:mod:`mgrit.nn.chains.transforms`).
        """
        if not torch.is_tensor(x) or x.dim() < 1:
            raise ValueError(f"x must be a tensor (batch, ...), got {type(x).__name__}"
                             + (f" of shape {tuple(x.shape)}" if torch.is_tensor(x) else ""))
        B = x.shape[0]
        segs = list(self.segments)
        error = (transform_error("LayerParallelNet", itertools.chain((x,), self.parameters()))
                 or self._forward_error(x))
        raise_agreed(self.comm, error, same=(B, tuple(str(s.dtype) for s in segs)),
                     what="batch size and segment dtypes")
        rank = self.rank
        # the real input on the first rank; elsewhere the input only where it requires grad: it
        # is the link of every segment's node there (below), so that autograd.grad(loss, x)
        # runs every adjoint solve on every rank (zero gradient to x there)
        cur = x if rank == self.first_rank or x.requires_grad else None
        holder = self.first_rank
        share = self.training and self.comm.Get_size() > 1
        for part in self._parts:
            if not part.is_segment:
                if rank == part.owner:
                    cur = self.stages[str(part.index)](cur)
                continue
            k = part.segment
            seg = self.segments[k]
            dest = first_rank(seg)
            if holder != dest:
                tag = transfer_tag(k)
                if rank == holder:
                    cur = send(cur, self.comm, dest, tag, self.transfer_stats)
                elif rank == dest:
                    cur = recv(cur, self.comm, holder, tag, (B, *seg.state_shape), seg.dtype,
                               seg.device, self.transfer_stats)
            if share and not seg._stochastic:  # (a stochastic segment shares it itself)
                share_stream(self.comm, dest)  # one random stream: the serial one
            if rank == dest:
                out = seg(cur, batch_size=B)
            else:  # everything before in this rank's graph, behind the segment's node
                link = cur if cur is not None and cur.requires_grad else None
                out = seg(link, batch_size=B)
                if link is not None:
                    out = join(out, link)  # a defined (zero) gradient for x and the links
            cur, holder = out, last_rank(seg)
        if share:  # the modules after the last segment drew on the output rank only
            share_stream(self.comm, holder)
        return cur

    @property
    def is_first(self) -> bool:
        """Whether this rank consumes the input batch (and holds the input gradient)."""
        return self.rank == self.first_rank

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the network's output (and computes the real loss)."""
        return self.rank == self.last_rank

    def loss(self, out: torch.Tensor, target: torch.Tensor,
             fn: Callable = F.cross_entropy) -> torch.Tensor:
        """``fn(out, target)`` on the last layer rank; a zero placeholder connected to the
        parameters elsewhere. Call ``.backward()`` on it on every rank."""
        return fn(out, target) if self.is_last else out.sum()

    def from_last(self, value: Any) -> Any:
        """Broadcast a Python value (a loss, predictions) from the last layer rank."""
        return self.comm.bcast(value, root=self.last_rank)

    # -- the classic (opening, resnet, closing) ----------------------------------------------
    def __getattr__(self, name: str):
        if name not in ("resnet", "opening", "closing"):
            return super().__getattr__(name)
        gaps = self.__dict__.get("_gaps")
        if gaps is None:  # not initialized (yet)
            raise AttributeError(name)
        segments = super().__getattr__("segments")
        if len(segments) != 1 or len(gaps[0].parts) > 1 or len(gaps[1].parts) > 1:
            raise AttributeError(f"net.{name} exists for one segment with at most one ordinary "
                                 f"module on either side; this net has {len(segments)} "
                                 f"segment(s): use net.segments / net.stages")
        if name == "resnet":
            return segments[0]
        gap = gaps[0] if name == "opening" else gaps[1]
        part = gap.parts[0] if gap.parts else None
        if part is None or part.owner != self.rank:
            return None
        return super().__getattr__("stages")[str(part.index)]

    # -- global views (collective) -----------------------------------------------------------
    def _local_modules(self):
        """``(serial index, module, h)`` for every layer (``h``: its step size) and ordinary
        module (``h = None``) this rank holds; a ``torch.compile``d module as the module it
        wraps (:mod:`mgrit.nn.chains.compiled`: global keys do not depend on compilation)."""
        for part in self._parts:
            if part.is_segment:
                seg = part.module
                for j, s in enumerate(seg.steps):
                    yield part.offset + seg.first + j, plain_module(s), seg.h
            elif part.owner == self.rank:
                yield part.offset, plain_module(self.stages[str(part.index)]), None

    def named_global_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """``(global name, module)`` for every ordinary module (name ``"{o}"``) and residual
        step (``"{o + k}.F"``) this rank holds (local, no communication): the names of
        ``to_serial().named_modules()``; the keys of a module's parameters and buffers are
        ``f"{name}.{key}"``."""
        for i, m, h in self._local_modules():
            yield (f"{i}.F" if h is not None else f"{i}"), m

    def named_global_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(global key, parameter)`` for this rank's parameters (local, no communication);
        keys as ``to_serial().named_parameters()``."""
        for name, m in self.named_global_modules():
            for n, p in m.named_parameters():
                yield f"{name}.{n}", p

    @with_layer_parameters
    def _local_state(self) -> dict:
        return {f"{name}.{n}": t for name, m in self.named_global_modules()
                for n, t in m.state_dict().items()}

    @with_layer_parameters
    def to_serial(self) -> nn.Sequential:
        """The equivalent plain ``nn.Sequential`` (ordinary modules and ``ResidualStep(step, h)``
        layers in order), copies of the current weights, on every rank (one ``allgather``)."""
        mine = [(i, m if h is None else ResidualStep(m, h)) for i, m, h in self._local_modules()]
        pieces = self.comm.allgather(mine)
        layers = dict(item for piece in pieces for item in piece)
        params = []
        for key, key0 in self.tied_prefixes().items():  # one module per tie group
            i, i0 = int(key.split(".")[0]), int(key0.split(".")[0])
            if key.endswith("."):
                layers[i] = ResidualStep(layers[i0].F, layers[i].h)
            else:  # one parameter per parameter group: "{i}.F.{name}"
                params.append((i, i0, key.split(".", 2)[2]))
        out = nn.Sequential(*copy.deepcopy([layers[i] for i in range(len(layers))]))
        for i, i0, name in params:
            share_parameter(out[i].F, out[i0].F, name)
        for part in self._parts:  # Dropout/DropPath: each segment's layers draw its masks
            if part.is_segment:
                seed_serial(out[part.offset:part.offset + part.module.n_layers])
        return out

    def tied_prefixes(self) -> dict:
        """``{"{o+k}.F.": "{o+k0}.F."}``: the global key prefix of every weight-tied layer
        (``LayerParallelResNet(tie=...)``) that is not its group's first layer, mapped to the
        first layer's; a tied parameter (``tie={"lin.weight": ...}``) by its key,
        ``{"{o+k}.F.lin.weight": "{o+k0}.F.lin.weight"}`` (local, no communication; empty
        without ties)."""
        out = {}
        for part in self._parts:
            if part.is_segment:
                o = part.offset
                out.update({f"{o + k}.F.{path or ''}": f"{o + k0}.F.{path or ''}"
                            for k, path, k0 in part.module.tied_entries()})
        return out

    def gather_state_dict(self, root: int = 0) -> dict | None:
        """Every weight and buffer under its global key on ``root`` (``None`` elsewhere;
        collective). Equal to ``self.to_serial().state_dict()``, keys in the same order."""
        local = {k: t.detach().cpu().clone() for k, t in self._local_state().items()}
        parts = self.comm.gather(local, root=root)
        if parts is None:
            return None
        merged = [(k, v) for p in parts for k, v in p.items()]  # in to_serial() order:
        merged.sort(key=lambda kv: int(kv[0].split(".", 1)[0]))  # stable within a layer
        return alias_tied(dict(merged), self.tied_prefixes())

    @with_layer_parameters
    def load_global_state_dict(self, state: dict | None, root: int = 0,
                               strict: bool = True) -> None:
        """Inverse of :meth:`gather_state_dict`: ``state`` (global keys, given on ``root``) is
        scattered and each rank loads its entries (collective).

        Raises:
            KeyError: (every rank) missing keys, or with ``strict`` keys no part of the network
                has. ValueError: (every rank) an entry of another shape, or tied layers differ.
        """
        want = {k: tuple(t.shape) for k, t in self._local_state().items()}
        wants = self.comm.gather(want, root=root)
        error, payloads = None, None
        if self.rank == root:
            if not isinstance(state, dict):
                error = ("value", f"state must be a dict on root {root}, got "
                                  f"{type(state).__name__}")
            else:
                known = {k: s for w in wants for k, s in w.items()}
                missing = [k for k in known if k not in state]
                extra = [k for k in state if k not in known] if strict else []
                bad = [f"{k}: {tuple(state[k].shape)} vs {s}" for k, s in known.items()
                       if k in state and tuple(state[k].shape) != s]
                conflict = None if missing else tied_conflict(state, self.tied_prefixes())
                if conflict:
                    error = ("value", conflict)
                elif missing or extra:
                    error = ("key", f"state dict: missing keys {missing[:5]}"
                                    f"{' ...' if len(missing) > 5 else ''}, unexpected keys "
                                    f"{extra[:5]}{' ...' if len(extra) > 5 else ''}")
                elif bad:
                    error = ("value", f"state dict entries of another shape: {bad[:5]}")
                else:
                    payloads = [{k: state[k] for k in w} for w in wants]
        error = self.comm.bcast(error, root=root)
        if error:
            raise (KeyError if error[0] == "key" else ValueError)(error[1])
        mine = self.comm.scatter(payloads, root=root)
        for name, m in self.named_global_modules():
            m.load_state_dict({n: mine[f"{name}.{n}"] for n in m.state_dict()})
