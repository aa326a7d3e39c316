"""Step modules F of a residual network x_{k+1} = x_k + h F(x_k; theta_k).

Every step maps a state to a state of the same shape; any user ``nn.Module`` with that property
works. Shapes: dense states ``(batch, width)``; convolutional states ``(batch, C, H, W)``
(``dims=2``, the default) or ``(batch, C, D, H, W)`` (``dims=3``, voxel grids).
dtype follows the module's parameters (float64 for exact tests, float32 for training).

Fast paths (contract in :mod:`mgrit.nn.chains.contract`): the native kernels here (``forward_batched``,
``forward_layer``, ``vjp_batched``, ``linearize_batched``, ``stack_extras``) run only for a
module whose class is the one that defines both them and ``forward`` (a subclass that overrides
``forward`` gets the general path) and whose ``kernel_obstacle()`` is ``None`` (the submodules
are exactly the ones the kernels re-implement).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["SmoothReLU", "activation", "DenseStep", "ConvStep", "TwoConvStep", "ResidualStep",
           "ACTIVATIONS", "make_step"]


class SmoothReLU(nn.Module):
    """ReLU blended quadratically on ``(-eps, eps)`` (Guenther et al. 2020, default eps = 0.1):
    ``0`` for ``x <= -eps``, ``(x + eps)^2 / (4 eps)`` for ``|x| < eps``, ``x`` for ``x >= eps``.
    Continuously differentiable; elementwise, any shape."""

    def __init__(self, eps: float = 0.1):
        super().__init__()
        if not eps > 0:
            raise ValueError(f"SmoothReLU eps={eps!r} is not allowed: use a number > 0")
        self.eps = float(eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"

    def forward(self, x):
        e = self.eps
        quad = (x + e) ** 2 / (4 * e)
        return torch.where(x >= e, x, torch.where(x <= -e, torch.zeros_like(x), quad))


ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "smoothrelu": SmoothReLU}


def activation(name: str) -> nn.Module:
    """``"tanh"``, ``"relu"`` or ``"smoothrelu"`` (ValueError otherwise)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not allowed: use one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


def _act_derivative(act: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """``act'(z)`` of a built-in activation (the one-sided values autograd uses at the kinks:
    ReLU'(0) = 0, SmoothReLU' continuous)."""
    if type(act) is nn.Tanh:
        t = torch.tanh(z)
        return 1 - t * t
    if type(act) is nn.ReLU:
        return torch.where(z <= 0, 0.0, 1.0).to(z.dtype)  # NaN -> 1, as autograd
    if type(act) is SmoothReLU:
        e = act.eps
        return torch.where(z >= e, 1.0, torch.where(z <= -e, 0.0, (z + e) / (2 * e))).to(z.dtype)
    raise TypeError(f"no closed-form derivative for {type(act).__name__}")


_WT = "linear.weight^T"  # DenseStep.stack_extras: not a parameter name
#: from this many elements on, the batched kernels' tanh is 2 sigmoid(2 z) - 1 (see _tanh_)
_FAST_TANH_MIN = 4096


def _tanh_(z: torch.Tensor) -> torch.Tensor:
    """``tanh(z)`` in place for the batched kernels (a fresh tensor). On CPU, from
    :data:`_FAST_TANH_MIN` elements on and outside autograd, as ``2 sigmoid(2 z) - 1``: torch's
    eager CPU ``tanh`` is 2.5x (16K float32 elements) to 4.5x (512K) slower than that sequence
    of four vectorized passes; the result differs from ``torch.tanh`` by round-off (at most
    1.8e-7 absolute in float32, 3.4e-16 in float64, measured over ``|z|`` from 1e-6 to 30);
    ``+-inf`` and NaN as ``tanh``. Smaller tensors (a single layer's step), CUDA and tensors
    that autograd records use ``tanh_`` itself. A module's own ``forward`` is never changed."""
    if (z.numel() < _FAST_TANH_MIN or z.device.type != "cpu"
            or (z.requires_grad and torch.is_grad_enabled())):
        return z.tanh_()
    return z.mul_(2.0).sigmoid_().mul_(2.0).sub_(1.0)


def _linear_obstacle(owner: str, name: str, m: nn.Module, bias: bool = True) -> str | None:
    if type(m) is not nn.Linear or (bias and m.bias is None):
        return f"{owner}.{name} is a {type(m).__name__}, not a plain nn.Linear with a bias"
    return None


_CONVS = {2: nn.Conv2d, 3: nn.Conv3d}  # dims -> the convolution of a conv step


def _conv_obstacle(owner: str, name: str, m: nn.Module, bias: bool = True) -> str | None:
    one = (1,) * len(getattr(m, "stride", ()))
    if (type(m) not in _CONVS.values() or (bias and m.bias is None) or m.stride != one
            or m.dilation != one or m.groups != 1 or m.padding_mode != "zeros"
            or isinstance(m.padding, str)):
        return (f"{owner}.{name} is not a plain nn.Conv2d or nn.Conv3d (stride 1, dilation 1, "
                f"groups 1, zero padding given as numbers{', with a bias' if bias else ''})")
    return None


def _act_obstacle(owner: str, act: nn.Module) -> str | None:
    if type(act) not in ACTIVATIONS.values():
        return (f"{owner}.act is a {type(act).__name__}, not one of the built-in activations "
                f"{sorted(c.__name__ for c in ACTIVATIONS.values())}")
    return None


class DenseStep(nn.Module):
    """``F(x) = act(W x + b)``, ``W`` of shape ``(width, width)``; states ``(batch, width)``."""

    def __init__(self, width: int, act: str = "tanh"):
        super().__init__()
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width={width!r} is not allowed: use an int >= 1")
        self.linear = nn.Linear(width, width)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))

    def kernel_obstacle(self) -> str | None:
        """Why the native kernels (:meth:`forward_batched`, :meth:`forward_layer`,
        :meth:`vjp_batched`, :meth:`linearize_batched`) do not compute this module's
        ``forward`` (a message), else ``None``: they assume ``linear`` is exactly an
        ``nn.Linear`` with a bias and ``act`` a built-in activation (no parameters, no
        per-layer state). Read by :func:`mgrit.nn.chains.contract.kernel`, which also refuses the
        kernels to a subclass that overrides ``forward``."""
        return _linear_obstacle("DenseStep", "linear", self.linear) or \
            _act_obstacle("DenseStep", self.act)

    def forward_batched(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """``B`` layers at once: ``p`` holds this module's parameters stacked along dim 0
        (``linear.weight`` ``(B, w, w)``, ``linear.bias`` ``(B, w)``; optionally
        :meth:`stack_extras`); ``x`` is ``(B, batch, w)``. Built-in Tanh/ReLU are applied in
        place on the fresh pre-activation (a batched call runs only on steps without hooks)."""
        z = self._pre_activation(p, x)
        return self._activate_fresh(z)

    def forward_layer(self, p: dict, j: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``j`` of a stacked snapshot ``p`` (as :meth:`forward_batched`) on ``x``
        ``(batch, w)``: ``act(x W_j^T + b_j)`` in one ``addmm`` (the single steps of MGRIT's
        coarse sweeps; no module call)."""
        W, WT = p["linear.weight"], p.get(_WT)
        if WT is None or (W.requires_grad and torch.is_grad_enabled()):
            z = torch.addmm(p["linear.bias"][j], x, W[j].t())
        else:
            z = torch.addmm(p["linear.bias"][j], x, WT[j])
        return self._activate_fresh(z)

    @staticmethod
    def stack_extras(p: dict) -> dict:
        """Derived tensors of a stacked snapshot ``p`` (see
        :meth:`mgrit.nn.chains.stacking.Stacked.refresh`): the transposed weights ``(B, w, w)``,
        contiguous -- ``bmm`` with them is about 30% faster on CPU than with a transposed
        view. Constants: not used where a weight gradient is taken."""
        return {_WT: p["linear.weight"].transpose(1, 2).contiguous()}

    def _activate_fresh(self, z):
        """``act(z)`` for a freshly computed pre-activation ``z``: built-in Tanh/ReLU in place
        (nothing else holds ``z``), any other activation as a module call."""
        kind = type(self.act)
        if kind is nn.Tanh:
            return _tanh_(z)
        if kind is nn.ReLU:
            return z.relu_()
        return self.act(z)

    @staticmethod
    def _pre_activation(p: dict, x):
        """``z = x W^T + b`` of ``B`` layers, ``(B, batch, w)``."""
        W = p["linear.weight"]
        WT = p.get(_WT)
        if WT is None or (W.requires_grad and torch.is_grad_enabled()):  # a weight gradient
            WT = W.transpose(1, 2)
        z = torch.bmm(x, WT)  # bmm: baddbmm is 4x slower on CPU
        z += p["linear.bias"].unsqueeze(1)
        return z

    @property
    def closed_form_vjp(self) -> bool:
        """True when :meth:`vjp_batched` applies (the activation is a built-in one)."""
        return type(self.act) in (nn.Tanh, nn.ReLU, SmoothReLU)

    def linearize_batched(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """``act'(z)``, ``z = x W^T + b``, of ``B`` layers at states ``x`` ``(B, batch, w)``:
        the diagonal of the activation's Jacobian, ``(B, batch, w)``, reusable by every
        :meth:`vjp_batched` at the same states."""
        z = self._pre_activation(p, x)
        if type(self.act) is nn.Tanh:  # 1 - tanh(z)^2 in place: the same values, no temporaries
            return _tanh_(z).square_().neg_().add_(1.0)
        return _act_derivative(self.act, z)

    def vjp_batched(self, p: dict, x: torch.Tensor | None, v: torch.Tensor,
                    params: bool = False, dact: torch.Tensor | None = None
                    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Closed-form vector-Jacobian products of :meth:`forward_batched` at ``x``, without
        autograd (the adjoint MGRIT's steps and parameter-gradient sweep use it).

        With ``s = act'(z) * v``, ``z = x W^T + b``: ``J_x^T v = s W`` (returned when
        ``params`` is false, ``(B, batch, w)``), else the parameter gradients
        ``{"linear.weight": s^T x (B, w, w), "linear.bias": sum_batch s (B, w)}``. ``dact``:
        :meth:`linearize_batched` of the same rows if already computed (then ``x`` is only
        used for the weight gradient and may be ``None`` when ``params`` is false). Same dtype
        as ``forward_batched``; equal to autograd to round-off (``tests/nn/test_nn.py``).
        Raises ``TypeError`` when :attr:`closed_form_vjp` is false."""
        s = (self.linearize_batched(p, x) if dact is None else dact) * v
        if not params:
            return torch.bmm(s, p["linear.weight"])
        return {"linear.weight": torch.bmm(s.transpose(1, 2), x), "linear.bias": s.sum(1)}


def _grouped_conv(x, weight, bias, padding):
    """Apply ``B`` different ``C -> C`` convolutions to ``x`` ``(B, n, C, *S)`` (``S`` = H, W
    or D, H, W) with one ``conv2d``/``conv3d`` call (``groups = B``); ``weight``
    ``(B, C, C, k, ...)``, ``bias`` ``(B, C)``."""
    B, n, C, *S = x.shape
    conv = torch.nn.functional.conv3d if len(S) == 3 else torch.nn.functional.conv2d
    xr = x.transpose(0, 1).reshape(n, B * C, *S)
    y = conv(xr, weight.reshape(B * C, *weight.shape[2:]),
             None if bias is None else bias.reshape(B * C), padding=padding, groups=B)
    return y.reshape(n, B, C, *y.shape[2:]).transpose(0, 1)


def _check_conv(channels, kernel, dims=2):
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels={channels!r} is not allowed: use an int >= 1")
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel={kernel!r} is not allowed: use an odd int >= 1")
    if isinstance(dims, bool) or dims not in _CONVS:
        raise ValueError(f"dims={dims!r} is not allowed: use 2 (images, states (batch, C, H, "
                         f"W)) or 3 (voxels, states (batch, C, D, H, W))")


class ConvStep(nn.Module):
    """``F(x) = act(K * x + b)``: one ``channels -> channels`` convolution, 'same' padding
    (odd ``kernel``); states ``(batch, channels, H, W)``, or ``(batch, channels, D, H, W)``
    with ``dims=3`` (an ``nn.Conv3d``). Raises ValueError for a bad channels, kernel or dims."""

    def __init__(self, channels: int, kernel: int = 3, act: str = "relu", dims: int = 2):
        super().__init__()
        _check_conv(channels, kernel, dims)
        self.conv = _CONVS[dims](channels, channels, kernel, padding=kernel // 2)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x))

    def kernel_obstacle(self) -> str | None:
        """As :meth:`DenseStep.kernel_obstacle`: :meth:`forward_batched` assumes ``conv`` is a
        plain ``nn.Conv2d`` with a bias and ``act`` a built-in activation."""
        return _conv_obstacle("ConvStep", "conv", self.conv) or _act_obstacle("ConvStep", self.act)

    def forward_batched(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """``B`` layers at once as one grouped convolution; ``x`` ``(B, batch, C, H, W)``."""
        return self.act(_grouped_conv(x, p["conv.weight"], p["conv.bias"], self.conv.padding))


class TwoConvStep(nn.Module):
    """TorchBraid's MNIST block ``F(x) = act(K2 * act(K1 * x + b1) + b2)``: two ``channels ->
    channels`` convolutions, 'same' padding (odd ``kernel``); states ``(batch, channels, H, W)``.

    Args:
        channels, kernel: as :class:`ConvStep` (default kernel 3).
        act: ``"relu"`` (default), ``"tanh"`` or ``"smoothrelu"``.
        bias: give both convolutions a bias (default False: the block of our first
            reproduction; TorchBraid's example uses ``nn.Conv2d``'s default, ``bias=True``).
        dims: 2 (default, ``nn.Conv2d``) or 3 (``nn.Conv3d``, states ``(batch, C, D, H, W)``).
    """

    def __init__(self, channels: int, kernel: int = 3, act: str = "relu", bias: bool = False,
                 dims: int = 2):
        super().__init__()
        _check_conv(channels, kernel, dims)
        if not isinstance(bias, bool):
            raise ValueError(f"bias={bias!r} is not allowed: use True or False")
        conv = _CONVS[dims]
        self.conv1 = conv(channels, channels, kernel, padding=kernel // 2, bias=bias)
        self.conv2 = conv(channels, channels, kernel, padding=kernel // 2, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv2(self.act(self.conv1(x))))

    def kernel_obstacle(self) -> str | None:
        """As :meth:`DenseStep.kernel_obstacle`: :meth:`forward_batched` assumes ``conv1``,
        ``conv2`` are plain ``nn.Conv2d`` (bias or not) and ``act`` a built-in activation."""
        return (_conv_obstacle("TwoConvStep", "conv1", self.conv1, bias=False)
                or _conv_obstacle("TwoConvStep", "conv2", self.conv2, bias=False)
                or _act_obstacle("TwoConvStep", self.act))

    def forward_batched(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """``B`` layers at once as grouped convolutions; ``x`` ``(B, batch, C, H, W)``."""
        pad = self.conv1.padding
        y = self.act(_grouped_conv(x, p["conv1.weight"], p.get("conv1.bias"), pad))
        return self.act(_grouped_conv(y, p["conv2.weight"], p.get("conv2.bias"), pad))


def make_step(kind: str, features: int, act: str, kernel: int = 3, bias: bool = False,
              dims: int = 2) -> nn.Module:
    """Factory used by the main job: ``kind`` in ``dense | conv | twoconv`` (``bias``: the
    two-conv step's convolution biases; dense and conv steps always have one; ``dims``: 2 or
    3, the spatial dimensions of a conv step's states)."""
    if kind == "dense":
        return DenseStep(features, act)
    if kind == "conv":
        return ConvStep(features, kernel, act, dims)
    if kind == "twoconv":
        return TwoConvStep(features, kernel, act, bias, dims)
    raise ValueError(f"step type {kind!r} is not allowed: use 'dense', 'conv' or 'twoconv'")


class ResidualStep(nn.Module):
    """Serial forward-Euler layer ``x + h * F(x)`` (the building block of ``to_serial()``)."""

    def __init__(self, F: nn.Module, h: float):
        super().__init__()
        self.F = F
        self.h = float(h)

    def forward(self, x):
        return x + self.h * self.F(x)
