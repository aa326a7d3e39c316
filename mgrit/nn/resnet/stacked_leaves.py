"""Stacked-leaf parameters of a :class:`~mgrit.nn.resnet.LayerParallelResNet`
(``stacked_parameters=True``, opt-in): one leaf tensor per parameter name holding every local
layer's values, ``(n_local, *shape)``, as ``torch.func.stack_module_state`` makes them.

Why: with per-layer leaves the MGRIT backward's stacked gradient is handed to autograd, which
splits it into one ``AccumulateGrad`` per layer and name (about 4 us each), and the optimizer
then updates every tensor separately; with stacked leaves both are one operation per name.

What a user sees (the contract; rationale in ``docs/fast_paths.rst``):

* ``model.parameters()`` / ``named_parameters()`` yield the stacked leaves, named
  ``stacked.<name>`` (``stacked.weight``, ``stacked.lin.bias``: the step's own names under
  ``stacked.``), so optimizers, clipping and gradient buckets update a few big tensors.
* A step module's parameter (``model.steps[j].weight``) is the view ``stacked.weight[j]``
  (not a leaf; it is not in the step's ``_parameters``): calling a step, the serial pipeline
  (hooks, autocast, ``functional_call``) and the library's per-layer kernels read it, and
  gradients through it reach the stacked leaf, as serial autograd would give them.
* ``state_dict()`` keys and values are exactly the unstacked model's (``steps.{j}.{name}``),
  and ``load_state_dict`` takes them, so checkpoints interchange with an unstacked model.
* Freezing: ``model.stacked.weight.requires_grad_(False)`` (every local layer of that name).
  One layer's parameter cannot be frozen alone (it is a view: torch refuses ``requires_grad_``).
* Replacing a stacked leaf (``load_state_dict(..., assign=True)``, ``model.stacked.weight =
  nn.Parameter(...)``, ``.to()``) is handled: the views are re-made from the new leaf.
  Assigning a step's parameter (``model.steps[j].weight = ...``) is refused: a RuntimeError
  at the next forward (naming the layer and the parameter), never a silent mix.
* ``copy.deepcopy`` of the model is refused by torch (views are not graph leaves): use
  ``to_serial()`` or the state dict.

Checked on every forward, in O(layers x names) identity comparisons of C-level passes
(:meth:`StackedLeaves.check`): the leaves are the ones the views were made from (else the
views are re-made), with the same ``requires_grad`` flags, and every step still holds its
view. Built only where every local layer has the same parameter names, shapes, dtypes,
devices and ``requires_grad`` flags and no parameter is shared (ValueError otherwise).
"""
from __future__ import annotations

import contextlib
import functools
import operator

import torch
from torch import nn

from ...comm import raise_agreed
from ..chains.compiled import plain_module
from ..chains.contract import quiet

__all__ = ["StackedLeaves", "stacking_error", "with_layer_parameters", "install_leaves"]


def with_layer_parameters(method):
    """Decorator of a :class:`~mgrit.nn.LayerParallelNet` method that reads or loads its layers
    one by one (``to_serial``, the global state dict): inside it, the steps of every
    ``stacked_parameters=True`` segment hold ordinary parameters aliasing the stacked rows
    (:meth:`StackedLeaves.materialized`)."""
    @functools.wraps(method)
    def wrapped(net, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            for seg in net.segments:
                leaves = getattr(seg, "_leaves", None)
                if leaves is not None:
                    stack.enter_context(leaves.materialized())
            return method(net, *args, **kwargs)
    return wrapped


def stacking_error(steps, first: int) -> str | None:
    """Why ``steps`` cannot hold stacked-leaf parameters (a message), or ``None``."""
    if len(steps) < 2:
        return (f"stacked_parameters=True needs at least two layers per rank (this rank holds "
                f"{len(steps)})")
    if any(plain_module(s) is not s for s in steps):
        return "stacked_parameters=True does not support torch.compile'd step modules"
    names = [(n, p) for n, p in steps[0].named_parameters()]
    seen = {}
    for j, s in enumerate(steps):
        mine = list(s.named_parameters(remove_duplicate=False))
        if [n for n, _ in mine] != [n for n, _ in names]:
            return (f"stacked_parameters=True: layer {first + j} has other parameter names than "
                    f"layer {first}")
        for (n, p), (_, q) in zip(mine, names):
            if id(p) in seen:
                return (f"stacked_parameters=True: parameter {n!r} of layer {first + j} is "
                        f"shared (the same Parameter as {seen[id(p)]}): use distinct "
                        f"parameters per layer or stacked_parameters=False")
            seen[id(p)] = f"layer {first + j}'s {n!r}"
            if (p.shape, p.dtype, p.device, p.requires_grad) != \
                    (q.shape, q.dtype, q.device, q.requires_grad):
                return (f"stacked_parameters=True: parameter {n!r} of layer {first + j} differs "
                        f"from layer {first}'s in shape, dtype, device or requires_grad")
    return None


def _site(step: nn.Module, name: str):
    prefix, _, leaf = name.rpartition(".")
    return step.get_submodule(prefix), leaf


class StackedLeaves:
    """The stacked leaves of a rank's ``steps`` and the views the steps hold (see the module
    docstring). ``holder``: the ``nn.Module`` (registered as the model's ``stacked``) whose
    parameters are the leaves, mirroring the step's submodule tree; ``names``: the step's
    parameter names (``named_parameters`` order)."""

    def __init__(self, steps, first: int):
        self.first = first
        self.error = None  # set for good once a step's parameter was assigned (check)
        self._depth = 0  # materialized() nesting
        self.names = [n for n, _ in steps[0].named_parameters()] if len(steps) else []
        self.holder = nn.Module()
        self._sites = {n: [_site(s, n) for s in steps] for n in self.names}
        self._own = {}
        for n in self.names:
            for m, leaf in self._sites[n]:
                self._own.setdefault(m, []).append(leaf)
        for n in self.names:
            sub, leaf = _site(steps[0], n)
            owner = self.holder
            for part in n.split(".")[:-1]:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            rows = [m._parameters[leaf].detach() for m, leaf in self._sites[n]]
            flag = sub._parameters[leaf].requires_grad
            owner.register_parameter(leaf, nn.Parameter(torch.stack(rows), requires_grad=flag))
        self._holder_sites = {n: _site(self.holder, n) for n in self.names}
        with quiet():  # not a user's change of the modules
            for n in self.names:
                for m, leaf in self._sites[n]:
                    del m._parameters[leaf]
        self.install()

    def leaf(self, name: str) -> nn.Parameter:
        """The stacked leaf of parameter ``name`` (as the holder holds it now)."""
        sub, leaf = self._holder_sites[name]
        return sub._parameters[leaf]

    def install(self) -> None:
        """Make every step's parameter attribute the view of its row of the current leaf
        (nothing once :attr:`error` is set: the refusal stays)."""
        if self.error is not None:
            return
        leaves = [self.leaf(n) for n in self.names]
        flags = [(w.requires_grad, w.data_ptr()) for w in leaves]
        old = getattr(self, "_leaves", None)
        # new leaves: the owner's next check rebuilds what it derived from the old ones
        self._changed = old is not None and (flags != self._flags or not all(
            map(operator.is_, leaves, old)))
        self._leaves, self._flags = leaves, flags
        self._dicts, self._keys, self._views = [], [], []
        for n, w in zip(self.names, self._leaves):
            for j, (m, leaf) in enumerate(self._sites[n]):
                v = w[j]  # a view: gradients through it reach the leaf
                m.__dict__[leaf] = v
                self._dicts.append(m.__dict__)
                self._keys.append(leaf)
                self._views.append(v)

    def view_ids(self) -> frozenset:
        return frozenset(map(id, self._views))

    def check(self) -> bool:
        """The per-call check (module docstring). Re-makes the views after a leaf was replaced
        or (un)frozen and returns True then (the owner rebuilds what used the old leaves);
        sets :attr:`error` (the refusal, for good) when a step's parameter was assigned or the
        leaves were substituted by ``torch.func.functional_call``."""
        if self.error is not None:
            return False
        try:
            same = all(map(operator.is_, map(operator.getitem, self._dicts, self._keys),
                           self._views))
        except KeyError:
            same = False
        if not same:
            for n in self.names:
                for j, (m, leaf) in enumerate(self._sites[n]):
                    if leaf in m._parameters or leaf in m._buffers or \
                            m.__dict__.get(leaf) is not self._views[self._index(n, j)]:
                        self.error = (
                            f"stacked_parameters=True: parameter {n!r} of layer {self.first + j} "
                            f"was replaced; in this mode a layer's parameter is a view of the "
                            f"stacked leaf 'stacked.{n}': change its values in place (under "
                            f"torch.no_grad()), load a state dict, or build the model with "
                            f"stacked_parameters=False")
                        return False
        leaves = [self.leaf(n) for n in self.names]
        if not all(isinstance(w, nn.Parameter) for w in leaves):
            self.error = ("torch.func.functional_call of a model with stacked_parameters=True "
                          "is not supported: build it with stacked_parameters=False")
            return False
        if not all(map(operator.is_, leaves, self._leaves)) or \
                [(w.requires_grad, w.data_ptr()) for w in leaves] != self._flags:
            self.install()
        changed, self._changed = self._changed, False
        return changed

    def _index(self, n: str, j: int) -> int:
        return self.names.index(n) * len(self._sites[n]) + j

    def snapshot(self, grad: bool) -> dict:
        """``{name: (n_local, *shape)}``: the leaves themselves (``grad``) or detached."""
        return {n: (w if grad else w.detach()) for n, w in zip(self.names, self._leaves)}

    @contextlib.contextmanager
    def materialized(self):
        """Inside, every step holds ordinary ``Parameter`` objects sharing the leaves' memory
        (for copies and per-step state dicts: ``to_serial``, the global state dict)."""
        if self._depth:  # nested (a global view calling another): already ordinary
            yield
            return
        if self.error is not None:
            raise ValueError(self.error)
        self.install()  # the leaves now (a load with assign=True may have replaced them)
        self._depth += 1
        with quiet():
            for n, w in zip(self.names, self._leaves):
                for j, (m, leaf) in enumerate(self._sites[n]):
                    m.__dict__.pop(leaf, None)
                    m._parameters[leaf] = nn.Parameter(w.detach()[j], w.requires_grad)
            try:
                yield
            finally:
                self._depth -= 1
                for n in self.names:
                    for m, leaf in self._sites[n]:
                        del m._parameters[leaf]
                self.install()

    # -- state dict: the unstacked model's keys ------------------------------------------------
    def state_dict_hook(self, module, state, prefix, local_metadata):
        """Replace ``stacked.*`` by the per-layer keys, in the unstacked model's order."""
        mine = [k for k in state if k.startswith(prefix)]
        saved = {k: state.pop(k) for k in mine}
        per_layer = {}
        for n in self.names:
            w = self.leaf(n)  # the leaf now (not the views' leaf: assign=True replaces it)
            saved.pop(f"{prefix}stacked.{n}", None)
            rows = w.detach()
            for j in range(rows.shape[0]):
                per_layer[f"{prefix}steps.{j}.{n}"] = rows[j]
        for k in self._order(module, prefix):
            if k in per_layer:
                state[k] = per_layer.pop(k)
            elif k in saved:
                state[k] = saved.pop(k)
        state.update(saved)
        state.update(per_layer)
        return state

    def _order(self, module, prefix):
        """The unstacked model's state-dict keys (parameters before buffers per module)."""
        keys = []
        for mname, m in module.named_modules(prefix=prefix.rstrip(".")):
            if mname == prefix + "stacked" or mname.startswith(prefix + "stacked."):
                continue
            base = mname + "." if mname else ""
            params = self._own.get(m, []) + list(m._parameters)
            keys += [base + k for k in params]
            keys += [base + k for k, b in m._buffers.items()
                     if b is not None and k not in m._non_persistent_buffers_set]
        return keys

    def load_pre_hook(self, module, state, prefix, local_metadata, strict, missing,
                      unexpected, errors):
        """Stack the per-layer keys of a state dict into ``stacked.*`` before loading."""
        self._missing = []
        for n in self.names:
            w = self.leaf(n)
            keys = [f"{prefix}steps.{j}.{n}" for j in range(w.shape[0])]
            if f"{prefix}stacked.{n}" in state:
                continue  # already stacked
            have = [k in state for k in keys]
            if not any(have):
                self._missing.append((f"{prefix}stacked.{n}", keys))
                continue
            rows = list(w.detach().unbind(0))
            bad = False
            for j, k in enumerate(keys):
                if not have[j]:
                    self._missing.append((None, [k]))
                    continue
                v = state.pop(k)
                if not isinstance(v, torch.Tensor) or v.shape != rows[j].shape:
                    errors.append(f"size mismatch for {k}: copying a param with shape "
                                  f"{tuple(getattr(v, 'shape', ()))} from checkpoint, the shape "
                                  f"in current model is {tuple(rows[j].shape)}.")
                    bad = True
                    continue
                rows[j] = v.to(w.dtype)
            if not bad:
                state[f"{prefix}stacked.{n}"] = torch.stack(rows)

    def load_post_hook(self, module, incompatible):
        """Report missing per-layer keys under their unstacked names."""
        for stacked_key, keys in getattr(self, "_missing", []):
            if stacked_key is not None and stacked_key in incompatible.missing_keys:
                incompatible.missing_keys.remove(stacked_key)
            for k in keys:
                incompatible.missing_keys.append(k)
        self._missing = []


def install_leaves(model, tie, spatial) -> None:
    """``LayerParallelResNet(stacked_parameters=True)``: the checks (agreed over
    ``model.comm``), then the stacked leaves and the state-dict hooks that keep the unstacked
    model's keys."""
    o = model.fwd_opts, model.bwd_opts
    error = ("stacked_parameters=True with tie=... is not supported" if tie is not None else
             "stacked_parameters=True with spatial=... is not supported" if spatial is not None
             else "stacked_parameters=True needs adjoint='mgrit'" if model.adjoint != "mgrit" else
             "stacked_parameters=True needs batched solves (MGRITOptions(batched=True))"
             if not (o[0].batched and o[1].batched) else
             "stacked_parameters=True needs multilevel solves (max_levels >= 2)"
             if o[1].max_levels < 2 or o[0].max_levels < 2 else
             stacking_error(model.steps, model.first))
    raise_agreed(model.comm, error)
    model._leaves = StackedLeaves(model.steps, model.first)
    model.stacked = model._leaves.holder
    model._register_state_dict_hook(model._leaves.state_dict_hook)
    model._register_load_state_dict_pre_hook(model._leaves.load_pre_hook, with_module=True)
    model.register_load_state_dict_post_hook(model._leaves.load_post_hook)
    model._collect_parameters()
