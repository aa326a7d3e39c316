"""Test chains for the solver: a nonlinear, index-dependent ResNet-like propagator.

``Phi_i(u) = u + dt * tanh(W_i u + b_i)`` with ``W_i`` drawn from a seeded generator (smooth in
``i``), ``dt = (stop - start) * h``; the coarse step uses layer ``start``'s parameters. The
sequential reference is computed with plain Python stepping.
"""
import torch

from mgrit.propagator import Propagator


class TanhChain(Propagator):
    """Nonlinear chain on states of shape ``(batch, width)`` (float64 by default)."""

    def __init__(self, n_intervals, width=4, T=1.0, seed=0, dtype=torch.float64, scale=1.0):
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(width, width, generator=g, dtype=dtype) * scale
        drift = torch.randn(width, width, generator=g, dtype=dtype) * scale
        s = torch.linspace(0, 1, n_intervals, dtype=dtype)[:, None, None]
        self.W = base + s * drift  # (N, width, width)
        self.b = 0.1 * torch.randn(n_intervals, width, generator=g, dtype=dtype)
        self.h = T / n_intervals
        self.calls = 0

    def step(self, u, start, stop, level):
        self.calls += 1
        return u + (stop - start) * self.h * torch.tanh(u @ self.W[start].T + self.b[start])


class BatchedTanhChain(TanhChain):
    """Same chain with a batched kernel (bmm over stacked layer parameters)."""

    def step_batch(self, u, starts, stops, level):
        idx = torch.tensor(list(starts))
        dt = (torch.tensor(list(stops)) - idx).to(u.dtype) * self.h
        z = torch.bmm(u, self.W[idx].transpose(1, 2)) + self.b[idx][:, None, :]
        return u + dt.view(-1, 1, 1) * torch.tanh(z)


def sequential(prop, u0, n):
    """All states ``(n + 1, *shape)`` by sequential stepping on the fine grid."""
    out = [u0]
    for i in range(n):
        out.append(prop.step(out[-1], i, i + 1, 0))
    return torch.stack(out)
