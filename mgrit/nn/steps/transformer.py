"""Pre-LayerNorm transformer block as a residual step ``F`` of a layer-parallel network.

Jiang, Salvado, Cyr, Kopanicakova, Krause, Schroder, "Layer-Parallel Training for Transformers"
(arXiv 2601.09026, 2026) write a pre-LN transformer block as one forward-Euler step

    X_{n+1} = X_n + h (phi1(X_n) + phi2(X_n + phi1(X_n))),
    phi1 = self-attention o LayerNorm,   phi2 = MLP o LayerNorm,

so a stack of blocks is the chain ``x_{k+1} = x_k + h F_k(x_k)`` that
:class:`~mgrit.nn.resnet.LayerParallelResNet` solves with MGRIT. ``h = 1`` is exactly a standard
pre-LN block ``y = x + a; out = y + MLP(LN2(y))`` with ``a = Attn(LN1(x))``.
:class:`TransformerStep` is ``F``; its :meth:`~TransformerStep.forward_batched` applies ``B``
layers at once for the solver's concurrent relaxation (``mgrit.nn.chains``). Contract of that
kernel (:mod:`mgrit.nn.chains.contract`): it runs only for ``TransformerStep`` itself or a subclass
that does not override ``forward``, with the submodules :meth:`~TransformerStep.kernel_obstacle`
names; otherwise the layers are batched by ``vmap`` of their own ``forward`` (or called one by
one).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .stochastic import Dropout, DropPath

__all__ = ["TransformerStep", "TRANSFORMER_ACTIVATIONS", "LINEAR_KERNELS"]


def _gelu_tanh(z: torch.Tensor) -> torch.Tensor:
    return F.gelu(z, approximate="tanh")


#: MLP activations: ``"gelu"`` (exact, erf; BERT/ViT), ``"gelu_tanh"`` (GPT-2's tanh
#: approximation), ``"relu"`` (the original transformer).
TRANSFORMER_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": _gelu_tanh, "relu": F.relu}


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed: use an int >= 1")
    return value


def _linear_bmm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    z = torch.bmm(x, w.transpose(1, 2))
    z += b.unsqueeze(1)  # in place is autograd-safe: bmm keeps no output for its backward
    return z


def _linear_baddbmm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))


def _linear_einsum(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bmi,boi->bmo", x, w) + b.unsqueeze(1)


#: Kernels of the batched projections, ``B`` different linear maps at once: ``x`` ``(B, M, in)``,
#: ``w`` ``(B, out, in)``, ``b`` ``(B, out)`` -> ``(B, M, out)``. All equal to round-off;
#: :attr:`TransformerStep.linear_kernel` picks one, ``experiments/benchmarks/bench_transformer.py`` times
#: them on the machine at hand.
LINEAR_KERNELS = {"bmm": _linear_bmm, "baddbmm": _linear_baddbmm, "einsum": _linear_einsum}


def _layer_norm_batched(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` ``(B, M, d)`` with per-layer affine parameters
    ``w``, ``b`` ``(B, d)``: the normalization of ``F.layer_norm``, then one ``addcmul``."""
    return torch.addcmul(b.unsqueeze(1), F.layer_norm(x, x.shape[-1:], eps=eps), w.unsqueeze(1))


class TransformerStep(nn.Module):
    """``F(x) = phi1(x) + phi2(x + phi1(x))``: the residual step of a pre-LN transformer block
    (Jiang et al. 2026), multi-head self-attention then an MLP, each behind its LayerNorm.

    ``phi1(x) = Attn(LN1(x))`` with ``Attn(h) = proj(concat_heads(softmax(q k^T / sqrt(d_head)
    [+ causal mask]) v))``, ``(q, k, v) = qkv(h)`` split into ``n_heads`` heads of size
    ``d_head = d_model / n_heads`` (``torch.nn.functional.scaled_dot_product_attention``, with
    ``is_causal`` for the causal mask: token ``i`` attends to tokens ``<= i``);
    ``phi2(y) = fc2(act(fc1(LN2(y))))``. Wrapped in ``x + h F(x)``
    (:class:`~mgrit.nn.resnet.LayerParallelResNet` with ``T = N``, i.e. ``h = 1``) it is a
    standard pre-LN block, equal to ``nn.TransformerEncoderLayer(norm_first=True, dropout=0)``
    with the same weights (``tests/nn/test_transformer.py``); ``T = 1`` gives the ODE scaling
    ``h = 1/N``. No positional information is added here: that belongs to the embedding.

    Args:
        d_model: state width (int >= 1, divisible by ``n_heads``).
        n_heads: attention heads (int >= 1).
        d_ff: hidden width of the MLP (int >= 1; default ``None`` = ``4 * d_model``).
        causal: mask future tokens (decoder / language model); default False (encoder).
        act: MLP activation, one of :data:`TRANSFORMER_ACTIVATIONS` (default ``"gelu"``).
        dropout: dropout probability in ``[0, 1)`` (default 0.0: none) at the standard places
            of a ViT / GPT-2 block: the attention probabilities, the attention branch after
            ``proj``, the MLP's hidden activations and the MLP branch after ``fc2``
            (:class:`mgrit.nn.steps.Dropout`: inside a layer-parallel segment one mask per
            training forward and layer, the same in every MGRIT sweep and the adjoint).
        drop_path: stochastic depth in ``[0, 1)`` (default 0.0): each branch (``phi1``,
            ``phi2``) is dropped per sample with this probability
            (:class:`mgrit.nn.steps.DropPath`, timm's placement). With ``h = 1`` and both
            options the block equals timm's ``Block(x) = y + DP(MLP(LN2 y))``, ``y = x +
            DP(Attn(LN1 x))``. With either > 0 the layers are evaluated one by one (no batched
            kernel); with both 0 the module tree is the one without dropout.
        device, dtype: factory arguments of the parameters, as in ``torch.nn`` (default: torch's
            defaults; use float64 for exactness tests).

    Parameters (standard PyTorch initialisation, nothing custom): ``norm1``, ``norm2``
    (``nn.LayerNorm(d_model)``, eps 1e-5: weight 1, bias 0), ``qkv`` (``nn.Linear(d_model,
    3 d_model)``, rows ``[q; k; v]``), ``proj`` (``nn.Linear(d_model, d_model)``), ``fc1``
    (``nn.Linear(d_model, d_ff)``), ``fc2`` (``nn.Linear(d_ff, d_model)``); every ``nn.Linear``
    has its default ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` weight and bias (Kaiming-uniform with
    ``a = sqrt(5)``). Note ``nn.MultiheadAttention`` instead uses Xavier-uniform ``in_proj`` and
    zero biases, GPT-2 ``N(0, 0.02)``: re-initialise the parameters if you need those.

    Shapes: :meth:`forward` maps ``(batch, tokens, d_model)`` to the same shape and dtype (the
    parameters' dtype). Raises ``ValueError`` for a bad size, ``d_model % n_heads != 0``, an
    unknown activation, ``dropout`` / ``drop_path`` outside ``[0, 1)``, or (at call time) an input of another rank or width.
    """

    #: Kernel of :meth:`forward_batched`'s projections, a key of :data:`LINEAR_KERNELS`
    #: (``"baddbmm"``, ``"bmm"`` = bmm then an in-place bias add, ``"einsum"``); all give the
    #: same values to round-off. Set it on the class, or to the same value on every layer
    #: (``mgrit.nn.chains.stacking`` batches only layers whose attributes are equal).
    linear_kernel = "baddbmm"
    #: :meth:`forward_batched` applies the layers in groups whose largest intermediate
    #: (``group * batch * tokens * max(3 d_model, d_ff)`` elements) stays within this many
    #: elements: one group at small sizes, where the per-call overhead is what batching saves;
    #: smaller groups at large sizes, where fresh buffers of hundreds of MB (page faults,
    #: cache misses in the elementwise ops) make one batched call slower than the loop (0.6-0.7x
    #: at d_model 128, 64 tokens, batch 64, 16 layers, float32, one thread). Same rule as
    #: :attr:`linear_kernel` for setting it.
    chunk_elements = 2 ** 18  # 1 MiB of float32: a core's L2 here (AMD EPYC)

    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, causal: bool = False,
                 act: str = "gelu", dropout: float = 0.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 drop_path: float = 0.0):
        super().__init__()
        _check_size("d_model", d_model)
        _check_size("n_heads", n_heads)
        d_ff = 4 * d_model if d_ff is None else _check_size("d_ff", d_ff)
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}: use a "
                             f"d_model that is a multiple of n_heads (d_head = d_model / n_heads)")
        if not isinstance(causal, bool):
            raise ValueError(f"causal={causal!r} is not allowed: use True or False")
        if not isinstance(act, str) or act not in TRANSFORMER_ACTIVATIONS:
            raise ValueError(f"act={act!r} is not allowed: use one of "
                             f"{sorted(TRANSFORMER_ACTIVATIONS)}")
        for name, v in (("dropout", dropout), ("drop_path", drop_path)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"{name}={v!r} is not allowed: use a probability in [0, 1)")
        self.d_model, self.n_heads, self.d_ff = d_model, n_heads, d_ff
        self.d_head = d_model // n_heads
        self.causal, self.act = causal, act
        kw = dict(device=device, dtype=dtype)
        self.norm1 = nn.LayerNorm(d_model, **kw)
        self.qkv = nn.Linear(d_model, 3 * d_model, **kw)
        self.proj = nn.Linear(d_model, d_model, **kw)
        self.norm2 = nn.LayerNorm(d_model, **kw)
        self.fc1 = nn.Linear(d_model, d_ff, **kw)
        self.fc2 = nn.Linear(d_ff, d_model, **kw)
        self.dropout, self.drop_path = float(dropout), float(drop_path)
        if dropout:  # submodules only when used: the default block keeps its batched kernel
            self.attn_drop, self.drop1 = Dropout(dropout), Dropout(dropout)
            self.drop_hidden, self.drop2 = Dropout(dropout), Dropout(dropout)
        if drop_path:
            self.path1, self.path2 = DropPath(drop_path), DropPath(drop_path)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, d_ff={self.d_ff}, "
                f"causal={self.causal}, act={self.act!r}, dropout={self.dropout}, "
                f"drop_path={self.drop_path}")

    def _check_input(self, x: torch.Tensor, dims: int, what: str) -> None:
        if x.dim() != dims or x.shape[-1] != self.d_model:
            raise ValueError(f"input of shape {tuple(x.shape)} is not allowed: use {what} "
                             f"with d_model={self.d_model}")

    def _attend(self, qkv: torch.Tensor, n: int, T: int) -> torch.Tensor:
        """Heads of ``qkv`` ``(n, T, 3 d_model)`` (any leading layout that views as that):
        attention over ``n`` independent sequences, ``(n, T, d_model)`` before ``proj``."""
        q, k, v = qkv.reshape(n, T, 3, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4).unbind(0)
        if self.dropout and self.training:  # dropout on the attention probabilities
            s = (q @ k.transpose(-2, -1)) * self.d_head ** -0.5
            if self.causal:
                s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1),
                                  float("-inf"))
            o = self.attn_drop(s.softmax(-1)) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (n, H, T, d_head)
        return o.transpose(1, 2).reshape(n, T, self.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F(x)`` for ``x`` ``(batch, tokens, d_model)``; returns the same shape."""
        self._check_input(x, 3, "(batch, tokens, d_model)")
        n, T, _ = x.shape
        a = self.proj(self._attend(self.qkv(self.norm1(x)), n, T))  # phi1(x)
        act = TRANSFORMER_ACTIVATIONS[self.act]
        if not (self.dropout or self.drop_path):
            return a + self.fc2(act(self.fc1(self.norm2(x + a))))  # phi1(x) + phi2(x + phi1(x))
        a = self._branch(a, "drop1", "path1")
        z = act(self.fc1(self.norm2(x + a)))
        if self.dropout:
            z = self.drop_hidden(z)
        return a + self._branch(self.fc2(z), "drop2", "path2")

    def _branch(self, y: torch.Tensor, drop: str, path: str) -> torch.Tensor:
        """A residual branch's output after its dropout and DropPath (when configured)."""
        if self.dropout:
            y = getattr(self, drop)(y)
        return getattr(self, path)(y) if self.drop_path else y

    def kernel_obstacle(self) -> str | None:
        """Why :meth:`forward_batched` does not compute this module's ``forward`` (a message),
        else ``None``: it assumes ``qkv``, ``proj``, ``fc1``, ``fc2`` are exactly ``nn.Linear``
        with a bias and ``norm1``, ``norm2`` exactly ``nn.LayerNorm(d_model)`` with weight and
        bias. Read by :func:`mgrit.nn.chains.contract.kernel`, which also refuses the kernel to a
        subclass that overrides ``forward`` (it then gets ``vmap`` of its own ``forward``)."""
        for name in ("qkv", "proj", "fc1", "fc2"):
            m = getattr(self, name)
            if type(m) is not nn.Linear or m.bias is None:
                return f"TransformerStep.{name} is not a plain nn.Linear with a bias"
        for name in ("norm1", "norm2"):
            m = getattr(self, name)
            if (type(m) is not nn.LayerNorm or m.weight is None or m.bias is None
                    or tuple(m.normalized_shape) != (self.d_model,)):
                return f"TransformerStep.{name} is not nn.LayerNorm(d_model) with weight and bias"
        return None

    def forward_batched(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """``B`` layers at once: ``out[b] = F_b(x[b])`` (the contract of ``mgrit.nn.chains``).

        Args:
            p: every parameter of this module by name (``"qkv.weight"``, ...), stacked along a
                new dim 0 of size ``B`` (e.g. ``qkv.weight`` ``(B, 3 d_model, d_model)``,
                ``norm1.weight`` ``(B, d_model)``); the structural settings (heads, causal,
                activation, LayerNorm eps) are this module's, so all ``B`` layers must share
                them (``chains`` stacks only such layers).
            x: ``(B, batch, tokens, d_model)``.

        Returns:
            ``(B, batch, tokens, d_model)``, same dtype; equal to ``B`` :meth:`forward` calls to
            round-off (float64: 1e-12 in ``tests/nn/test_transformer.py``), differentiable in
            ``x`` and ``p`` (the adjoint solve's VJPs go through autograd). The projections and
            the MLP are batched matmuls over the stacked weights, LayerNorm is one batched
            normalization with the stacked affine parameters, and attention is one
            ``scaled_dot_product_attention`` over the merged ``layers * batch`` sequences --
            for groups of layers sized by :attr:`chunk_elements` (all ``B`` at once at small
            sizes).
        """
        self._check_input(x, 4, "(layers, batch, tokens, d_model)")
        lin = LINEAR_KERNELS.get(self.linear_kernel)
        if lin is None:
            raise ValueError(f"linear_kernel={self.linear_kernel!r} is not allowed: use one of "
                             f"{sorted(LINEAR_KERNELS)}")
        B, n, T, d = x.shape
        group = self.layer_group(n, T)
        if group >= B:
            return self._forward_group(lin, p, x)
        return torch.cat([self._forward_group(lin, {k: t[i:i + group] for k, t in p.items()},
                                              x[i:i + group]) for i in range(0, B, group)])

    def layer_group(self, batch: int, tokens: int) -> int:
        """Layers :meth:`forward_batched` applies together for states ``(batch, tokens,
        d_model)``: ``chunk_elements // (batch * tokens * max(3 d_model, d_ff))``, at least 1."""
        return max(1, int(self.chunk_elements) // (batch * tokens * max(3 * self.d_model,
                                                                         self.d_ff)))

    def _forward_group(self, lin, p: dict, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_batched` of all ``B`` layers in ``p`` in one pass (``lin``: the
        projection kernel)."""
        B, n, T, d = x.shape
        xs = x.reshape(B, n * T, d)
        h = _layer_norm_batched(xs, p["norm1.weight"], p["norm1.bias"], self.norm1.eps)
        qkv = lin(h, p["qkv.weight"], p["qkv.bias"])  # (B, n T, 3 d)
        o = self._attend(qkv, B * n, T).reshape(B, n * T, d)
        a = lin(o, p["proj.weight"], p["proj.bias"])  # phi1(x)
        h2 = _layer_norm_batched(xs + a, p["norm2.weight"], p["norm2.bias"], self.norm2.eps)
        act = TRANSFORMER_ACTIVATIONS[self.act]
        z = act(lin(h2, p["fc1.weight"], p["fc1.bias"]))
        return (a + lin(z, p["fc2.weight"], p["fc2.bias"])).view(B, n, T, d)
