"""The autograd bridge of :class:`~mgrit.nn.resnet.LayerParallelResNet`: one forward solve is
one autograd node (after TorchBraid's ``braid_function.py``), and the small collective that
lets several of them be backpropagated safely.

What a backward needs from its forward belongs to that forward's node, never to the module:
the forward states and the stacked parameters the solve used are saved tensors (freed after the
backward unless ``retain_graph``, version-checked like every saved tensor, offloaded or
recomputed under saved-tensor hooks and ``torch.utils.checkpoint``); the forward's number and
the stacked names and the layer-to-parameter map are attributes of ``ctx``. The module keeps
only the warm start (an initial guess; no gradient depends on it).

Order across ranks: each backward is a collective adjoint solve, so every rank must run the
same nodes in the same order. The autograd engine runs, among ready nodes, the one created last
(highest sequence number), and a node is ready only when every node built from its output has
run; so of two forward nodes that one backward reaches, the later one always runs first, on
every rank, whatever the rank-local parts of the graph look like. What the engine cannot see --
ranks backpropagating *different* forwards -- :func:`agree_backward` turns into a RuntimeError
on every rank (one small ``allgather`` per backward, skipped on one rank).
"""
from __future__ import annotations

import torch
from mpi4py import MPI

__all__ = ["MGRITFunction", "agree_backward"]

_TAG = "LayerParallelResNet.backward"


class MGRITFunction(torch.autograd.Function):
    """``apply(model, batch, token, x0, *params)``: the model's forward solve as one node.

    ``token`` is the model's grad-requiring empty tensor: in grad mode every rank's output then
    requires grad and every rank joins the backward, also where nothing else requires grad
    (frozen layers, no input) -- a rank-local decision would leave the other ranks waiting in
    the adjoint solve. ``x0``: the input on the first layer rank; elsewhere the user's tensor
    (only linking it to the graph) or an empty one. ``params``: the model's unique parameters.
    """

    @staticmethod
    def forward(ctx, model, batch, token, x0, *params):
        out, states, stacked = model._forward_solve(x0 if model.is_first else None, batch, True)
        ctx.model, ctx.forward_id, ctx.stack_names = model, model._forward_count, tuple(stacked)
        ctx.param_index = model._param_index  # layer -> unique parameter, as of this forward
        ctx.save_for_backward(states, *stacked.values(), *params)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *ctx.model._backward(ctx, grad))


def agree_backward(comm: MPI.Comm, forward_id: int, error: str | None, need: bool) -> bool:
    """Before an adjoint solve: every rank of ``comm`` must be backpropagating forward number
    ``forward_id``, and no rank may have failed its checks (``error``: a message). Raises the
    same RuntimeError on every rank otherwise, naming each rank's error or forward. Returns
    whether any rank ``need``s a gradient from this backward (else the solve is skipped)."""
    if comm.Get_size() == 1:
        if error:
            raise RuntimeError(error)
        return need
    gathered = comm.allgather((error, (_TAG, forward_id, need)))
    strays = [r for r, g in enumerate(gathered)
              if not (isinstance(g, tuple) and len(g) == 2 and isinstance(g[1], tuple)
                      and len(g[1]) == 3 and g[1][0] == _TAG)]
    if strays:  # another collective met this one: a rank is not in this backward
        raise RuntimeError(f"rank(s) {strays} did not enter the backward of a "
                           f"LayerParallelResNet forward while the others did: every rank must "
                           f"call backward on the same forwards")
    errs = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
    ids = [t[1] for _, t in gathered]
    if len(set(ids)) > 1:
        errs.append("ranks backpropagate different forwards of this LayerParallelResNet ("
                    + ", ".join(f"rank {r}: forward #{i}" for r, i in enumerate(ids))
                    + "): every rank must call backward on the same forwards, in the same order")
    if errs:
        raise RuntimeError("; ".join(errs))
    return any(t[2] for _, t in gathered)
