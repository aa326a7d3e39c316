"""The autograd bridge of :class:`~mgrit.nn.resnet.LayerParallelResNet`: one forward solve is
one autograd node (after TorchBraid's ``braid_function.py``) whose backward is the adjoint
solve and the parameter-gradient sweep.

What a backward needs from its forward belongs to that forward's node, never to the module:
the forward states and the stacked parameters the solve used are saved tensors (freed after the
backward unless ``retain_graph``, version-checked like every saved tensor, offloaded or
recomputed under saved-tensor hooks and ``torch.utils.checkpoint``); the forward's number and
the stacked names and the layer-to-parameter map are attributes of ``ctx``.

Contract of the stacked-parameter snapshot (:mod:`mgrit.nn.chains.contract`): the snapshot is stacked
at the forward from the layers' *current* parameters and buffers (the fingerprint checked at the
start of the forward rebuilds the stacked lists after a replacement), and the backward checks
the fingerprint again: a step module whose parameters, buffers or submodules were replaced
since the forward (its epoch changed) is a RuntimeError on every rank, never an adjoint of
other modules; an in-place change of the forward's tensors is autograd's version error.
The module keeps only the warm start (an initial guess; no gradient depends on it).

Order across ranks: each backward is a collective adjoint solve, so every rank must run the
same nodes in the same order. The autograd engine runs, among ready nodes, the one created last
(highest sequence number), and a node is ready only when every node built from its output has
run; so of two forward nodes that one backward reaches, the later one always runs first, on
every rank, whatever the rank-local parts of the graph look like. What the engine cannot see --
ranks backpropagating *different* forwards -- :func:`mgrit.nn.chains.agreement.agree_backward` turns
into a RuntimeError on every rank (one small ``allgather`` per backward, skipped on one rank).
"""
from __future__ import annotations

import operator
from contextlib import nullcontext

import torch

from ..chains.agreement import agree_backward, saved_or_error
from ..chains.contract import hooks_suspended
from ..chains.propagators import AdjointChain
from ..steps.batchnorm import frozen_statistics, replica_comm, replicas_agree

__all__ = ["MGRITFunction", "node_backward", "version_error", "changed_error"]

_WHAT = "LayerParallelResNet"  # names the node in the agreement's messages and tag
_version = operator.attrgetter("_version")


def changed_error(model, epoch: int, record=None) -> str | None:
    """The message when ``model``'s step modules changed (the fingerprint of
    :mod:`mgrit.nn.chains.contract`, checked here too) since the forward that ran with ``epoch``
    (``record``: the fingerprint's record then; modules rebuilt since but back to the same
    entries, e.g. after a ``torch.func.functional_call``, are not a change)."""
    model._check_contract()
    fp = model._fingerprint
    if fp.epoch == epoch or (record is not None and fp.matches(record)):
        return None
    return ("the step modules of this rank changed between a forward and its backward (a "
            "parameter, buffer or submodule replaced or added, or .to() of a step): the adjoint "
            "solve needs the modules the forward used; backpropagate before replacing "
            "parameters (e.g. load_state_dict(..., assign=True)) or converting steps")


def version_error(tensors, versions, names) -> str | None:
    """Autograd's message when a tensor of ``tensors`` (parameters and buffers whose
    ``_version`` counters were ``versions`` at the forward) was changed in place since;
    ``names()`` gives their names (only called on an error). ``None`` when none was."""
    now = tuple(map(_version, tensors))
    if now == versions:
        return None
    if len(now) != len(versions):
        return (f"the parameters or buffers of this rank's layers changed since the forward "
                f"({len(now)} tensors now, {len(versions)} then): one of the variables needed "
                f"for gradient computation has been modified by an inplace operation")
    i = next(i for i, (a, b) in enumerate(zip(now, versions)) if a != b)
    return (f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {names()[i]} is at version {now[i]}; expected version "
            f"{versions[i]} instead (it was changed in place between the forward and its "
            f"backward, e.g. by optimizer.step())")


class MGRITFunction(torch.autograd.Function):
    """``apply(model, batch, token, x0, snapshot, *params)``: the model's forward solve as one
    node.

    ``token`` is the model's grad-requiring empty tensor: in grad mode every rank's output then
    requires grad and every rank joins the backward, also where nothing else requires grad
    (frozen layers, no input) -- a rank-local decision would leave the other ranks waiting in
    the adjoint solve. ``x0``: the input on the first layer rank; elsewhere the user's tensor
    (only linking it to the graph) or an empty one.

    Two ways to reach the parameters (the same gradients; :meth:`LayerParallelResNet.forward`
    picks one per forward):

    * ``snapshot=None``, ``params``: the model's unique parameters, each an input of the node
      (saved, so autograd's version check covers them); the backward returns one gradient per
      parameter. Any step module.
    * ``snapshot``: the batched chain's stacked snapshot taken with autograd
      (``ForwardChain.refresh(grad=True)``), ``params`` its stacked parameters (one per
      parameter name): ``torch.stack``'s node, not this one, fans the stacked gradient out to
      the layers' parameters, so the node costs no Python work per parameter. The versions of
      the layers' parameters and buffers are recorded here and compared in the backward
      (autograd's "modified by an inplace operation" error, as for saved tensors).
    """

    @staticmethod
    def forward(ctx, model, batch, token, x0, snapshot, *params):
        out, states, stacked = model._forward_solve(x0 if model.is_first else None, batch, True,
                                                    snapshot)
        ctx.model, ctx.forward_id, ctx.stack_names = model, model._forward_count, tuple(stacked)
        ctx.param_index = model._param_index  # layer -> unique parameter, as of this forward
        ctx.stacked_inputs = snapshot is not None
        ctx.epoch = model._fingerprint.epoch  # the fast paths this forward ran with
        ctx.record = model._fingerprint.record
        ctx.noise = (model._noise.seed, model._noise.masks)  # Dropout masks of this forward
        ctx.rng_error = model._rng_error
        if ctx.stacked_inputs:
            ctx.checked = model._checked
            ctx.versions = tuple(map(_version, ctx.checked))
            ctx.save_for_backward(states, *stacked.values())
        else:
            ctx.save_for_backward(states, *stacked.values(), *params)
        return out

    @staticmethod
    def backward(ctx, grad):
        model = ctx.model  # the forward's masks; BatchNorm: batch statistics, no update
        # hooks registered since the forward: the layer recomputations must not fire them
        quiet_hooks = hooks_suspended(model.steps) if model._fingerprint.hooked() else nullcontext()
        with model._noise.use(*ctx.noise), frozen_statistics(model._bns), quiet_hooks, \
                replicas_agree([model._bsolver], replica_comm(model._bns)):
            gx0, *pgrads = node_backward(model, ctx, grad)
        return (None, None, None, gx0, None, *pgrads)


def node_backward(model, ctx, grad) -> tuple:
    """Gradients of one forward (``ctx``) of ``model`` for ``(x0, *params)`` (the node's
    parameter inputs: unique parameters, or stacked ones)."""
    saved, error = saved_or_error(ctx, ctx.forward_id, "LayerParallelResNet")
    if error is None:
        error = changed_error(model, ctx.epoch, ctx.record)
    if error is None and ctx.stacked_inputs:
        error = version_error(ctx.checked, ctx.versions, model._checked_names)
    error = error or getattr(ctx, "rng_error", None)  # a step drew from the default generator
    need_x = model.is_first and ctx.needs_input_grad[3]
    need_p = ctx.needs_input_grad[5:]
    if not agree_backward(model.comm, _WHAT, ctx.forward_id, error, (need_x or any(need_p),))[0]:
        return (None,) * (1 + len(need_p))  # no rank needs anything: no adjoint solve
    ns = len(ctx.stack_names)  # saved: states, stacked tensors[, parameters (version check)]
    states = saved[0]
    tensors = {k: t.detach() for k, t in zip(ctx.stack_names, saved[1:1 + ns])}
    ties = model._tied if model._tied is not None and model._tied.size else None
    if ctx.stacked_inputs:
        gx0, grads = _adjoint(model, states, tensors, grad, need_x, "stacked")
        if ties is not None:  # weight-tied groups across ranks: the sum over the ranks
            grads = ties.reduce_stacked_grads(list(grads))
        return (gx0, *[g if w else None for g, w in zip(grads, need_p)])
    index = ctx.param_index
    tied = len(index) != len(need_p)
    if tied or not all(need_p):
        need = [need_p[i] for i in index]
    else:
        need = None  # the ordinary path: every parameter, each in one layer
    gx0, flat = _adjoint(model, states, tensors, grad, need_x, need)
    if flat is None:
        pgrads = [None] * len(need_p)
    elif not tied:
        pgrads = flat
    else:  # shared parameters: the sum over the layers that use them, as serial autograd
        pgrads = [None] * len(need_p)
        for i, g in zip(index, flat):
            if g is not None:
                pgrads[i] = g if pgrads[i] is None else pgrads[i] + g
    if ties is not None:  # weight-tied groups across ranks: the sum over the ranks
        ties.reduce_parameter_grads(pgrads, {id(p): i for i, p in enumerate(model._params)})
        pgrads = [g if w else None for g, w in zip(pgrads, need_p)]
    return (gx0, *pgrads)


def _adjoint(model, states, tensors, grad, need_x: bool, need):
    """Adjoint solve at one forward's ``states`` (``tensors``: its stacked parameters), then
    the parameter-gradient sweep: ``need`` ``None`` (every parameter), a list of flags per
    layer parameter, or ``"stacked"`` (one stacked gradient per parameter name). Returns
    ``(gx0 or None, gradients or None)``."""
    shape = states.shape[1:]
    solver = model._bsolver
    # closed-form single adjoint steps in multilevel solves; a one-level adjoint solve (Kirby's
    # serial adjoint) stays autograd through each layer: backprop bit for bit
    chain = AdjointChain(model._chain, model.n_layers, states, tensors,
                         closed_single=solver.hierarchy.n_levels > 1, spatial=model.spatial)
    solver.propagator = chain
    lam_N = grad.detach().reshape(shape) if model.is_last else None
    warm = model._warm_adj
    guess = warm if (model.warm_start_adjoint and warm is not None
                     and warm.shape[1:] == shape) else None
    res = solver.solve(lam_N, initial_guess=guess, state_shape=shape)
    model.last_backward = res
    if model.warm_start_adjoint:
        model._warm_adj = res.states
    N, lo = model.n_layers, res.lo
    gx0 = res.states[N - lo].clone() if need_x else None
    if need is not None and need != "stacked" and not any(need):
        return gx0, None
    # lambda_{k+1} for local layers k = first..first+n-1 is reversed point N-k-1: a reversed
    # block of consecutive rows
    n, top = len(model.steps), N - model.first - lo
    lam_next = res.states[top - n:top].flip(0)
    if need == "stacked":
        return gx0, chain.stacked_gradients(lam_next)
    batched = model.bwd_opts.batched and model.bwd_opts.max_levels > 1
    return gx0, chain.parameter_gradients(lam_next, batched, need)
