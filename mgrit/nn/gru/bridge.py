"""The autograd bridge of :class:`~mgrit.nn.gru.ParallelGRU`: one forward solve is one autograd
node, whose backward is an adjoint MGRIT solve over the reversed time chain followed by the
local vector-Jacobian products and one ``Allreduce`` of the parameter gradients (Moon & Cyr,
ICLR 2022; the bridge after TorchBraid's ``braid_function.py``, as
:class:`mgrit.nn.resnet.bridge.MGRITFunction` for the layer-parallel ResNet).

What a backward needs from its forward belongs to that forward's node, never to the module:
the forward states and input projections are saved tensors, together with the weights the
backward reads (see :class:`GRUFunction`); the forward's number and input shape are attributes
of ``ctx``. The module keeps only the warm start (an initial guess; no gradient depends on it).
Before each adjoint solve :func:`mgrit.nn.chains.agreement.agree_backward` checks, over the time
communicator, that every rank backpropagates the same forward and that no rank failed its
checks, and merges what the ranks need.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from ..chains.agreement import agree_backward, saved_or_error
from .chains import GRUAdjointChain, GRUChain

__all__ = ["GRUFunction"]


class GRUFunction(torch.autograd.Function):
    """``apply(model, want_seq, token, x, h0, *params)``: one forward solve of ``model`` (a
    :class:`~mgrit.nn.gru.ParallelGRU`) as one autograd node; returns ``(h_last, seq)``.

    ``token`` is the model's grad-requiring empty tensor: in grad mode every rank's outputs
    then require grad and every rank joins the collective backward, also where nothing else
    requires grad (frozen parameters, ``h0`` given on rank 0 only) -- a rank-local decision
    would leave the other ranks waiting in the adjoint solve. ``x`` ``(batch, seq, I)``,
    ``h0`` ``(batch, H)`` or ``None``, ``params``: ``weight_ih, weight_hh[, bias_ih,
    bias_hh]``.

    Saved: the forward states and input projections of this rank's steps, ``weight_hh``
    (always), ``x`` (when ``weight_ih`` requires grad) and ``weight_ih`` (when ``x`` does) --
    version-checked and freed after the backward unless ``retain_graph``; these are exactly the
    tensors whose in-place change makes serial ``nn.GRUCell`` autograd raise. ``bias_hh`` is
    saved as a copy: serial autograd keeps the gates, not the bias, so changing the bias in
    place between forward and backward does not raise there either, and the gradient is the
    forward's.
    """

    @staticmethod
    def forward(ctx, model, want_seq, token, x, h0, *params):
        ctx.set_materialize_grads(False)
        h_last, seq, states, gi = model._forward_solve(x, h0, want_seq, update_warm=True)
        ctx.model, ctx.forward_id, ctx.x_shape = model, model._forward_count, x.shape
        need_x, need_wih = ctx.needs_input_grad[3], ctx.needs_input_grad[5]
        b_hh = params[3].detach().clone() if len(params) == 4 else None
        ctx.save_for_backward(states, gi, params[1], b_hh, x if need_wih else None,
                              params[0] if need_x else None)
        if not want_seq:
            ctx.mark_non_differentiable(seq)
        return h_last, seq

    @staticmethod
    def backward(ctx, g_last, g_seq):
        return (None, None, None, *gru_backward(ctx.model, ctx, g_last, g_seq))


def gru_backward(model, ctx, g_last, g_seq) -> tuple:
    """Gradients of one forward (``ctx`` of :class:`GRUFunction`) for ``(x, h0, *params)``;
    ``None`` for whatever does not require grad. Collective over ``model.comm``."""
    saved, error = saved_or_error(ctx, ctx.forward_id, "ParallelGRU")
    need_x, need_h0 = ctx.needs_input_grad[3:5]
    need_p = ctx.needs_input_grad[5:]  # the same on every rank (agreed at the forward)
    todo = agree_backward(model.comm, "ParallelGRU", ctx.forward_id, error,
                          (need_x or need_h0, *need_p))
    if not any(todo):  # no rank needs anything: no adjoint solve
        return (None, None) + (None,) * len(need_p)
    return _backward_solve(model, ctx.x_shape, saved, g_last, g_seq, need_x, need_h0, todo[1:])


def _backward_solve(model, x_shape, saved, g_last, g_seq, need_x, need_h0, need_p):
    """Adjoint solve at one forward's ``saved`` tensors (``x_shape``: its input's), then the
    VJPs asked for: this rank's input rows, ``h0`` and the parameters in ``need_p``."""
    states, gi, w_hh, b_hh, x, w_ih = saved
    n = x_shape[1]
    a, e = model.time_slice(n)
    shape = torch.Size((gi.shape[1], model.hidden_size))
    kw = dict(dtype=gi.dtype, device=gi.device)
    chain = GRUChain(gi, w_hh.detach(), b_hh, a, model.coarse)
    sources = None
    if g_seq is not None and g_seq.numel():
        sources = g_seq.detach().transpose(0, 1)  # (n_local, batch, H)
    adj = GRUAdjointChain(chain, n, states, sources)
    lam = None
    if e == n:  # the root of the reversed chain holds dL/dh_N
        lam = (g_last.detach().reshape(shape) if g_last is not None and g_last.numel()
               else torch.zeros(shape, **kw))
    res = model._solver(n, model.bwd_opts, adj, True).solve(lam, state_shape=shape)
    model.last_backward = res
    n_local = e - a
    gx = gh0 = None
    pgrads = [None] * len(need_p)
    with torch.no_grad():
        if need_x or any(need_p):
            nu_next = res.states[:n_local].flip(0)  # row j: nu_{a+j+1}
            dgh, dgi = adj.gate_gradients(nu_next)
            H3 = dgh.shape[-1]
            local = {}  # parameter index -> this rank's share (the sum over its steps)
            if need_p[0]:
                x_loc = x.detach()[:, a:e].transpose(0, 1)
                local[0] = dgi.reshape(-1, H3).t().mm(x_loc.reshape(-1, x_loc.shape[-1]))
            if need_p[1]:
                local[1] = dgh.reshape(-1, H3).t().mm(states.reshape(-1, states.shape[-1]))
            if len(need_p) == 4 and need_p[2]:
                local[2] = dgi.sum((0, 1))
            if len(need_p) == 4 and need_p[3]:
                local[3] = dgh.sum((0, 1))
            for i, g in zip(local, _allreduce(model.comm, list(local.values()))):
                pgrads[i] = g
            if need_x:  # this rank's rows; zeros elsewhere
                gx = torch.zeros(x_shape, **kw)
                gx[:, a:e] = dgi.matmul(w_ih.detach()).transpose(0, 1)
        if need_h0:
            gh0 = res.states[n_local].clone() if a == 0 else torch.zeros(shape, **kw)
    return (gx, gh0, *pgrads)


def _allreduce(comm: MPI.Comm, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum the local parameter gradients over the time communicator (one Allreduce)."""
    if comm.Get_size() == 1 or not grads:
        return grads
    flat = torch.cat([g.reshape(-1) for g in grads])
    host = flat.cpu().contiguous()
    mpitype = MPI.DOUBLE if host.dtype == torch.float64 else MPI.FLOAT
    comm.Allreduce(MPI.IN_PLACE, [host.numpy(), mpitype], op=MPI.SUM)
    flat = host.to(flat.device)
    out, i = [], 0
    for g in grads:
        out.append(flat[i:i + g.numel()].view_as(g))
        i += g.numel()
    return out
