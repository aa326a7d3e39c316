"""The fastest serial PyTorch for a dense residual network: a lean per-layer loop.

``x_{k+1} = x_k + h act(x_k W_k^T + b_k)``, ``k = 0..N-1`` (the network of
:func:`mgrit.nn.serial_resnet` with :class:`mgrit.nn.DenseStep` steps), written the way a
performance-minded PyTorch user writes it: weights stacked in one tensor, preallocated buffers,
fused ops with ``out=`` and in-place updates, no modules and no autograd:

* forward, per layer: ``torch.addmm(b_k, u, W_k^T, out=z); z.tanh_(); u.add_(z, alpha=h)``;
* training step: the forward storing states and ``act'(z_k)``, then a hand-written closed-form
  backward loop (``s = act'(z_k) * g``; ``dW_k^T = x_k^T s``; ``db_k = sum_batch s``;
  ``g += h s W_k``), then SGD on the stacked tensors (one op per tensor for all layers).
  Equal to autograd of the ``nn.Sequential`` to round-off (``tests/perf/test_perf_baselines.py``).

It is the serial baseline of ``experiments/benchmarks/bench_layerparallel.py`` and the per-stage kernel of
the pipeline and data-parallel baselines (:mod:`mgrit.perf.baselines`). Activations: ``tanh``
and ``relu`` (ValueError otherwise). CPU or CUDA, any float dtype (of the weights).
:func:`compiled_forward` / :func:`compiled_train_step` wrap ``torch.compile`` of the same loop.
"""
from __future__ import annotations

import torch
from torch import nn

from ..nn.steps import DenseStep, ResidualStep

__all__ = ["LeanResNet", "compiled_forward", "compiled_body", "compiled_train_step",
           "COMPILE_ERRORS"]

#: Exceptions that mean "torch.compile failed on this machine" (no C++ compiler, an
#: unsupported op, an inductor bug); the benchmark reports them instead of a time.
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException,)

_ACTS = ("tanh", "relu")


class LeanResNet:
    """Dense residual layers as stacked tensors with preallocated buffers.

    Args:
        W: weights ``(N, w, w)`` (``out x in``, as ``nn.Linear.weight``); copied.
        b: biases ``(N, w)``; copied.
        h: step size (``T / N`` of :func:`mgrit.nn.serial_resnet`).
        act: ``"tanh"`` or ``"relu"``.

    Attributes:
        WT: ``(N, w, w)`` transposed weights (``in x out``, so a layer is one ``addmm``).
        b: ``(N, w)``. ``gWT``/``gb``: gradients of the last :meth:`backward`, views of one
        flat buffer ``grad_flat`` (one Allreduce for data parallelism).

    Raises:
        ValueError: shapes that do not match, a non-float dtype, an unknown activation.
    """

    def __init__(self, W: torch.Tensor, b: torch.Tensor, h: float, act: str = "tanh"):
        if W.dim() != 3 or W.shape[1] != W.shape[2] or b.shape != W.shape[:2]:
            raise ValueError(f"W {tuple(W.shape)} / b {tuple(b.shape)} are not allowed: use "
                             f"W (N, w, w) and b (N, w)")
        if not W.dtype.is_floating_point or b.dtype != W.dtype:
            raise ValueError(f"W/b dtypes {W.dtype}/{b.dtype}: use one floating dtype")
        if act not in _ACTS:
            raise ValueError(f"act={act!r} is not allowed: use one of {list(_ACTS)}")
        N, w = W.shape[:2]
        self.n_layers, self.width, self.h, self.act = N, w, float(h), act
        self.WT = W.detach().transpose(1, 2).contiguous()
        self.b = b.detach().clone()
        self.grad_flat = torch.zeros(N * w * w + N * w, dtype=W.dtype, device=W.device)
        self.gWT = self.grad_flat[:N * w * w].view(N, w, w)
        self.gb = self.grad_flat[N * w * w:].view(N, w)
        self._buf = {}

    @classmethod
    def from_sequential(cls, layers: nn.Sequential) -> "LeanResNet":
        """Copy the weights of ``serial_resnet(lambda k: DenseStep(w, act), N)`` (a sequence of
        :class:`~mgrit.nn.steps.ResidualStep` of :class:`~mgrit.nn.DenseStep`, one ``h``);
        ValueError for anything else."""
        acts = {nn.Tanh: "tanh", nn.ReLU: "relu"}
        ok = len(layers) > 0 and all(isinstance(l, ResidualStep) and isinstance(l.F, DenseStep)
                                     and type(l.F.act) in acts for l in layers)
        if not ok or len({l.h for l in layers}) != 1 or len({type(l.F.act) for l in layers}) != 1:
            raise ValueError("from_sequential needs ResidualStep(DenseStep(w, 'tanh'|'relu'), h) "
                             "layers with one h and one activation")
        W = torch.stack([l.F.linear.weight.detach() for l in layers])
        b = torch.stack([l.F.linear.bias.detach() for l in layers])
        return cls(W, b, layers[0].h, acts[type(layers[0].F.act)])

    def slice(self, lo: int, hi: int) -> "LeanResNet":
        """Layers ``lo .. hi - 1`` as their own LeanResNet (copies; a pipeline stage)."""
        if not 0 <= lo < hi <= self.n_layers:
            raise ValueError(f"slice [{lo}, {hi}) is not allowed: use 0 <= lo < hi <= {self.n_layers}")
        return LeanResNet(self.WT[lo:hi].transpose(1, 2), self.b[lo:hi], self.h, self.act)

    def weights(self) -> tuple:
        """``(W (N, w, w), b (N, w))`` in ``nn.Linear`` layout (copies)."""
        return self.WT.transpose(1, 2).clone(), self.b.clone()

    # -- buffers ----------------------------------------------------------------------------
    def buffers(self, batch: int, slot: int = 0) -> dict:
        """Preallocated buffers of one batch size (``slot``: one set per pipeline micro-batch):
        ``states`` ``(N + 1, batch, w)``, ``dact`` ``(N, batch, w)`` (``act'(z)``), ``u``, ``z``,
        ``s``, ``g`` ``(batch, w)``."""
        key = (batch, slot)
        if key not in self._buf:
            N, w, kw = self.n_layers, self.width, dict(dtype=self.WT.dtype, device=self.WT.device)
            self._buf[key] = {"states": torch.empty(N + 1, batch, w, **kw),
                              "dact": torch.empty(N, batch, w, **kw),
                              **{k: torch.empty(batch, w, **kw) for k in ("u", "z", "s", "g")},
                              "one": torch.ones(1, **kw)}
        return self._buf[key]

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x_N`` for ``x`` ``(batch, w)``; returns a buffer (valid until the next call)."""
        B = self.buffers(x.shape[0])
        u, z, h, WT, b = B["u"], B["z"], self.h, self.WT, self.b
        u.copy_(x)
        act_ = z.tanh_ if self.act == "tanh" else z.relu_
        for k in range(self.n_layers):
            torch.addmm(b[k], u, WT[k], out=z)
            act_()
            u.add_(z, alpha=h)
        return u

    def forward_store(self, x: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """Forward keeping every state and ``act'(z_k)`` for :meth:`backward`; returns
        ``states[N]`` (a buffer of ``slot``)."""
        B = self.buffers(x.shape[0], slot)
        S, D, one, h, WT, b = B["states"], B["dact"], B["one"], self.h, self.WT, self.b
        S[0].copy_(x)
        tanh = self.act == "tanh"
        for k in range(self.n_layers):
            a = D[k]
            torch.addmm(b[k], S[k], WT[k], out=a)
            if tanh:
                a.tanh_()
                torch.add(S[k], a, alpha=h, out=S[k + 1])
                torch.addcmul(one, a, a, value=-1.0, out=a)  # tanh' = 1 - tanh^2, in place
            else:
                a.relu_()
                torch.add(S[k], a, alpha=h, out=S[k + 1])
                a.sign_()  # relu'(z) = 1 where relu(z) > 0, else 0 (autograd's relu'(0) = 0)
        return S[self.n_layers]

    # -- backward ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.grad_flat.zero_()

    def backward(self, grad_out: torch.Tensor, slot: int = 0, accumulate: bool = False) -> torch.Tensor:
        """Closed-form backward of the last :meth:`forward_store` of ``slot``: writes (or with
        ``accumulate`` adds) the parameter gradients into :attr:`gWT`/:attr:`gb` and returns the
        gradient w.r.t. ``x_0`` (a buffer of ``slot``). ``grad_out``: ``dL/dx_N`` ``(batch, w)``."""
        B = self.buffers(grad_out.shape[0], slot)
        S, D, s, g, h, WT = B["states"], B["dact"], B["s"], B["g"], self.h, self.WT
        gWT, gb = self.gWT, self.gb
        g.copy_(grad_out)
        for k in range(self.n_layers - 1, -1, -1):
            torch.mul(D[k], g, out=s)
            if accumulate:
                gWT[k].addmm_(S[k].t(), s, alpha=h)
                gb[k].add_(s.sum(0), alpha=h)
            else:
                torch.mm(S[k].t(), s, out=gWT[k])
                torch.sum(s, 0, out=gb[k])
            g.addmm_(s, WT[k].t(), alpha=h)
        if not accumulate:
            self.grad_flat.mul_(h)  # dW = h x^T s for every layer: one op instead of N
        return g

    def sgd_step(self, lr: float) -> None:
        """``W -= lr dW``, ``b -= lr db`` for all layers (two ops)."""
        self.WT.sub_(self.gWT, alpha=lr)
        self.b.sub_(self.gb, alpha=lr)

    def train_step(self, x: torch.Tensor, lr: float, loss_grad=None) -> torch.Tensor:
        """Forward (storing), backward and SGD step; ``loss_grad(out) -> dL/dout`` (default the
        benchmarks' loss ``mean(out^2)``: ``2 out / out.numel()``). Returns the output buffer."""
        out = self.forward_store(x)
        B = self.buffers(x.shape[0])
        g0 = B["u"]
        if loss_grad is None:
            torch.mul(out, 2.0 / out.numel(), out=g0)
        else:
            g0.copy_(loss_grad(out))
        self.backward(g0)
        self.sgd_step(lr)
        return out


# -- torch.compile of the same loop (blocks of layers, so compile time stays bounded) ----------
def _block_forward(u, WT, b, h, tanh: bool):
    for k in range(WT.shape[0]):
        z = torch.addmm(b[k], u, WT[k])
        u = u + h * (torch.tanh(z) if tanh else torch.relu(z))
    return u


def _block_forward_store(u, WT, b, h, tanh: bool):
    states, dacts = [u], []
    for k in range(WT.shape[0]):
        a = torch.addmm(b[k], u, WT[k])
        a = torch.tanh(a) if tanh else torch.relu(a)
        u = u + h * a
        states.append(u)
        dacts.append(1 - a * a if tanh else (a > 0).to(a.dtype))
    return torch.stack(states[:-1]), torch.stack(dacts), u


def _block_backward(g, S, D, WT, h):
    gW, gb = [], []
    for k in range(WT.shape[0] - 1, -1, -1):
        s = D[k] * g
        gW.append(h * (S[k].t() @ s))
        gb.append(h * s.sum(0))
        g = g + h * (s @ WT[k].t())
    return g, torch.stack(gW[::-1]), torch.stack(gb[::-1])


def compiled_forward(net: LeanResNet, block: int = 16, backend: str = "inductor"):
    """``fn(x) -> x_N``: ``torch.compile`` of the lean forward over blocks of ``block`` layers
    (one compiled graph reused for every block; the loop inside a block is unrolled). The
    first call compiles (seconds to minutes) and raises one of :data:`COMPILE_ERRORS` where
    compilation fails on this machine. ``backend``: ``torch.compile``'s (default inductor).
    ValueError unless ``block`` divides ``N``."""
    if block < 1 or net.n_layers % block:
        raise ValueError(f"block={block} must divide N={net.n_layers}")
    f = torch.compile(_block_forward, dynamic=False, backend=backend)
    tanh, h = net.act == "tanh", torch.tensor(net.h, dtype=net.WT.dtype)  # a tensor: no
    # recompilation for another depth (a float h would be a constant of the graph)

    def run(x):
        u = x
        for lo in range(0, net.n_layers, block):
            u = f(u, net.WT[lo:lo + block], net.b[lo:lo + block], h, tanh)
        return u
    return run


def compiled_body(net: LeanResNet, block: int = 16, backend: str = "inductor"):
    """``(forward, backward)`` of ``net`` compiled in blocks of ``block`` layers (as
    :func:`compiled_forward`): ``forward(x) -> (x_N, saved)``; ``backward(grad_out, saved) ->
    dL/dx_0``, writing the parameter gradients into ``net.gWT``/``net.gb`` (any loss: the
    caller gives ``grad_out = dL/dx_N``). ValueError unless ``block`` divides ``N``."""
    if block < 1 or net.n_layers % block:
        raise ValueError(f"block={block} must divide N={net.n_layers}")
    fs = torch.compile(_block_forward_store, dynamic=False, backend=backend)
    bw = torch.compile(_block_backward, dynamic=False, backend=backend)
    tanh, N, h = net.act == "tanh", net.n_layers, torch.tensor(net.h, dtype=net.WT.dtype)

    def forward(x):
        u, saved = x, []
        for lo in range(0, N, block):
            S, D, u = fs(u, net.WT[lo:lo + block], net.b[lo:lo + block], h, tanh)
            saved.append((S, D))
        return u, saved

    def backward(g, saved):
        for i, lo in reversed(list(enumerate(range(0, N, block)))):
            g, gW, gb = bw(g, *saved[i], net.WT[lo:lo + block], h)
            net.gWT[lo:lo + block].copy_(gW)
            net.gb[lo:lo + block].copy_(gb)
        return g
    return forward, backward


def compiled_train_step(net: LeanResNet, block: int = 16, backend: str = "inductor",
                        grad_hook=None, update=None):
    """``fn(x, lr)``: compiled forward (storing) + compiled closed-form backward + SGD on
    ``net``'s tensors, loss ``mean(out^2)`` over ``x``'s rows; as :func:`compiled_forward`.
    ``grad_hook(net)``, when given, runs after the gradients are in ``net.grad_flat`` and
    before SGD (eager, not compiled): e.g. data parallelism's Allreduce of ``grad_flat`` and
    its scaling from the shard's mean to the global batch's (default None: nothing).
    ``update(net, lr)``, when given, replaces the SGD update (e.g. a ``torch.optim`` optimizer
    over ``net.WT``/``net.b`` with ``.grad`` set to ``net.gWT``/``net.gb``; default None:
    :meth:`LeanResNet.sgd_step`)."""
    forward, backward = compiled_body(net, block, backend)

    def run(x, lr):
        u, saved = forward(x)
        backward(u * (2.0 / u.numel()), saved)
        if grad_hook is not None:
            grad_hook(net)
        if update is None:
            net.sgd_step(lr)
        else:
            update(net, lr)
        return u
    return run
