"""``torch.compile`` of the main job's dense ResNet as a baseline a user has: the same training step
as ``nn.Sequential`` autograd (opening, ``N`` residual steps ``u + h tanh(u W^T + b)``, classifier,
cross-entropy), with the residual steps' weights stacked (``WT`` ``(N, w, w)``, ``b`` ``(N, w)``)
and ``torch.compile`` (inductor, ``dynamic=False``) of blocks of ``block`` steps: one compiled
graph (forward and, through AOTAutograd, backward) reused for every full block, the remainder of
``N mod block`` steps eager (one graph per batch shape: compile time stays bounded at any
depth). Autograd and the optimizer run as usual on
the stacked leaves (:meth:`CompiledResNet.parameters`), so data parallelism over them is the
ordinary ``GradientBuckets`` pattern.

Used by ``plan_unseen.py`` (compiled serial and compiled data-parallel options). A compile failure
raises one of :data:`mgrit.perf.lean.COMPILE_ERRORS` on the first call; the caller reports it.
``tests/experiments/test_plan_unseen.py`` checks the gradients against ``nn.Sequential`` autograd
(float64, dynamo with the ``eager`` backend).
"""
from __future__ import annotations

import torch
from torch import nn

from mgrit.nn.steps.basic import ResidualStep

__all__ = ["CompiledResNet", "residual_block"]


def residual_block(u, WT, b, h):
    """``len(WT)`` residual steps ``u <- u + h tanh(u WT[k] + b[k])`` (the function compiled)."""
    for k in range(WT.shape[0]):
        u = u + h * torch.tanh(torch.addmm(b[k], u, WT[k]))
    return u


class CompiledResNet(nn.Module):
    """A copy of ``seq`` (``[opening, ResidualStep(DenseStep(Linear, Tanh)) x N, classifier]``,
    as ``build_model("resnet", ...)`` returns; the copy owns new tensors) whose residual steps run
    through ``torch.compile`` of :func:`residual_block` over blocks of ``block`` steps (the last
    ``N mod block`` steps eager). ``backend``: ``torch.compile``'s (default inductor).

    Raises:
        ValueError: ``seq`` is not of that form (another step, activation or a varying ``h``),
            or ``block < 1``.
    """

    def __init__(self, seq: nn.Sequential, block: int = 16, backend: str = "inductor"):
        super().__init__()
        mods = list(seq)
        steps = mods[1:-1]
        if block < 1:
            raise ValueError(f"block={block} is not allowed: use an int >= 1")
        if not steps or not all(isinstance(s, ResidualStep) and isinstance(getattr(s.F, "act", None), nn.Tanh)
                                for s in steps):
            raise ValueError("CompiledResNet needs [opening, ResidualStep(DenseStep(..., Tanh)) x N, "
                             "classifier]")
        hs = {float(s.h) for s in steps}
        if len(hs) != 1:
            raise ValueError(f"CompiledResNet needs one step size h; got {sorted(hs)}")
        import copy
        self.opening, self.closing = copy.deepcopy(mods[0]), copy.deepcopy(mods[-1])
        self.WT = nn.Parameter(torch.stack([s.F.linear.weight.detach().t() for s in steps]).contiguous())
        self.b = nn.Parameter(torch.stack([s.F.linear.bias.detach() for s in steps]).contiguous())
        self.h, self.block = hs.pop(), block
        self._f = torch.compile(residual_block, dynamic=False, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, N = self.opening(x), self.WT.shape[0]
        full = N - N % self.block
        for lo in range(0, full, self.block):
            u = self._f(u, self.WT[lo:lo + self.block], self.b[lo:lo + self.block], self.h)
        if full < N:  # the remainder, eager (a second graph would double the compile time)
            u = residual_block(u, self.WT[full:], self.b[full:], self.h)
        return self.closing(u)
