"""The main job's multi-segment and transformer networks, listed in
:data:`mgrit.models.MODELS` (``--model staged-resnet|vit|gpt``).

* ``staged-resnet``: a conv ResNet in three stages (stem, segment, strided transition,
  segment, strided transition, segment, head), e.g. channels 4 -> 8 -> 16 and 28 -> 14 -> 7
  pixels on MNIST; each segment its own MGRIT chain.
* ``vit``: a ViT-style encoder (Dosovitskiy et al. 2021): patch embedding with class token and
  learned positions, a layer-parallel stack of pre-LN :class:`~mgrit.nn.TransformerStep` s,
  LayerNorm + linear head on the class token.
* ``gpt``: a decoder-only character-level language model (GPT-2's layout, Radford et al.
  2019): token + learned position embedding, ``--buffer-layers`` serial causal blocks, the
  layer-parallel causal stack, as many serial blocks again, LayerNorm + vocabulary head.
  Serial "buffer" layers around the parallel part follow Jiang et al. 2026 (arXiv
  2601.09026), who keep a few for decoder-only models.

Every transformer block (parallel or buffer) is ``x + h F(x)`` with ``F`` the
:class:`~mgrit.nn.TransformerStep` and ``h = --T / --layers``: ``--T`` equal to ``--layers``
gives the standard pre-LN transformer (``h = 1``), the default ``--T 1`` the ODE scaling
``h = 1/N``. ``d_ff`` is ``--d-ff`` (0: ``4 d_model``); MLP activation GELU (vit) or GELU with
GPT-2's tanh approximation (gpt); ``--dropout`` and ``--drop-path`` (default 0: none) in every
block (``TransformerStep``; in the layer-parallel stack one mask per forward and layer,
independent of the rank count; the gpt's serial buffer blocks draw theirs from the default
generator on the rank that holds them, so with them and dropout the later masks depend on the
layer-rank count).

Seeds (independent of the rank count, so ``--serial`` and any number of layer ranks start from
the same weights): ordinary module ``i`` of the network (0-based position among the parts) is
created right after ``torch.manual_seed(seed + 7919 * i)``; the layers of segment ``s`` with
:func:`~mgrit.nn.layer_seed` of ``seed`` (one segment) or ``seed + 7919 * (i + 1)`` (segment at
part ``i`` of a staged network). The serial form is ``nn.Sequential`` of the same modules with
the segments' layers as ``ResidualStep`` s, so its state-dict keys equal the layer-parallel
network's global keys (checkpoints load into each other).

Depends on torch and :mod:`mgrit.nn`; listed in :data:`mgrit.models.registry.MODELS`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..nn import LayerParallelNet, LayerParallelResNet, ResidualStep, TransformerStep, make_step
from ..nn.resnet.seeding import serial_resnet
from ..nn.steps import activation
from .options import mgrit_options
from .transformer_parts import ClassTokenHead, LMHead, PatchEmbedding, TokenEmbedding

__all__ = ["build_staged_resnet", "build_vit", "build_gpt", "STAGE_WIDTHS",
           "describe_model"]

#: Channel multiplier of each stage of the staged ResNet (``--channels`` times these).
STAGE_WIDTHS = (1, 2, 4)
_SEED_STRIDE = 7919


class _Segment:
    """A segment to be: ``make(k)`` builds layer ``k`` of ``n`` on states ``shape``."""

    def __init__(self, make, n: int, shape: tuple, seed: int):
        self.make, self.n, self.shape, self.seed = make, n, tuple(shape), seed


def _assemble(parts: list, cfg, comm):
    """``parts``: modules and :class:`_Segment` s in order. Serial (``comm`` None):
    ``nn.Sequential`` with each segment's layers as ResidualSteps; else a LayerParallelNet."""
    if comm is None:
        out = []
        for p in parts:
            out += list(serial_resnet(p.make, p.n, T=cfg.T, seed=p.seed)) \
                if isinstance(p, _Segment) else [p]
        return nn.Sequential(*out)
    fwd, bwd = mgrit_options(cfg)
    built = [LayerParallelResNet.build(p.make, p.n, p.shape, comm=comm, seed=p.seed, T=cfg.T,
                                       forward=fwd, backward=bwd, adjoint=cfg.adjoint,
                                       warm_start=cfg.warm_start,
                                       warm_start_adjoint=cfg.warm_start_adjoint)
             if isinstance(p, _Segment) else p for p in parts]
    return LayerParallelNet(*built)


def _seeded(cfg, i: int, make):
    """``make()`` right after ``torch.manual_seed(cfg.seed + 7919 * i)``."""
    torch.manual_seed(cfg.seed + _SEED_STRIDE * i)
    return make()


def _no_layers_form(name: str, form: str) -> None:
    if form == "layers":
        raise ValueError(f"--model {name} has no layer-wise form: use --method mgrit or serial")


def _image_shape(name: str, in_shape) -> tuple:
    if len(in_shape) != 3:
        raise ValueError(f"--model {name} needs image data (C, H, W); the data set has samples "
                         f"of shape {tuple(in_shape)}: use an image data set (mnist5k, digits)")
    return tuple(in_shape)


def _d_ff(cfg) -> int:
    return cfg.d_ff or 4 * cfg.d_model


def _block(cfg, causal: bool):
    """A TransformerStep of the job's sizes (its ValueError names d_model and n_heads), with
    ``--dropout`` and ``--drop-path`` (attributes optional: 0)."""
    return TransformerStep(cfg.d_model, cfg.heads, _d_ff(cfg), causal=causal,
                           act="gelu_tanh" if causal else "gelu",
                           dropout=getattr(cfg, "dropout", 0.0),
                           drop_path=getattr(cfg, "drop_path", 0.0))


def build_staged_resnet(cfg, in_shape, num_classes, comm=None, form="network"):
    """Stem ``Conv2d(C, c, k, padding=k//2)`` + activation -> segment 1 (``cfg.layers``
    ``--step`` layers on ``c`` channels at ``H x W``) -> ``Conv2d(c, 2c, 3, stride=2,
    padding=1)`` + activation -> segment 2 (``2c`` channels, ``ceil(H/2)``) -> the same to
    ``4c`` -> segment 3 (``4c``, ``ceil(H/4)``) -> flatten + ``Linear`` (``c`` =
    ``cfg.channels``, ``k`` = ``cfg.kernel``). Each segment has ``cfg.layers`` layers, step
    ``h = T / layers``, and is its own MGRIT chain. Raises ValueError for non-image data or
    ``--step dense``."""
    _no_layers_form("staged-resnet", form)
    C, H, W = _image_shape("staged-resnet", in_shape)
    if cfg.step not in ("conv", "twoconv"):
        raise ValueError(f"--model staged-resnet is a convolutional ResNet: use --step conv or "
                         f"twoconv, got --step {cfg.step}")
    act, k = cfg.activation, cfg.kernel
    widths = [cfg.channels * m for m in STAGE_WIDTHS]
    parts = [_seeded(cfg, 0, lambda: nn.Sequential(nn.Conv2d(C, widths[0], k, padding=k // 2),
                                                   activation(act)))]
    for s, c in enumerate(widths):
        if s:
            H, W = (H + 1) // 2, (W + 1) // 2
            parts.append(_seeded(cfg, len(parts), lambda c=c: nn.Sequential(
                nn.Conv2d(c // 2, c, 3, stride=2, padding=1), activation(act))))
        parts.append(_Segment(lambda j, c=c: make_step(cfg.step, c, act, k), cfg.layers,
                              (c, H, W), cfg.seed + _SEED_STRIDE * (len(parts) + 1)))
    parts.append(_seeded(cfg, len(parts), lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(widths[-1] * H * W, num_classes))))
    return _assemble(parts, cfg, comm)


def build_vit(cfg, in_shape, num_classes, comm=None, form="network"):
    """:class:`PatchEmbedding` (``cfg.patch`` x ``cfg.patch`` patches, class token, learned
    positions; ``d_model``) -> ``cfg.layers`` pre-LN encoder blocks (``cfg.heads`` heads,
    layer-parallel) -> :class:`ClassTokenHead` (LayerNorm + Linear on the class token).
    Raises ValueError for non-image data or a patch that does not divide the image."""
    _no_layers_form("vit", form)
    C, H, W = _image_shape("vit", in_shape)
    if H % cfg.patch or W % cfg.patch:
        divisors = [p for p in range(1, min(H, W) + 1) if H % p == 0 and W % p == 0]
        raise ValueError(f"--patch={cfg.patch} does not divide the {H}x{W} images: use a "
                         f"divisor of both (one of {divisors})")
    embed = _seeded(cfg, 0, lambda: PatchEmbedding((C, H, W), cfg.patch, cfg.d_model))
    head = _seeded(cfg, 2, lambda: ClassTokenHead(cfg.d_model, num_classes))
    seg = _Segment(lambda k: _block(cfg, causal=False), cfg.layers,
                   (embed.n_tokens, cfg.d_model), cfg.seed)
    return _assemble([embed, seg, head], cfg, comm)


def build_gpt(cfg, in_shape, num_classes, comm=None, form="network"):
    """:class:`TokenEmbedding` (``num_classes`` = vocabulary, ``cfg.context`` positions) ->
    ``cfg.buffer_layers`` serial causal blocks -> ``cfg.layers`` layer-parallel causal blocks
    -> ``cfg.buffer_layers`` serial causal blocks -> :class:`LMHead`; logits ``(batch,
    context, vocab)``. Raises ValueError for inputs that are not token sequences of at most
    ``cfg.context`` tokens."""
    _no_layers_form("gpt", form)
    if len(in_shape) != 1:
        raise ValueError(f"--model gpt needs token sequences (batch, tokens); the data set has "
                         f"samples of shape {tuple(in_shape)}: use a text corpus (--dataset "
                         f"pydoc-topics)")
    if in_shape[0] > cfg.context:
        raise ValueError(f"the data's sequences have {in_shape[0]} tokens, more than the "
                         f"model's --context={cfg.context} positions: use --context >= "
                         f"{in_shape[0]}")
    h = cfg.T / cfg.layers
    b = cfg.buffer_layers
    parts = [_seeded(cfg, 0, lambda: TokenEmbedding(num_classes, cfg.context, cfg.d_model))]
    parts += [_seeded(cfg, 1 + i, lambda: ResidualStep(_block(cfg, causal=True), h))
              for i in range(b)]
    parts.append(_Segment(lambda k: _block(cfg, causal=True), cfg.layers,
                          (cfg.context, cfg.d_model), cfg.seed))
    parts += [_seeded(cfg, 2 + b + i, lambda: ResidualStep(_block(cfg, causal=True), h))
              for i in range(b)]
    parts.append(_seeded(cfg, 2 + 2 * b, lambda: LMHead(cfg.d_model, num_classes)))
    return _assemble(parts, cfg, comm)


def describe_model(cfg) -> str:
    """One line naming the network of ``cfg`` (for the job's start line)."""
    if cfg.model == "staged-resnet":
        widths = ", ".join(str(cfg.channels * m) for m in STAGE_WIDTHS)
        return f"staged ResNet 3 x {cfg.layers} x {cfg.step} steps ({widths} channels)"
    if cfg.model in ("vit", "gpt"):
        b = cfg.buffer_layers
        extra = (f", {cfg.patch}x{cfg.patch} patches" if cfg.model == "vit" else
                 f", context {cfg.context}, {b} + {b} serial buffer layers")
        drop, path = getattr(cfg, "dropout", 0.0), getattr(cfg, "drop_path", 0.0)
        if drop or path:
            extra += f", dropout {drop:g}, drop-path {path:g}"
        return (f"{cfg.model} {cfg.layers} x pre-LN blocks (d_model {cfg.d_model}, {cfg.heads} "
                f"heads, d_ff {_d_ff(cfg)}, h {cfg.T / cfg.layers:g}{extra})")
    if cfg.model == "cifar-resnet":
        widths = ", ".join(str(cfg.channels * m) for m in STAGE_WIDTHS)
        return f"CIFAR ResNet 3 x {cfg.layers} basic blocks with BatchNorm ({widths} channels, h 1)"
    if cfg.model == "resnet":
        return (f"{cfg.layers} x {cfg.step} steps "
                f"({cfg.width if cfg.step == 'dense' else cfg.channels} features)")
    return f"{cfg.model} ({cfg.layers} layers)"
