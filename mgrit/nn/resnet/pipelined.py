"""The one-level exact path of :class:`~mgrit.nn.resnet.LayerParallelResNet`: layer-wise model
parallelism inside autograd.

When the forward and the adjoint solve both have one level (``max_levels=1``, or a hierarchy
that cannot coarsen), each solve is a sequential sweep pipelined across the ranks, and MGRIT's
machinery (solver states, a vector-Jacobian product per layer on a graph rebuilt in the
backward, a second pass for the parameter gradients, an autograd input per parameter) only
adds cost. This path records the rank's layers in the caller's autograd graph exactly as
serial PyTorch does (``u + h * F(u)`` per layer: the operations of
:class:`~mgrit.nn.steps.ResidualStep`, so states and gradients equal serial autograd's bit for
bit on one rank), between two small autograd nodes per forward:

* :class:`_Enter` -- the rank's input state: a copy of ``x0`` on the first layer rank, else the
  state received from the previous rank. Its backward sends the gradient of that state back to
  the previous rank (first rank: returns it as ``x0``'s gradient).
* :class:`_Exit` -- sends the rank's last state to the next rank (last rank: returns a copy of
  it as the output; elsewhere an empty placeholder). Its backward runs first on every rank
  (the engine runs a backward in reverse creation order) and makes, before any message, the
  checks of the MGRIT node (:mod:`mgrit.nn.resnet.bridge`): the freed-graph check (its saved tensor),
  refusal of double backward, the version of every parameter and buffer of the rank's layers
  (an in-place change after the forward raises autograd's "modified by an inplace operation"
  on every rank, never a hang), and :func:`~mgrit.nn.chains.agreement.agree_backward`; then it receives
  the gradient of the last state from the next rank.

A training step therefore costs what serial autograd of the rank's layers costs, plus one
state message per rank boundary and direction, one small agreement per backward and one read
of every parameter's version counter per forward and per backward. The autograd semantics are
those of the MGRIT node: several forwards before a backward, ``retain_graph``,
``torch.autograd.grad`` (w.r.t. parameters, input or both; when the engine would skip
``_Enter`` because nothing before it is requested on this rank, ``_Exit`` computes the gradient
of the rank's input state itself, so the previous rank still gets it), both kinds of
``torch.utils.checkpoint`` (``_Exit``'s saved tensor is unpacked first on every rank, so a
non-reentrant recomputation runs on every rank before any backward message), ``None``
gradients for unused parameters, tied and frozen parameters (native autograd).

Phase tags: the forward (checks, sweep, messages) runs inside ``model.phase_hook("pipelined
forward")`` and each backward node inside ``model.phase_hook("pipelined adjoint")`` when the
model has a hook (:attr:`~mgrit.nn.resnet.LayerParallelResNet.phase_hook`; the training
runtime's fault handling sets it), so that an error there names its phase.

Diagnostics: ``last_forward`` is a one-level :class:`~mgrit.solver.MGRITResult` with all the
rank's states (stacked once per forward, as the solver's state array); ``last_backward`` holds
only the adjoint at the rank's first layer input (row ``0`` at reversed point ``N - first``):
the backward keeps no other adjoint.
"""
from __future__ import annotations

import sys
import time

import torch
from torch.func import functional_call

from ...collective import collective_timeout, guarded
from ...comm import Exchanger
from ...solver import MGRITResult
from ...stats import SolverStats
from ..chains.agreement import agree_backward, saved_or_error
from .bridge import _WHAT, _version, version_error
from ..chains.compiled import _is_compiled
from .tied import TiedSync

__all__ = ["one_level", "pipelined_forward"]

_TAG_STATE, _TAG_GRAD = 5001, 5002  # clear of the solver's (< 4,000) and _p2p's (>= 20,000)


def _phase(model, name: str):
    """``model.phase_hook(name)``, or :class:`~mgrit.collective.guarded` ``(name)`` when the
    model has no hook (a failure on one rank ends the job)."""
    hook = model.phase_hook
    return guarded(name) if hook is None else hook(name)


def one_level(model, grad: bool) -> bool:
    """Whether ``model``'s forward (and, with ``grad``, its adjoint) solve has one level."""
    if model._fsolver.hierarchy.n_levels != 1:
        return False
    return not grad or model._bsolver.hierarchy.n_levels == 1


class _Pass:
    """One forward through this rank's layers: what its two nodes share (no tensors, no
    autograd nodes: no reference cycle through the graph)."""

    __slots__ = ("model", "forward_id", "shape", "stats", "prev", "next", "versions",
                 "need_local", "need", "checked")

    def __init__(self, model, shape: torch.Size, stats: SolverStats):
        lv = model._fsolver.hierarchy.levels[0]
        self.model, self.forward_id, self.shape = model, model._forward_count, shape
        self.stats = stats  # of the forward
        self.prev, self.next = lv.prev, lv.next
        self.versions = self.checked = None
        self.need_local = self.need = False

    def exchanger(self, stats: SolverStats) -> Exchanger:
        m = self.model
        return Exchanger(m.comm, self.shape, m.dtype, m.device, stats)

    # -- forward halves (also the whole of a no-grad forward) ---------------------------------
    def enter(self, x0) -> torch.Tensor:
        if self.prev is None:
            return x0.clone()
        return self.exchanger(self.stats).recv(self.prev, _TAG_STATE, collective_timeout(),
                                               "the input state of its layers")

    def exit(self, y: torch.Tensor) -> torch.Tensor:
        if self.next is None:
            return y.clone()
        ex = self.exchanger(self.stats)
        ex.isend(y, self.next, _TAG_STATE)
        ex.waitall()
        return torch.zeros(0, dtype=y.dtype, device=y.device)

    # -- backward ------------------------------------------------------------------------------
    def version_error(self) -> str | None:
        """Autograd's message for a parameter or buffer changed in place since the forward."""
        m = self.model
        return version_error(self.checked, self.versions, m._checked_names)

    def send_grad(self, g: torch.Tensor | None, stats: SolverStats) -> None:
        """Record the adjoint of the rank's input state; send it to the previous rank."""
        m = self.model
        if g is None:  # nothing reached the input state (cannot happen for u + h F(u))
            g = torch.zeros(self.shape, dtype=m.dtype, device=m.device)
        res = MGRITResult(g.detach().unsqueeze(0), m.n_layers - m.first, m.n_layers - m.first + 1,
                          residuals=[0.0], iterations=1, converged=True, stats=stats)
        if self.prev is not None:
            ex = self.exchanger(stats)
            ex.isend(g, self.prev, _TAG_GRAD)
            ex.waitall()
        stats.steps_single += len(m.steps)
        m._bsolver.stats += stats
        m.last_backward = res


class _Enter(torch.autograd.Function):
    """``apply(pass, token, x0)``: the rank's input state (see the module docstring)."""

    @staticmethod
    def forward(ctx, p: _Pass, token, x0):
        ctx.p = p
        ctx.set_materialize_grads(False)
        return p.enter(x0)

    @staticmethod
    def backward(ctx, g):
        p = ctx.p
        if not p.need:  # no rank needs a gradient: no message either
            return None, None, None
        with _phase(p.model, "pipelined adjoint"):
            p.send_grad(g, SolverStats())
        return None, None, (g if p.prev is None and ctx.needs_input_grad[2] else None)


class _Exit(torch.autograd.Function):
    """``apply(pass, y, (x_in,))``: the rank's output (see the module docstring); ``x_in`` (the
    output of :class:`_Enter`, in a tuple: no autograd edge) is kept on ``ctx`` for the case the
    engine skips ``_Enter``."""

    @staticmethod
    def forward(ctx, p: _Pass, y, x_in):
        out = p.exit(y)
        ctx.p, ctx.x_in = p, x_in[0]
        ctx.save_for_backward(y)  # packed after the send: a checkpoint recomputes the send too
        return out

    @staticmethod
    def backward(ctx, grad):
        with _phase(ctx.p.model, "pipelined adjoint"):
            return _Exit._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        p = ctx.p
        m = p.model
        # saved_tensors: the freed-graph check; triggers a checkpoint recompute
        saved, error = saved_or_error(ctx, p.forward_id, "LayerParallelResNet")
        y = None if saved is None else saved[0]
        if error is None:
            error = p.version_error()
        if error is None:
            error = _retained_compiled(m)
        p.need = agree_backward(m.comm, _WHAT, p.forward_id, error, (p.need_local,))[0]
        if not p.need:
            return None, None, None
        if p.next is not None:
            grad = p.exchanger(m._bsolver.stats).recv(
                p.next, _TAG_GRAD, collective_timeout(), "the gradient of its last state")
        elif grad is None:
            grad = torch.zeros(p.shape, dtype=m.dtype, device=m.device)
        x_in = ctx.x_in
        if p.prev is not None and not torch._C._will_engine_execute_node(x_in.grad_fn):
            # autograd.grad of inputs after this rank's input only: the engine skips _Enter,
            # but the previous rank waits for the gradient of that state
            (gx,) = torch.autograd.grad(y, x_in, grad, retain_graph=True)
            p.send_grad(gx, SolverStats())
        return None, grad, None


def _retained_compiled(model) -> str | None:
    """The refusal of a ``retain_graph=True`` backward through ``torch.compile``d modules in
    the rank's layers while torch's donated buffers are on (checked before any message).

    Inductor's compiled backward with donated buffers raises under ``retain_graph`` (or
    ``create_graph``), and here it would raise on the ranks holding such layers only, after the
    agreement, while the previous rank waits for this rank's gradient. Refused on every rank
    instead; the message says how to allow it. (Some compiled backwards donate nothing and would
    pass; this check cannot tell them apart before running them.)"""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if keep is None or not keep():
        return None
    config = sys.modules.get("torch._functorch.config")  # loaded once anything was compiled
    if config is None or not getattr(config, "donated_buffer", False):
        return None
    if not any(_is_compiled(mod) for s in model.steps for mod in s.modules()):
        return None
    return ("a backward with retain_graph=True (or create_graph=True) through torch.compile'd "
            "layers: torch's compiled backward with donated buffers refuses it; set "
            "torch._functorch.config.donated_buffer = False before the first compiled call, or "
            "backpropagate without retain_graph")


def pipelined_forward(model, x0, batch: int, error: str | None = None) -> torch.Tensor:
    """The forward of ``model`` on the one-level path (grad mode: with its two nodes).
    ``error``: this rank's refusal of the forward, agreed with the input checks (a ValueError
    on every rank before any other message)."""
    with _phase(model, "pipelined forward"):
        return _forward(model, x0, batch, error)


def _forward(model, x0, batch: int, error: str | None) -> torch.Tensor:
    stats = SolverStats()
    shape = model._fsolver.check_input(x0 if model.is_first else None,
                                       state_shape=(batch, *model.state_shape), stats=stats,
                                       error=error)
    p = _Pass(model, shape, stats)
    grad = torch.is_grad_enabled()
    t0 = time.perf_counter()
    if grad:
        if not isinstance(x0, torch.Tensor):
            x0 = torch.zeros(0, dtype=model.dtype, device=model.device)
        p.checked = model._checked  # the tensors this forward's graph holds
        p.versions = tuple(map(_version, p.checked))
        p.need_local = (model.is_first and x0.requires_grad) or any(
            q.requires_grad for q in model._params)
        token, subs = model._token, None
        tied = model._tied
        if tied is not None and tied.size:  # tie groups across ranks: summed in TiedSync
            token, *aliases = TiedSync.apply(tied, token, *tied.local_parameters())
            subs = tied.substitutions(aliases, model.steps)
        u = x_in = _Enter.apply(p, token, x0)
    else:
        u, subs = p.enter(x0), None
    states = [u]
    h = model.h
    for j, s in enumerate(model.steps):  # ResidualStep's operations: bitwise serial autograd
        u = u + h * (s(u) if subs is None or subs[j] is None else functional_call(s, subs[j], (u,)))
        states.append(u)
    out = _Exit.apply(p, u, (x_in,)) if grad else p.exit(u)
    with torch.no_grad():
        local = torch.stack(states if p.next is None else states[:-1])
    stats.time["coarse"] += time.perf_counter() - t0
    stats.steps_single += len(model.steps)
    lo = model.first
    model.last_forward = MGRITResult(local, lo, lo + local.shape[0], residuals=[0.0],
                                     iterations=1, converged=True, stats=stats)
    model._fsolver.stats += stats
    if grad and model.warm_start:
        model._warm = local
    return out
