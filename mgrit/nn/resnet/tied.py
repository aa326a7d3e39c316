"""Weight-tied layers of a :class:`~mgrit.nn.resnet.LayerParallelResNet`, also across ranks.

A *tie group* is a set of layers that use one step module (a time-invariant neural ODE: every
layer; ALBERT: one transformer block for the whole stack; or blocks of consecutive layers).
The groups are declared with ``tie`` (:func:`tie_groups`), a map from the **global** layer
index to a group key, because object identity cannot be seen across processes: with
``make_step = lambda k: blocks[k // 4]`` on two ranks, rank 0 may see only ``blocks[0]`` and
rank 1 only ``blocks[1]``, and nothing in either process says whether they are one module.

Contract (checked at construction and by ``refresh_structure``, the same ``ValueError`` on
every rank): the layers of one group on a rank have the same parameter objects, in the same
``named_parameters`` order (the same module, as :meth:`LayerParallelResNet.build` makes them);
no parameter is shared between layers of different groups or with an untied layer; the
holders of a group agree on its parameter names, shapes and dtypes (one ``allgather``).

What the library then does, per group that spans more than one rank (a group held by one
rank needs nothing: autograd sums the layers' contributions as in serial PyTorch):

* **Replicas.** Each holder keeps a replica of the group's parameters. At construction the
  replicas get the values of the rank holding the group's first layer (one ``Allreduce`` of
  a flat buffer holding those values and zeros elsewhere), so they start bitwise identical
  however the user built them. :meth:`TiedLayers.replica_error` compares them bit for bit
  (a SHA-1 digest per group, one ``allgather``); the ``Trainer`` checks after every epoch.
* **Gradients.** Inside the segment's backward (an autograd node, before it returns the
  gradients to autograd), every rank sums its layers' contributions to each group parameter,
  then one in-place ``Allreduce`` (sum) of one flat buffer over the layer communicator -- all
  spanning groups in one bucket, zeros where a rank does not hold a group -- gives every
  holder the full serial gradient. So ``.grad`` after ``loss.backward()`` is the serial
  gradient on every holder, in a plain loop as in the ``Trainer``: no extra call, and equal
  optimizer steps keep the replicas identical (the reduced buffer is the same on every rank).
  On the MGRIT path this happens in :func:`mgrit.nn.resnet.bridge.node_backward` (per-parameter
  gradients, or the stacked gradients of the batched path, where the group's total goes to
  the group's first local row and zeros to its other rows, so that ``torch.stack``'s backward
  sums it once); on the one-level pipelined path in :class:`TiedSync`, an autograd node
  created before the rank's first layer, so it runs after the rank's last layer gradient and
  after the state gradient went to the previous rank (no rank waits in the ``Allreduce`` for
  a message that would come after it).
* **Checkpoints.** Keys stay those of ``to_serial().state_dict()`` (every layer's entries, as
  serial PyTorch lists a module used several times); a gathered state dict maps all layers
  of a group to one tensor object, so a saved file holds one copy, and it loads on any rank
  count.

Cost: one ``Allreduce`` per backward of ``sum(group parameter sizes)`` values over the layer
communicator, whichever ranks hold the groups (a rank holding none sends zeros).
"""
from __future__ import annotations

import hashlib
from typing import Hashable, Sequence

import torch
from mpi4py import MPI

__all__ = ["tie_groups", "TiedLayers", "TiedSync"]

_MPI = {torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT}


def tie_groups(tie, n_layers: int) -> list | None:
    """Normalize ``tie`` to a list of ``n_layers`` group numbers (``0, 1, ...`` in the order of
    each group's first layer; ``None``: an untied layer). ``tie``: ``None`` (no ties), a
    callable ``k -> key`` or a sequence of ``n_layers`` keys; keys are hashable, ``None``
    means untied, and a key used by one layer only is an untied layer.

    Raises:
        ValueError: a sequence of the wrong length, an unhashable key, a callable that raises.
    """
    if tie is None:
        return None
    if callable(tie):
        try:
            keys = [tie(k) for k in range(n_layers)]
        except Exception as exc:  # noqa: BLE001  (named in the message)
            raise ValueError(f"tie(k) raised {type(exc).__name__}: {exc}; use a function of "
                             f"the global layer index k = 0..N-1 returning a group key or "
                             f"None") from exc
    elif isinstance(tie, (str, bytes)) or not isinstance(tie, Sequence):
        raise ValueError(f"tie={tie!r} is not allowed: use None, a function k -> group key, or "
                         f"a sequence of N = {n_layers} group keys (None: untied)")
    else:
        keys = list(tie)
        if len(keys) != n_layers:
            raise ValueError(f"tie has {len(keys)} entries: use one group key per layer "
                             f"(N = {n_layers})")
    count: dict = {}
    for k, key in enumerate(keys):
        if not isinstance(key, Hashable):
            raise ValueError(f"tie key {key!r} of layer {k} is not hashable: use ints or strings")
        if key is not None:
            count[key] = count.get(key, 0) + 1
    number: dict = {}
    groups = []
    for key in keys:
        if key is None or count[key] < 2:
            groups.append(None)
        else:
            groups.append(number.setdefault(key, len(number)))
    return groups if number else None


class TiedLayers:
    """The tie groups of one segment as seen by one rank (see the module docstring).

    Args:
        groups: :func:`tie_groups` of the segment (global, the same on every rank).
        steps: this rank's step modules (layer ``first + j`` is ``steps[j]``).
        first: global index of ``steps[0]``.
        partition: the segment's :class:`~mgrit.grid.Partition`; comm: its layer communicator.

    Attributes:
        spanning: the groups held by more than one rank (global numbers, ascending).
        rows: ``{group: [local row, ...]}`` for the groups this rank holds.
        params: ``{group: [Parameter, ...]}`` (``named_parameters`` order) for held groups.
    """

    def __init__(self, groups: list, steps, first: int, partition, comm: MPI.Comm):
        self.groups, self.comm, self.first = list(groups), comm, int(first)
        self.first_layer = {}
        holders: dict = {}
        for k, g in enumerate(self.groups):
            if g is not None:
                self.first_layer.setdefault(g, k)
                holders.setdefault(g, set()).add(partition.owner(k))
        self.root = {g: partition.owner(k) for g, k in self.first_layer.items()}
        self.spanning = sorted(g for g, h in holders.items() if len(h) > 1)
        self.rows: dict = {}
        self.n_local = len(steps)
        for j in range(len(steps)):
            g = self.groups[self.first + j]
            if g is not None:
                self.rows.setdefault(g, []).append(j)
        self._steps = steps
        self.params = {g: [p for _, p in steps[r[0]].named_parameters()]
                       for g, r in self.rows.items()}
        self.slots: list = []  # (group, index in params[group], offset, numel) in the buffer
        self.size = 0
        self.dtype, self.device = None, torch.device("cpu")

    def rebind(self, steps, dtype: torch.dtype, device) -> None:
        """Re-read the parameters after ``.to()``/``.double()`` replaced them (local; the
        layout's sizes are unchanged)."""
        self._steps = steps
        self.params = {g: [p for _, p in steps[r[0]].named_parameters()]
                       for g, r in self.rows.items()}
        self.dtype, self.device = dtype, torch.device(device)

    # -- checks --------------------------------------------------------------------------
    def structure_error(self, steps) -> str | None:
        """This rank's violation of the contract (a message) or ``None`` (local)."""
        owner = {}
        for j, s in enumerate(steps):
            k, g = self.first + j, self.groups[self.first + j]
            mine = [id(p) for _, p in s.named_parameters()]
            if g is not None:
                j0 = self.rows[g][0]
                if mine != [id(p) for p in self.params[g]]:
                    return (f"tie puts layers {self.first + j0} and {k} in one group, but they do "
                            f"not use the same parameters: make_step must return the same module "
                            f"for every layer of a group (LayerParallelResNet.build(..., tie=...) "
                            f"does this), or drop the tie")
            for name, p in s.named_parameters():
                j2, name2 = owner.setdefault(id(p), (j, name))
                g2 = self.groups[self.first + j2]
                if j2 != j and (g is None or g2 != g):
                    return (f"layers {self.first + j2} and {k} share the parameter {name2!r} "
                            f"but tie does not put them in one group: declare every sharing with "
                            f"tie (one group per shared module) or give each layer its own "
                            f"parameters")
        return None

    def setup(self) -> None:
        """Agree on the spanning groups' parameter layout (one ``allgather``) and make the
        replicas identical (one ``Allreduce``). Collective; ``ValueError`` on every rank."""
        mine = {g: [(n, tuple(p.shape), str(p.dtype)) for n, p in
                    self._steps[self.rows[g][0]].named_parameters()]
                for g in self.spanning if g in self.params}
        error = None
        dts = {p.dtype for g in mine for p in self.params[g]}
        if len(dts) > 1 or (dts and next(iter(dts)) not in _MPI):
            error = (f"tied parameters have dtypes {sorted(map(str, dts))}: tied layers across "
                     f"ranks need one dtype, float32 or float64")
        layouts = self.comm.allgather((mine, error))
        errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(layouts) if e]
        if errors:  # one rank's error on every rank
            raise ValueError("; ".join(errors))
        layout: dict = {}
        for r, (part, _) in enumerate(layouts):
            for g, sig in part.items():
                if layout.setdefault(g, (r, sig))[1] != sig:
                    raise ValueError(f"tie group of layer {self.first_layer[g]}: ranks "
                                     f"{layout[g][0]} and {r} hold different parameters "
                                     f"({layout[g][1]} vs {sig}): every rank must build the same "
                                     f"module for a group")
        dtypes = {d for _, sig in layout.values() for _, _, d in sig}
        if len(dtypes) > 1:
            raise ValueError(f"tied parameters have dtypes {sorted(dtypes)} on different ranks: "
                             f"tied layers across ranks need one dtype, float32 or float64")
        self.dtype = getattr(torch, dtypes.pop().split(".")[-1]) if dtypes else None
        self.slots, off = [], 0
        for g in self.spanning:
            for i, (_, shape, _) in enumerate(layout[g][1]):
                n = 1
                for d in shape:
                    n *= d
                self.slots.append((g, i, off, n))
                off += n
        self.size = off
        if self.size:
            self._sync_values()

    def _sync_values(self) -> None:
        flat = self._buffer()
        rank = self.comm.Get_rank()
        with torch.no_grad():
            for g, i, off, n in self.slots:
                if self.root[g] == rank:
                    flat[off:off + n].copy_(self.params[g][i].detach().reshape(-1))
            self._allreduce(flat)
            for g, i, off, n in self.slots:
                if g in self.params:
                    p = self.params[g][i]
                    p.copy_(flat[off:off + n].view_as(p))

    def replica_error(self) -> str | None:
        """Whether the replicas of every spanning group are bitwise equal: a message naming
        the group and ranks, else ``None`` (collective: one ``allgather``)."""
        if not self.spanning:
            return None
        mine = {}
        for g in self.spanning:
            if g in self.params:
                h = hashlib.sha1()
                for p in self.params[g]:
                    h.update(p.detach().cpu().contiguous().numpy().tobytes())
                mine[g] = h.hexdigest()
        seen: dict = {}
        for r, part in enumerate(self.comm.allgather(mine)):
            for g, d in part.items():
                r0, d0 = seen.setdefault(g, (r, d))
                if d0 != d:
                    return (f"the replicas of the tie group of layer {self.first_layer[g]} differ "
                            f"between layer ranks {r0} and {r} (they must stay bitwise "
                            f"identical: every rank must step the same optimizer on the same "
                            f"gradients)")
        return None

    # -- gradients --------------------------------------------------------------------------
    def _buffer(self) -> torch.Tensor:
        dev = next((p.device for ps in self.params.values() for p in ps), self.device)
        return torch.zeros(self.size, dtype=self.dtype, device=dev)

    def _allreduce(self, flat: torch.Tensor) -> None:
        if self.comm.Get_size() == 1:
            return
        host = flat if flat.device.type == "cpu" else flat.cpu()
        self.comm.Allreduce(MPI.IN_PLACE, [host.numpy(), _MPI[self.dtype]], op=MPI.SUM)
        if host is not flat:
            flat.copy_(host)

    def reduce_parameter_grads(self, grads: list, index: dict) -> None:
        """Per-parameter gradients (``grads[index[id(p)]]``, ``None``: none on this rank)
        replaced in place by their sums over the layer ranks. Collective."""
        if not self.size:
            return
        flat = self._buffer()
        with torch.no_grad():
            for g, i, off, n in self.slots:
                if g in self.params:
                    gr = grads[index[id(self.params[g][i])]]
                    if gr is not None:
                        flat[off:off + n].copy_(gr.reshape(-1))
            self._allreduce(flat)
        for g, i, off, n in self.slots:
            if g in self.params:
                p = self.params[g][i]
                grads[index[id(p)]] = flat[off:off + n].view_as(p)

    def reduce_stacked_grads(self, grads: list) -> list:
        """Stacked gradients (one ``(n_local, *shape)`` per parameter name of the template,
        ``None``: none) with each spanning group's rows summed over the layer ranks: the total
        in the group's first local row, zeros in its other rows (``torch.stack``'s backward
        then sums them into the parameter once). Returns the new list. Collective."""
        if not self.size:
            return grads
        # the stacked names are the template's named_parameters: index i of a group's params
        flat = self._buffer()
        with torch.no_grad():
            for g, i, off, n in self.slots:
                if g in self.params and grads[i] is not None:
                    flat[off:off + n].copy_(grads[i][self.rows[g]].sum(0).reshape(-1))
            self._allreduce(flat)
            out = [None if gr is None else gr.clone() for gr in grads]
            for g, i, off, n in self.slots:
                if g in self.params:
                    p, rows = self.params[g][i], self.rows[g]
                    if out[i] is None:
                        out[i] = torch.zeros((self.n_local, *p.shape), dtype=p.dtype,
                                             device=p.device)
                    out[i][rows[0]] = flat[off:off + n].view_as(p)
                    if len(rows) > 1:
                        out[i][rows[1:]] = 0
        return out

    # -- the one-level path -------------------------------------------------------------------
    def local_parameters(self) -> list:
        """The parameters of the spanning groups this rank holds, in buffer order."""
        return [self.params[g][i] for g, i, _, _ in self.slots if g in self.params]

    def substitutions(self, aliases: Sequence[torch.Tensor], steps) -> list:
        """Per local layer: ``{name: alias}`` for a layer of a spanning group (the outputs of
        :class:`TiedSync`, in :meth:`local_parameters` order), else ``None``."""
        by_group: dict = {}
        it = iter(aliases)
        for g, i, _, _ in self.slots:
            if g in self.params:
                by_group.setdefault(g, []).append(next(it))
        subs = []
        for j, s in enumerate(steps):
            g = self.groups[self.first + j]
            if g in by_group:
                subs.append({n: a for (n, _), a in zip(s.named_parameters(), by_group[g])})
            else:
                subs.append(None)
        return subs


class TiedSync(torch.autograd.Function):
    """``apply(tied, token, *params) -> (token', *aliases)``: identity in the forward; in the
    backward, the aliases' gradients (this rank's layers' sum) are summed over the layer ranks
    (:meth:`TiedLayers.reduce_parameter_grads`). Every rank creates one (``token`` makes it
    part of every rank's graph), before its first layer: it runs after the rank's layer
    gradients and its message to the previous rank, on every rank in the same order."""

    @staticmethod
    def forward(ctx, tied, token, *params):
        ctx.tied = tied
        ctx.set_materialize_grads(False)
        ctx.ids = [id(p) for p in params]
        return (token.view_as(token), *[p.view_as(p) for p in params])

    @staticmethod
    def backward(ctx, gtoken, *grads):
        grads = list(grads)
        ctx.tied.reduce_parameter_grads(grads, {i: n for n, i in enumerate(ctx.ids)})
        need = ctx.needs_input_grad[2:]
        return (None, None, *[g if w else None for g, w in zip(grads, need)])
