"""Batched evaluation of several layers' step modules, and the proof that it is exact.

A rank holding layers ``F_a .. F_b`` of one module class may evaluate them in one call with
their parameters stacked along a new dim 0 (``bmm`` for dense steps, a grouped convolution for
conv steps, else ``torch.func.vmap`` over ``functional_call``). Such a call applies the *first*
layer's module (the template) with every layer's parameters and buffers, so it equals the
per-layer calls only when the layers differ in nothing but those tensors.

Contract (the batching proof, :func:`batching_obstacle`; run when a chain is built and again
whenever the per-call fingerprint of :mod:`mgrit.nn.chains.contract` sees the modules change):

* every step has the template's module tree: same submodule names and types;
* the same parameter and buffer names, shapes, dtypes and devices at every submodule (values
  may differ: they are stacked), and the same tying of parameters inside a step;
* every other instance attribute (``vars(m)``, private ones included; torch's own bookkeeping
  skipped) is equal to the template's: numbers, strings, ``None``, dtypes, devices and
  containers of them by ``==``; tensors that are not parameters or buffers by dtype, shape,
  device and ``torch.equal``; anything else (functions, lambdas, closures, bound methods,
  arbitrary objects) only if it is the *same object*;
* the same ``training`` flag at every submodule;
* no forward / backward / pre hooks on any submodule, and no global module hooks;
* no submodule class sets ``batchable = False`` (the documented opt-out), and no BatchNorm
  (:mod:`mgrit.nn.steps.batchnorm` replaces its forward during solves).

Otherwise the layers are evaluated one by one: slower, never different. Per-layer state that
should stay batched belongs in a buffer (``register_buffer``): buffers are stacked per layer.

The batched call is the module's own ``forward_batched`` only where
:func:`mgrit.nn.chains.contract.kernel` allows it (the class that defines the kernel is the class of
the ``forward`` being called, or below it; its ``kernel_obstacle()`` is ``None``); otherwise
``vmap`` of ``functional_call``, which calls the module's own ``forward``.

What is checked when (:class:`mgrit.nn.chains.contract.Fingerprint`, on every forward of a
:class:`~mgrit.nn.resnet.LayerParallelResNet`): parameters, buffers and submodules replaced or
added, dtypes and devices, ``training`` flags and hooks; any change re-runs this proof and
re-collects the stacked tensors (``_lists``). Plain Python attributes assigned after build are
compared only when the proof runs (after such a change, or
``LayerParallelResNet.refresh_structure()``).
"""
from __future__ import annotations

import numbers
from typing import Sequence

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.modules.batchnorm import _BatchNorm

from .contract import global_hooks_registered, hooks_suspended, kernel, quiet

__all__ = ["batching_obstacle", "Stacked", "StaleStack"]

#: torch's own bookkeeping of every module (not user state)
_TORCH_ATTRS = frozenset(vars(nn.Module()))
#: of those, the hooks that change what calling a module computes
_CALL_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_PLAIN = (numbers.Number, str, bytes, type(None), torch.dtype, torch.device)


def _equal(a, b) -> bool:
    """Equality of two attribute values for the batching proof (see the module docstring)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and type(a) is type(b)
                and a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                and bool(torch.equal(a, b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, _PLAIN):
        return bool(a == b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (set, frozenset)):
        return all(isinstance(x, _PLAIN) for x in a) and a == b
    return False  # callables, closures, bound methods, other objects: identity only


def _tensor_meta(t):
    return None if t is None else (tuple(t.shape), t.dtype, t.device)


def _module_obstacle(a: nn.Module, b: nn.Module, where: str) -> str | None:
    """Why module ``b`` cannot be evaluated with module ``a``'s settings (``None``: it can)."""
    if type(a) is not type(b):
        return f"{where}: {type(b).__name__} vs {type(a).__name__}"
    if getattr(b, "batchable", True) is False:
        return f"{where}: {type(b).__name__}.batchable is False"
    if isinstance(b, _BatchNorm):  # statistics of each layer's own batch (mgrit.nn.steps.batchnorm)
        return f"{where}: {type(b).__name__} is evaluated layer by layer"
    for m in (a, b):
        hooks = [h for h in _CALL_HOOKS if getattr(m, h, None)]
        if hooks:
            return f"{where}: {type(m).__name__} has {hooks[0][1:]} registered"
    for kind in ("_parameters", "_buffers"):
        ta, tb = getattr(a, kind), getattr(b, kind)
        if list(ta) != list(tb) or any(_tensor_meta(ta[k]) != _tensor_meta(tb[k]) for k in ta):
            return f"{where}: {kind[1:]} differ in names, shapes, dtypes or devices"
    if a.training != b.training:
        return f"{where}: one is in training mode, the other in evaluation mode"
    va, vb = vars(a), vars(b)
    names = sorted(k for k in va if k not in _TORCH_ATTRS)
    if names != sorted(k for k in vb if k not in _TORCH_ATTRS):
        return f"{where}: different instance attributes"
    for k in names:
        if not _equal(va[k], vb[k]):
            return f"{where}: attribute {k!r} differs ({type(vb[k]).__name__})"
    return None


def batching_obstacle(steps: Sequence[nn.Module]) -> str | None:
    """Why ``steps`` cannot be evaluated batched with ``steps[0]`` as template, or ``None`` when
    the batched call provably equals the per-layer calls (the contract of the module docstring).
    Costs Python work per submodule and attribute: call it at construction, not per step."""
    if len(steps) < 2:
        return "fewer than two layers"
    if global_hooks_registered():
        return "global module hooks are registered"
    t = steps[0]
    tmods = list(t.named_modules())
    pnames = [n for n, _ in t.named_parameters()]
    bnames = [n for n, _ in t.named_buffers()]
    for j, s in enumerate(steps):
        smods = list(s.named_modules())
        if [n for n, _ in smods] != [n for n, _ in tmods]:
            return f"layer {j}: different submodules"
        if [n for n, _ in s.named_parameters()] != pnames or \
                [n for n, _ in s.named_buffers()] != bnames:
            return f"layer {j}: different parameter tying or buffers"
        for (name, a), (_, b) in zip(tmods, smods):
            err = _module_obstacle(a, b, f"layer {j} module {name or '(step)'!r}")
            if err:
                return err
    return None


def _tensor(module: nn.Module, kind: str, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` (dotted) of ``module`` as it is now: also a plain
    tensor that ``torch.func.functional_call`` put in place of a parameter (``get_parameter``
    would refuse it)."""
    prefix, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(prefix), kind)[leaf]


class StaleStack(RuntimeError):
    """:meth:`Stacked.refresh` found a stacked tensor of another dtype or device than when the
    stack was built: the owner rebuilds it (:meth:`mgrit.nn.chains.ForwardChain.refresh`)."""


class Stacked:
    """Parameters and buffers of structurally identical modules (proven by
    :func:`batching_obstacle`), stacked along a new dim 0, and their batched application.

    Args:
        steps: the modules, at least two; ``steps[0]`` is the template.

    Attributes:
        ok: whether batching is exact (``obstacle is None``).
        obstacle: the reason it is not (a message), else ``None``.
        names, bnames: stacked parameter and buffer names (``named_parameters`` order).
        tensors: the latest :meth:`refresh` snapshot, ``{name: (B, *shape)}``.
    """

    def __init__(self, steps: Sequence[nn.Module]):
        self.template = steps[0]
        self.obstacle = batching_obstacle(steps)
        self.ok = self.obstacle is None
        self.names = [n for n, _ in steps[0].named_parameters()]
        self.bnames = [n for n, _ in steps[0].named_buffers()]
        self._lists = {}
        if self.ok:
            self._lists = {n: [_tensor(s, "_parameters", n) for s in steps] for n in self.names}
            self._lists.update({n: [_tensor(s, "_buffers", n) for s in steps]
                                for n in self.bnames})
        self.tensors = {}
        # dtype and device of every stacked name (the contract of the snapshot, checked at
        # every refresh in O(names): torch.stack would promote a layer's changed dtype)
        self._meta = [(t.dtype, t.device) for t in
                      [_tensor(steps[0], "_parameters", n) for n in self.names]
                      + [_tensor(steps[0], "_buffers", n) for n in self.bnames]]
        # native kernels only where the contract allows them (mgrit.nn.chains.contract.kernel)
        self._native = kernel(self.template, "forward_batched") is not None
        self._extras = kernel(self.template, "stack_extras") if self._native else None
        t = self.template  # decided with the proof, like _native (the adjoint's hot loop
        # asks for every batched step; the fingerprint rebuilds this object on any change)
        self._closed = bool(self._native and kernel(t, "closed_form_vjp")
                            and kernel(t, "vjp_batched") is not None
                            and kernel(t, "linearize_batched") is not None)

    @property
    def closed_form_vjp(self) -> bool:
        """The module has a closed-form batched VJP (DenseStep with a built-in activation)
        that its contract allows (:func:`mgrit.nn.chains.contract.kernel`): no autograd graph.
        Decided when the stack is built (the batching proof), as the native forward kernel is:
        O(1) per call."""
        return self._closed

    def refresh(self, grad: bool = False) -> dict:
        """Stack the current values into a new snapshot (the tensors of earlier snapshots are
        never modified: a forward's autograd node keeps its own). Returns it. ``grad``: the
        stacked parameters are recorded by autograd (``torch.stack``'s node hands each layer's
        parameter its row of a gradient w.r.t. the stack); buffers never are. A module with a
        ``forward_batched`` may also define ``stack_extras(p) -> dict``: tensors derived from
        the stacked ones (e.g. :class:`~mgrit.nn.steps.DenseStep`'s contiguous transposed
        weights), added to the snapshot under names that are not parameter names; they are
        constants (``forward_batched`` must not use them where a parameter gradient is
        taken)."""
        with torch.set_grad_enabled(grad):  # no graph: no per-tensor detach needed
            tensors = {n: torch.stack(self._lists[n]) for n in self.names}
        with torch.no_grad():
            tensors.update((n, torch.stack(self._lists[n])) for n in self.bnames)
            if any(t.dtype != dt or t.device != dev for t, (dt, dev) in zip(tensors.values(),
                                                                              self._meta)):
                raise StaleStack("a layer's parameter or buffer changed dtype or device")
            extras = self._extras
            if extras is not None:  # derived constants of the module's batched kernel
                tensors.update(extras({n: t.detach() for n, t in tensors.items()}))
        self.tensors = tensors
        return tensors

    def take(self, idx, tensors: dict | None = None) -> dict:
        """Rows ``idx`` of every stacked tensor of ``tensors`` (default: the latest snapshot);
        a ``slice`` gives views, a tensor copies."""
        tensors = self.tensors if tensors is None else tensors
        if isinstance(idx, slice):
            return {n: t[idx] for n, t in tensors.items()}
        return {n: t.index_select(0, idx) for n, t in tensors.items()}

    def apply(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """``out[b] = F_b(x[b])`` for the stacked parameters ``p`` (``(B, ...)`` each): the
        module's ``forward_batched(p, x)`` when it has one, else ``vmap`` of
        ``functional_call``."""
        if self._native:
            return self.template.forward_batched(p, x)
        with quiet():  # functional_call's swaps of the template's tensors are not changes
            return vmap(lambda pp, xx: functional_call(self.template, pp, (xx,)))(p, x)


def probe_shapes(stack: "Stacked | None", steps: Sequence[nn.Module], shapes) -> list:
    """The per-sample state ``shapes`` (spatially coarsened levels) at which ``stack``'s
    batched application of the first two layers differs from their own modules (or raises)
    on a probe batch of two (eval mode, no gradient, a private generator): there the chain
    falls back to the modules. ``[]`` without a stack. No hook fires."""
    if stack is None or not shapes:
        return []
    modes = [(m, m.training) for s in steps[:2] for m in s.modules()]
    out = []
    with hooks_suspended(nn.ModuleList(steps[:2])):
        _probe(stack, steps, shapes, out)
    for m, mode in modes:
        m.training = mode
    return out


def _probe(stack, steps, shapes, out) -> None:
    try:
        for s in steps[:2]:
            s.eval()
        t = stack.refresh()
        like = next(iter(t.values()))
        gen = torch.Generator(device=like.device).manual_seed(0)
        with torch.no_grad():
            for shape in shapes:
                x = torch.randn((2, 2, *shape), generator=gen, dtype=like.dtype,
                                device=like.device)
                try:
                    y = stack.apply(stack.take(slice(0, 2), t), x)
                    ok = all(torch.allclose(y[b], steps[b](x[b])) for b in range(2))
                except Exception:  # noqa: BLE001 - a kernel that cannot run there: fall back
                    ok = False
                if not ok:
                    out.append(tuple(shape))
    except Exception:  # noqa: BLE001 - the snapshot itself failed: every shape plain
        out[:] = [tuple(s) for s in shapes]
