"""A sequence model around a parallel-in-time GRU: ParallelGRU -> linear head on the last time rank.

For sequence classification (row-by-row MNIST: each image row is one time step, 28 steps of 28
features) and sequence regression (the adding problem, :func:`data.sequences.make_adding_problem`).
Every rank of the time communicator calls :meth:`GRUSequenceClassifier.forward` with the same
batch and then ``model.loss(out, y).backward()`` (as :class:`mgrit.nn.LayerParallelNet`).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from ..protocol import NetMixin
from .parallel import ParallelGRU

__all__ = ["GRUSequenceClassifier", "image_rows"]


def image_rows(images: torch.Tensor) -> torch.Tensor:
    """Images ``(n, 1, H, W)`` or ``(n, H, W)`` as sequences ``(n, H, W)``: one row per time
    step (row-by-row MNIST). Raises ValueError for other shapes."""
    if images.dim() == 4 and images.shape[1] == 1:
        return images[:, 0]
    if images.dim() == 3:
        return images
    raise ValueError(f"images of shape {tuple(images.shape)} are not allowed: use (n, 1, H, W) "
                     f"or (n, H, W) single-channel images")


class GRUSequenceClassifier(NetMixin, nn.Module):
    """``head(h_N)`` with ``h_N`` the final hidden state of a :class:`ParallelGRU`.

    Args:
        input_size, hidden_size: of the GRU.
        n_outputs: outputs of the linear head (classes; 1 for a scalar regression).
        comm: time communicator (default ``COMM_SELF``).
        **gru_kwargs: ``forward``, ``backward``, ``warm_start``, ``bias``, ``coarse`` of
            :class:`ParallelGRU`.

    The head ``nn.Linear(hidden_size, n_outputs)`` is created on every rank (so every rank
    draws the same random numbers) and kept on the last time rank only; it is broadcast from
    there by :meth:`to_serial`. The GRU's parameters are replicated on every rank.
    """

    def __init__(self, input_size: int, hidden_size: int, n_outputs: int,
                 comm: MPI.Comm | None = None, **gru_kwargs):
        super().__init__()
        if isinstance(n_outputs, bool) or not isinstance(n_outputs, int) or n_outputs < 1:
            raise ValueError(f"n_outputs={n_outputs!r} is not allowed: use an int >= 1")
        self.gru = ParallelGRU(input_size, hidden_size, comm=comm, **gru_kwargs)
        self.comm = self.gru.comm
        head = nn.Linear(hidden_size, n_outputs).to(self.gru.weight_ih.dtype)
        self.head = head if self.gru.is_last else None
        self.last_rank = self.comm.Get_size() - 1

    @property
    def is_last(self) -> bool:
        return self.gru.is_last

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(batch, seq, input_size)`` on every rank. Returns the head's output
        ``(batch, n_outputs)`` on the last time rank, an empty placeholder elsewhere."""
        h = self.gru(x, h0)
        return self.head(h) if self.is_last else h

    def loss(self, out: torch.Tensor, target: torch.Tensor,
             fn: Callable = F.cross_entropy) -> torch.Tensor:
        """``fn(out, target)`` on the last time rank (use ``F.mse_loss`` with
        ``out.squeeze(-1)`` for regression); a zero placeholder connected to the parameters
        elsewhere. Call ``.backward()`` on it on every rank."""
        return fn(out, target) if self.is_last else out.sum()

    def from_last(self, value: Any) -> Any:
        """Broadcast a Python value (a loss, predictions) from the last time rank."""
        return self.comm.bcast(value, root=self.last_rank)

    def to_serial(self) -> nn.ModuleDict:
        """``{"gru": nn.GRU(batch_first=True), "head": nn.Linear}`` with copies of the current
        weights on every rank (collective); serial output: ``head(gru(x)[1][0])``."""
        head = self.comm.bcast(self.head, root=self.last_rank)
        return nn.ModuleDict({"gru": self.gru.to_gru(), "head": head})
