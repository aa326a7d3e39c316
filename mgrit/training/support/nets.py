"""The runtime's side of the network protocol (:mod:`mgrit.nn.protocol`): :func:`as_net` takes
what a user passes as a network, and :class:`SerialNet` gives a plain ``nn.Module`` the
protocol, so the loop, the checkpoints, the guard and the bias monitor have no branch on the
kind of network.

A :class:`~mgrit.nn.LayerParallelNet`, a :class:`~mgrit.nn.GRUSequenceClassifier` and a
:class:`~mgrit.training.method.TrainingMethod` implement :class:`~mgrit.nn.protocol.TrainableNet`
themselves. A serial module's global keys are its own state-dict keys; the main job's serial
network and its layer-parallel network share them, so a checkpoint of one loads into the other
and into any partition.

Depends on torch, mpi4py and :mod:`mgrit.nn`.
"""
from __future__ import annotations

from typing import Callable

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from ...nn import LayerParallelResNet
from ...nn.chains.compiled import plain_module
from ...nn.protocol import PROVIDED, REQUIRED, NetMixin, TrainableNet, subnets

__all__ = ["SerialNet", "as_net"]


class SerialNet(NetMixin, nn.Module):
    """Adapter giving a serial module the network protocol
    (:class:`~mgrit.nn.protocol.TrainableNet`): ``is_first = is_last = True``,
    ``loss(out, target, fn) = fn(out, target)``, ``from_last(v) = v``, ``comm = COMM_SELF``,
    the wrapped module's own keys, no MGRIT segments. Parameters are those of ``module`` (same
    order).
    """

    is_first = True
    is_last = True

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.comm = MPI.COMM_SELF

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def loss(self, out: torch.Tensor, target: torch.Tensor,
             fn: Callable = F.cross_entropy) -> torch.Tensor:
        return fn(out, target)

    def from_last(self, value):
        return value

    def global_modules(self) -> list:
        """``[("", module)]`` (a ``torch.compile`` wrapper: the keys of the plain module)."""
        return [("", plain_module(self.module))]

    def tied_prefixes(self) -> dict:
        """``{}``: one piece under the module's own keys."""
        return {}

    def solver_segments(self) -> list:
        """``[]``: a serial network to the runtime (checkpoint kind ``"serial"``)."""
        return []


_LOOP = ("is_last", "loss", "from_last")


def as_net(net: nn.Module) -> nn.Module:
    """``net`` itself if it implements :class:`~mgrit.nn.protocol.TrainableNet`, else
    ``SerialNet(net)``.

    Raises:
        TypeError: ``net`` is not an ``nn.Module``; a bare LayerParallelResNet (wrap it in
            ``LayerParallelNet(opening, resnet, closing)``, which provides the loss on the last
            layer rank); a module with the loop's members (``is_last``, ``loss``,
            ``from_last``) but not the rest of the protocol (a distributed network the runtime
            would otherwise treat as serial: inherit :class:`~mgrit.nn.protocol.NetMixin`);
            a plain module around a protocol network spanning more than one layer rank.
    """
    if isinstance(net, LayerParallelResNet):
        raise TypeError("a bare LayerParallelResNet cannot be trained directly: wrap it in "
                        "mgrit.nn.LayerParallelNet(opening, resnet, closing)")
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    if isinstance(net, TrainableNet):
        return net
    spanning = [(pre, sub) for pre, sub in subnets(net) if sub.comm.Get_size() > 1]
    if spanning:
        pre, sub = spanning[0]
        raise TypeError(f"{type(net).__name__} is a plain nn.Module around a "
                        f"{type(sub).__name__} ({pre[:-1]!r}) that spans "
                        f"{sub.comm.Get_size()} layer ranks: the runtime would treat it as a "
                        f"serial network on one rank. Pass the {type(sub).__name__} itself, or "
                        f"give the wrapper the network protocol: inherit "
                        f"mgrit.nn.protocol.NetMixin and define comm, is_last, loss and "
                        f"from_last by delegating to {pre[:-1]!r} (NetMixin then takes the "
                        f"checkpoint keys, ties and segments from it)")
    if all(hasattr(type(net), a) for a in _LOOP):
        missing = [a for a in REQUIRED + PROVIDED if not hasattr(net, a)]
        raise TypeError(f"{type(net).__name__} has the training loop's members {list(_LOOP)} "
                        f"but not the whole network protocol (missing {missing}): inherit "
                        f"mgrit.nn.protocol.NetMixin (see mgrit.nn.protocol.TrainableNet)")
    return SerialNet(net)
