"""PyTorch's function transforms around a layer-parallel forward: which ones a forward refuses,
and the refusal's message.

A layer-parallel forward is a collective: its MGRIT solve (or the pipelined sweep of the
one-level path) exchanges messages, and its backward is a collective adjoint solve. Two kinds
of transforms cannot run through it:

* **functorch transforms** (``torch.func.vmap``, ``grad``, ``vjp``, ``jacrev``, ``jvp``,
  ``jacfwd``, ``hessian``, ``functionalize``): they wrap every tensor and replay the forward
  per level; the solver's data-dependent control flow (residual tests, finite checks) and its
  messages cannot be batched or differentiated that way.
* **forward-mode AD** (``torch.autograd.forward_ad`` dual tensors): the forward solve's
  linearization (a JVP) is not implemented.

:func:`transform_error` is this rank's message (``None``: nothing active); the forwards agree
it over the layer communicator before any other message (:func:`mgrit.comm.raise_agreed`), so
that every rank raises the same ``ValueError`` -- never one rank raising inside PyTorch while
the others wait. ``torch.compile`` is no transform of this kind: the forwards are marked
:func:`compile_disabled` (a graph break), so a compiled network runs them eagerly.

Cost per forward: reading the functorch interpreter stack and forward-AD's current level (two
attribute reads); only inside a ``forward_ad.dual_level()`` are the tensors inspected.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.autograd import forward_ad

__all__ = ["transform_error", "compile_disabled", "substituted"]

#: functorch's transform types (``torch._C._functorch.TransformType`` names) -> what a user calls
_NAMES = {"Vmap": "torch.func.vmap", "Grad": "torch.func.grad (or vjp, jacrev, hessian)",
          "Jvp": "torch.func.jvp (or jacfwd, hessian)", "Functionalize": "torch.func.functionalize"}

compile_disabled = torch.compiler.disable


def _functorch_transform() -> str | None:
    """The name of the innermost active functorch transform, else ``None``."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    top = peek() if peek is not None else None
    if top is None:
        return None
    key = str(top.key()).rsplit(".", 1)[-1]
    return _NAMES.get(key, f"a functorch transform ({key})")


def _has_tangent(t) -> bool:
    return isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None


def transform_error(what: str, tensors: Iterable = ()) -> str | None:
    """This rank's refusal of the active transform (a message naming it), else ``None``.

    Args:
        what: the module in the message (``"LayerParallelResNet"``, ``"LayerParallelNet"``).
        tensors: the forward's inputs and this rank's parameters: a dual tensor among them (in
            a ``forward_ad.dual_level()``) is forward-mode AD. Only read inside a dual level.
    """
    name = _functorch_transform()
    if name is not None:
        return (f"{name} over a {what} is not supported: its forward is a collective MGRIT "
                f"solve (messages between ranks, data-dependent control flow) that functorch "
                f"cannot batch or differentiate; call the network on each sample or use "
                f"ordinary reverse mode (loss.backward(), torch.autograd.grad) on every rank")
    if getattr(forward_ad, "_current_level", -1) >= 0 and any(map(_has_tangent, tensors)):
        return (f"forward-mode AD (torch.autograd.forward_ad dual tensors) through a {what} is "
                f"not supported: the forward solve has no JVP; use reverse mode "
                f"(loss.backward(), torch.autograd.grad) on every rank")
    return None


def substituted(params: Iterable) -> bool:
    """Whether ``params`` (a module's ``parameters()``) contain tensors that are not
    ``nn.Parameter``: ``torch.func.functional_call`` (fast weights) substituted them."""
    return any(not isinstance(p, torch.nn.Parameter) for p in params)
