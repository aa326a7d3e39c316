"""Weight-tied layers of a :class:`~mgrit.nn.resnet.LayerParallelResNet`, also across ranks.

A *tie group* is a set of layers that share parameters: one whole step module (a
time-invariant neural ODE: every layer; ALBERT: one transformer block for the whole stack; or
blocks of consecutive layers), or one parameter of the step (``tie={"lin.weight": lambda k:
0}``: ``F_k(x) = tanh(W x + b_k)``, a shared weight and a bias per layer). The groups are
declared with ``tie`` (:func:`~mgrit.nn.resnet.tiespec.tie_groups`), a map from the **global**
layer index to a group key, because object identity cannot be seen across processes: with
``make_step = lambda k: blocks[k // 4]`` on two ranks, rank 0 may see only ``blocks[0]`` and
rank 1 only ``blocks[1]``, and nothing in either process says whether they are one module.

Contract (checked at construction and by ``refresh_structure``, the same ``ValueError`` on
every rank): each tie path names a parameter of the step (``""``: the whole step); the layers
of one group on a rank have the same parameter objects under the group's names, in the same
``named_parameters`` order (the same module, or the same ``Parameter``, as
:meth:`LayerParallelResNet.build` makes them); no parameter is shared between layers of
different groups, under different names, or with an untied layer; the holders of a group
agree on its parameter names, shapes and dtypes (one ``allgather``).

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
  gradients, or the stacked gradients of the batched path -- a shared parameter is stacked
  once per layer, one row each -- where the group's total goes to the group's first local
  row and zeros to its other rows, so that ``torch.stack``'s backward sums it once); on the
  one-level pipelined path in :class:`TiedSync`, an autograd node created before the rank's
  first layer, so it runs after the rank's last layer gradient and after the state gradient
  went to the previous rank (no rank waits in the ``Allreduce`` for a message that would come
  after it).
* **Checkpoints.** Keys stay those of ``to_serial().state_dict()`` (every layer's entries, as
  serial PyTorch lists a module or parameter used several times); a gathered state dict maps
  all layers of a group to one tensor object, so a saved file holds one copy, and it loads on
  any rank count.

Cost: one ``Allreduce`` per backward of ``sum(group parameter sizes)`` values over the layer
communicator, whichever ranks hold the groups (a rank holding none sends zeros).
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from mpi4py import MPI

from ..chains.compiled import plain_module
from .tiespec import covers, tie_groups

__all__ = ["tie_groups", "TiedLayers", "TiedSync"]

_MPI = {torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT}


def _plain_name(name: str) -> str:
    """A parameter name without ``torch.compile``'s ``_orig_mod.`` segments."""
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


def _path_words(path: str) -> str:
    return "" if path == "" else f" (tie[{path!r}])"


def _path_error(paths, named, step, k: int) -> str | None:
    """The message when a tie path of layer ``k`` names no parameter of its step (``named``:
    the step's ``named_parameters()``), else ``None``."""
    have = {n for n, _ in named}
    for path in paths:
        if path == "" or path in have:
            continue
        alias = dict(step.named_parameters(remove_duplicate=False))
        if path in alias:
            other = next(n for n, p in named if p is alias[path])
            what = f"the same Parameter as {other!r} (listed under that name): name {other!r}"
        elif path in dict(step.named_modules()):
            what = ("a submodule, not a parameter: name each of its parameters (e.g. "
                    f"{path + '.weight'!r}), or use '' for the whole step")
        else:
            what = (f"no parameter of layer {k}'s step ({type(step).__name__}, parameters "
                    f"{sorted(have)[:8]})")
        return f"tie path {path!r} names {what}"
    return None


class TiedLayers:
    """The tie groups of one segment as seen by one rank (see the module docstring).

    Args:
        ties: :func:`~mgrit.nn.resnet.tiespec.tie_groups` of the segment (global, the same on
            every rank).
        steps: this rank's step modules (layer ``first + j`` is ``steps[j]``).
        first: global index of ``steps[0]``.
        partition: the segment's :class:`~mgrit.grid.Partition`; comm: its layer communicator.

    Attributes:
        spanning: the groups held by more than one rank (global numbers, ascending).
        rows: ``{group: [local row, ...]}`` for the groups this rank holds.
        names, params: ``{group: [name, ...]}`` / ``{group: [Parameter, ...]}``
            (``named_parameters`` order of the step) of the parameters each held group ties.
    """

    def __init__(self, ties, steps, first: int, partition, comm: MPI.Comm):
        self.ties, self.comm, self.first = ties, comm, int(first)
        self.first_layer = dict(enumerate(ties.first))
        holders = {g: {partition.owner(k) for k in ks} for g, ks in enumerate(ties.members)}
        self.root = {g: partition.owner(k) for g, k in self.first_layer.items()}
        self.spanning = sorted(g for g, h in holders.items() if len(h) > 1)
        self.rows: dict = {}
        self.n_local = len(steps)
        for j in range(len(steps)):
            for _, g in ties.layers[self.first + j]:
                self.rows.setdefault(g, []).append(j)
        self._bind(steps)
        self.slots: list = []  # (group, index in params[group], offset, numel) in the buffer
        self.size = 0
        self.dtype, self.device = None, torch.device("cpu")

    def _bind(self, steps) -> None:
        self._steps = steps
        self.names, self.params = {}, {}
        for g, r in self.rows.items():
            path = self.ties.paths[g]
            named = [(n, p) for n, p in plain_module(steps[r[0]]).named_parameters()
                     if covers(path, n)]
            self.names[g] = [n for n, _ in named]
            self.params[g] = [p for _, p in named]

    def rebind(self, steps, dtype: torch.dtype, device) -> None:
        """Re-read the parameters after ``.to()``/``.double()`` replaced them (local; the
        layout's sizes are unchanged)."""
        self._bind(steps)
        self.dtype, self.device = dtype, torch.device(device)

    # -- checks --------------------------------------------------------------------------
    def structure_error(self, steps) -> str | None:
        """This rank's violation of the contract (a message) or ``None`` (local)."""
        owner = {}
        ties = self.ties
        for j, s in enumerate(steps):
            k = self.first + j
            named = list(plain_module(s).named_parameters())
            error = _path_error(ties.named[k], named, plain_module(s), k)
            if error:
                return error
            for path, g in ties.layers[k]:
                mine = [id(p) for n, p in named if covers(path, n)]
                if mine != [id(p) for p in self.params[g]]:
                    k0 = self.first + self.rows[g][0]
                    if path == "":
                        return (f"tie puts layers {k0} and {k} in one group, but they do not use "
                                f"the same parameters: make_step must return the same module "
                                f"for every layer of a group (LayerParallelResNet.build(..., "
                                f"tie=...) does this), or drop the tie")
                    return (f"tie[{path!r}] puts layers {k0} and {k} in one group, but their "
                            f"{path!r} are different Parameter objects: give the layers of a "
                            f"group one Parameter (LayerParallelResNet.build(..., tie=...) "
                            f"does this), or drop the tie")
            for name, p in named:
                g = ties.group_of(k, name)
                j2, name2, g2 = owner.setdefault(id(p), (j, name, g))
                if j2 != j and (g is None or g2 != g or name2 != name):
                    return (f"layers {self.first + j2} and {k} share the parameter {name2!r} "
                            f"but tie does not put them in one group: declare every sharing with "
                            f"tie (one group per shared module, or tie={{'{name}': ...}} for "
                            f"one parameter) or give each layer its own parameters")
        return None

    def setup(self) -> None:
        """Agree on the spanning groups' parameter layout (one ``allgather``) and make the
        replicas identical (one ``Allreduce``). Collective; ``ValueError`` on every rank."""
        mine = {g: [(n, tuple(p.shape), str(p.dtype)) for n, p in
                    zip(self.names[g], self.params[g])]
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
                    raise ValueError(f"tie group of layer {self.first_layer[g]}"
                                     f"{_path_words(self.ties.paths[g])}: ranks "
                                     f"{layout[g][0]} and {r} hold different parameters "
                                     f"({layout[g][1]} vs {sig}): every rank must build the same "
                                     f"{'module' if self.ties.paths[g] == '' else 'parameter'} "
                                     f"for a group (names, shapes and dtypes)")
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

    def reduce_stacked_grads(self, grads: list, names: Sequence[str]) -> list:
        """Stacked gradients (one ``(n_local, *shape)`` per parameter name ``names`` of the
        template, ``None``: none) with each spanning group's rows summed over the layer ranks:
        the total in the group's first local row, zeros in its other rows (``torch.stack``'s
        backward then sums them into the parameter once). Returns the new list. Collective."""
        if not self.size:
            return grads
        pos = {_plain_name(n): i for i, n in enumerate(names)}
        flat = self._buffer()
        with torch.no_grad():
            for g, i, off, n in self.slots:
                if g in self.params:
                    gr = grads[pos[self.names[g][i]]]
                    if gr is not None:
                        flat[off:off + n].copy_(gr[self.rows[g]].sum(0).reshape(-1))
            self._allreduce(flat)
            out = [None if gr is None else gr.clone() for gr in grads]
            for g, i, off, n in self.slots:
                if g in self.params:
                    p, rows, s = self.params[g][i], self.rows[g], pos[self.names[g][i]]
                    if out[s] is None:
                        out[s] = torch.zeros((self.n_local, *p.shape), dtype=p.dtype,
                                             device=p.device)
                    out[s][rows[0]] = flat[off:off + n].view_as(p)
                    if len(rows) > 1:
                        out[s][rows[1:]] = 0
        return out

    # -- the one-level path -------------------------------------------------------------------
    def local_parameters(self) -> list:
        """The parameters of the spanning groups this rank holds, in buffer order."""
        return [self.params[g][i] for g, i, _, _ in self.slots if g in self.params]

    def substitutions(self, aliases: Sequence[torch.Tensor], steps) -> list:
        """Per local layer: ``{name: alias}`` for its parameters of spanning groups (the
        outputs of :class:`TiedSync`, in :meth:`local_parameters` order), else ``None``."""
        alias = {id(p): a for p, a in zip(self.local_parameters(), aliases)}
        subs = []
        for s in steps:
            mine = {n: alias[id(p)] for n, p in s.named_parameters() if id(p) in alias}
            subs.append(mine or None)
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
