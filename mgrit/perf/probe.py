"""The user's network as the planner sees it, and the convergence probe of MGRIT on it.

:class:`Network`: ``head -> N residual steps -> tail + loss`` (from an ``nn.Sequential`` such as
the main job's serial model, or from a step factory). :func:`probe`: for one MGRIT configuration
(:class:`MGRITConfig`: coarsening factor, levels, F-/FCF-relaxation), short solves on a real
batch (one rank, the user's modules) measure the forward convergence factor and the relative
error of the parameter gradient after ``K`` forward cycles (exact adjoint: a one-level adjoint
solve of the approximate states) and after ``K`` adjoint cycles (exact forward), against exact
backpropagation (serial autograd). Cold start (zero initial guess): training warm-starts from
the previous batch's states and usually needs fewer cycles. Used by :mod:`mgrit.perf.planner`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..nn import LayerParallelResNet
from ..nn.resnet import serial_resnet
from ..nn.steps import ResidualStep
from ..options import MGRITOptions

__all__ = ["Network", "MGRITConfig", "mgrit_configs", "Probe", "probe", "grad_error",
           "exact_gradient", "probe_net"]


def _mean_sq(out, target=None):
    return (out ** 2).mean()


@dataclass
class Network:
    """``head -> x_{k+1} = x_k + (T/N) F_k(x_k), k < N -> tail -> loss_fn(out, target)``.

    Attributes:
        steps: the ``N`` step modules ``F_k`` (state ``(batch, *state_shape)`` to the same).
        state_shape: one sample's state shape.
        T: final time (``h = T / N``).
        head, tail: modules before / after the residual layers (None: identity).
        loss_fn: ``loss_fn(out, target)`` -> scalar (default ``mean(out^2)``).
    """
    steps: list
    state_shape: tuple
    T: float = 1.0
    head: nn.Module | None = None
    tail: nn.Module | None = None
    loss_fn: Callable = _mean_sq

    def __post_init__(self):
        if not self.steps:
            raise ValueError("Network needs at least one residual step")
        self.state_shape = tuple(self.state_shape)

    @property
    def n_layers(self) -> int:
        return len(self.steps)

    @property
    def h(self) -> float:
        return self.T / self.n_layers

    @classmethod
    def from_factory(cls, make_step: Callable[[int], nn.Module], n_layers: int, state_shape,
                     T: float = 1.0, head=None, tail=None, loss_fn: Callable = _mean_sq,
                     seed: int = 0) -> "Network":
        """Steps ``make_step(k)`` seeded as :func:`mgrit.nn.serial_resnet` seeds them."""
        body = serial_resnet(make_step, n_layers, T=T, seed=seed)
        return cls([l.F for l in body], state_shape, T, head, tail, loss_fn)

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, state_shape, loss_fn: Callable = _mean_sq) -> "Network":
        """The longest run of :class:`~mgrit.nn.steps.ResidualStep` layers with one ``h`` in
        ``seq`` is the residual part; what precedes is the head, what follows the tail
        (e.g. the main job's serial model). ValueError without residual steps."""
        mods, best, i = list(seq), (0, 0), 0
        while i < len(mods):
            j = i
            while j < len(mods) and isinstance(mods[j], ResidualStep) and mods[j].h == mods[i].h:
                j += 1
            if j - i > best[1] - best[0]:
                best = (i, j)
            i = max(j, i + 1)
        a, b = best
        if b == a:
            raise ValueError("from_sequential: no ResidualStep layers in the sequence")
        head = nn.Sequential(*mods[:a]) if a else None
        tail = nn.Sequential(*mods[b:]) if b < len(mods) else None
        return cls([m.F for m in mods[a:b]], state_shape, mods[a].h * (b - a), head, tail, loss_fn)

    def serial(self) -> nn.Sequential:
        """The network as one ``nn.Sequential`` (sharing the modules)."""
        return nn.Sequential(*([self.head] if self.head else []),
                             *[ResidualStep(F, self.h) for F in self.steps],
                             *([self.tail] if self.tail else []))

    def residual_input(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return (self.head(x) if self.head else x).detach()


@dataclass(frozen=True)
class MGRITConfig:
    cfactor: int
    levels: int
    relax: str

    def options(self, iters: int, **kw) -> MGRITOptions:
        return MGRITOptions(max_levels=self.levels, cfactor=self.cfactor, relax=self.relax,
                            tol=0, max_iter=iters, **kw)

    def __str__(self):
        return f"m={self.cfactor}, L={self.levels}, {self.relax}"


def mgrit_configs(N: int, cfactors: Sequence[int] = (2, 4, 8, 16, 32, 64, 128),
                  max_levels: int = 3, relaxes: Sequence[str] = ("F", "FCF")) -> list:
    """Configurations with at least 2 intervals on the coarsest level."""
    return [MGRITConfig(m, L, r) for m in cfactors for L in range(2, max_levels + 1)
            for r in relaxes if N // m ** (L - 1) >= 2]


@dataclass
class Probe:
    """Measured convergence of one configuration on the sample batch (cold start).

    ``factor``: forward convergence factor (geometric mean of successive residual ratios over
    ``max_iters`` cycles); ``fwd_err[K - 1]``: relative parameter-gradient error with ``K``
    forward cycles and an exact adjoint; ``bwd_err[K - 1]``: exact forward, ``K`` adjoint
    cycles; ``K_f``/``K_b``: the chosen counts (None: ``grad_tol`` not reached within
    ``max_iters``); ``err``: the measured error of the chosen pair."""
    config: MGRITConfig
    factor: float
    fwd_err: list
    bwd_err: list
    K_f: int | None = None
    K_b: int | None = None
    err: float | None = None


def grad_error(network, lp, z0, target, exact):
    """Relative error of the steps' parameter gradient of one ``lp`` forward + backward on the
    residual input ``z0`` against ``exact`` (flat)."""
    for p in lp.parameters():
        p.grad = None
    out = lp(z0)
    network.loss_fn(network.tail(out) if network.tail else out, target).backward()
    g = torch.cat([p.grad.reshape(-1) for F in network.steps for p in F.parameters()
                   if p.requires_grad])
    for F in network.steps:
        for p in F.parameters():
            p.grad = None
    return float((g - exact).norm() / exact.norm().clamp_min(1e-300))


def exact_gradient(network, z0, target):
    """The steps' parameter gradient (flat) by serial autograd from the residual input ``z0``."""
    body = nn.Sequential(*[ResidualStep(F, network.h) for F in network.steps])
    params = [p for F in network.steps for p in F.parameters() if p.requires_grad]
    grads = torch.autograd.grad(network.loss_fn(
        network.tail(body(z0)) if network.tail else body(z0), target), params)
    return torch.cat([g.reshape(-1) for g in grads])


def probe_net(network, fwd, bwd, adjoint="mgrit"):
    """A one-rank LayerParallelResNet of the network's own step modules (no warm start)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one-level solves warn that they are sequential
        return LayerParallelResNet(list(network.steps), network.n_layers, network.state_shape,
                                   T=network.T, forward=fwd, backward=bwd, adjoint=adjoint,
                                   warm_start=False)


def probe(network: Network, x: torch.Tensor, target, config: MGRITConfig, max_iters: int = 4,
          exact: torch.Tensor | None = None) -> Probe:
    """Convergence of ``config`` on the batch ``x`` (see :class:`Probe`); no choice yet."""
    z0 = network.residual_input(x)
    exact = exact_gradient(network, z0, target) if exact is None else exact
    one = MGRITOptions(max_levels=1)
    fe, be = [], []
    for K in range(1, max_iters + 1):
        lp = probe_net(network, config.options(K), one, adjoint="serial")
        fe.append(grad_error(network, lp, z0, target, exact))
        be.append(grad_error(network, probe_net(network, one, config.options(K)), z0, target, exact))
    res = [r for r in lp.last_forward.residuals if r > 0]
    factor = (res[-1] / res[0]) ** (1 / (len(res) - 1)) if len(res) > 1 else 0.0
    return Probe(config, factor, fe, be)
