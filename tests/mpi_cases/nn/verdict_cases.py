"""Rank-side checks of issue 22 items 5 and 6 (tests/nn/test_global_agreement.py): every rank
reaches the same verdict from the same reduced numbers -- a NaN in one layer's step or
vector-Jacobian product makes every rank raise ``FloatingPointError`` (for ``norm="inf"``,
whose MPI ``MAX`` reduction does not propagate NaN, and ``"l2"``), and a tolerance solve that
runs out of cycles warns once or raises ``UnconvergedError`` on every rank."""
from __future__ import annotations

import warnings

import torch
from mpi4py import MPI
from torch import nn

from mgrit.nn import LayerParallelNet, LayerParallelResNet
from mgrit.options import MGRITOptions
from mgrit.solver import UnconvergedError, UnconvergedWarning

COMM = MPI.COMM_WORLD
WIDTH, N_LAYERS = 3, 8


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; NaN vector-Jacobian product."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


class PoisonStep(nn.Module):
    """``tanh(W x + b)``; ``poison`` = "forward" (NaN output), "vjp" (NaN input gradient) or
    None (a plain step)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.poison = None

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        if self.poison == "forward":
            return y * float("nan")
        if self.poison == "vjp":
            return _PoisonGrad.apply(y)
        return y


def _net(norm: str, tol: float, max_iter: int = 30, action: str = "warn"):
    torch.set_default_dtype(torch.float64)
    opts = MGRITOptions(max_levels=2, cfactor=2, tol=tol, max_iter=max_iter, norm=norm,
                        on_not_converged=action)
    return LayerParallelNet(LayerParallelResNet.build(
        lambda k: PoisonStep(), N_LAYERS, (WIDTH,), comm=COMM, seed=0, forward=opts,
        backward=opts, warm_start=False))


def _step(net, x):
    """Forward and backward of ``sum(output)``."""
    net.loss(net(x), None, lambda out, _: out.sum()).backward()


def _x(seed):
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def check_nan_verdict(norm: str) -> list:
    """For a NaN forward and a NaN VJP, in a layer of every rank in turn (so that whichever
    rank's value MPI's MAX would drop holds it), exact and (``norm="inf"``) fixed-cycle
    solves: every rank raises FloatingPointError and the ranks agree on the message; nobody
    returns."""
    verdicts = []
    x = _x(1)
    for poison in ("forward", "vjp"):
        for tol in ((1e-12, 0.0) if norm == "inf" else (1e-12,)):
            for owner in range(COMM.size):
                net = _net(norm, tol, max_iter=30 if tol else 2)
                layer = (N_LAYERS // COMM.size) * owner + 1  # an F-point inside owner's range
                for j, s in enumerate(net.resnet.steps):
                    if net.resnet.first + j == layer:
                        s.poison = poison
                outcome = "returned"
                try:
                    _step(net, x)
                    fwd, bwd = net.resnet.last_forward, net.resnet.last_backward
                    outcome += f" converged={fwd.converged, getattr(bwd, 'converged', None)}"
                except FloatingPointError as exc:
                    outcome = f"FloatingPointError: {exc}"
                every = COMM.allgather(outcome)
                where = f"{poison} in layer {layer} (rank {owner}), norm {norm}, tol {tol}"
                assert outcome.startswith("FloatingPointError") and "nan" in outcome, \
                    f"rank {COMM.rank}, {where}: {outcome}"
                assert len(set(every)) == 1, f"{where}: ranks disagree: {every}"
                verdicts.append(f"{poison}/{tol}/{owner}")
    return verdicts


def check_not_converged() -> str:
    """max_iter = 1 with tol = 1e-14: "raise" -> UnconvergedError on every rank (forward);
    "warn" -> one UnconvergedWarning per solver on rank 0 of the layer communicator, none on
    the others and none on the second solve; "ignore" and fixed-cycle solves: no warning."""
    x = _x(2)
    net = _net("l2", 1e-14, max_iter=1, action="raise")
    try:
        net(x)
        outcome = "returned"
    except UnconvergedError as exc:
        outcome = str(exc)
    every = COMM.allgather(outcome)
    assert "max_iter=1" in outcome and "tol = 1e-14" in outcome, outcome
    assert len(set(every)) == 1, every
    for action, tol, want in (("warn", 1e-14, 2), ("ignore", 1e-14, 0), ("warn", 0.0, 0)):
        net = _net("l2", tol, max_iter=1, action=action)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            for _ in range(2):  # two training steps: forward + adjoint solver warn once each
                _step(net, x)
        mine = [w for w in got if issubclass(w.category, UnconvergedWarning)]
        n = COMM.allreduce(len(mine))
        assert n == want and (COMM.rank == 0 or not mine), (action, tol, n, [str(w) for w in mine])
        assert not net.resnet.last_forward.converged
    return outcome
