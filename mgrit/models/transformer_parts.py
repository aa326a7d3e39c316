"""The ordinary modules around the layer-parallel encoder/decoder stacks of the main job's
transformers (:mod:`mgrit.models.transformer`): embeddings that turn the input into
the segment's state ``(batch, tokens, d_model)``, and heads that turn the final state into
logits. They run serially on one layer rank (the first before the segment, the last after it;
see :mod:`mgrit.nn.net`).

Initialisation follows torchvision's ViT and GPT-2 where PyTorch has no default: class token
zeros, learned positions ``N(0, 0.02)``; everything else is the default of ``nn.Conv2d``,
``nn.Embedding`` (``N(0, 1)``), ``nn.LayerNorm`` and ``nn.Linear``.

Depends on torch only.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["PatchEmbedding", "ClassTokenHead", "TokenEmbedding", "LMHead"]

POSITION_STD = 0.02


class PatchEmbedding(nn.Module):
    """ViT input: non-overlapping ``patch x patch`` patches, each linearly embedded (one strided
    convolution), a learned class token in front, learned position embeddings added
    (Dosovitskiy et al. 2021, "An image is worth 16x16 words").

    Args:
        image_shape: ``(C, H, W)`` of one input image; ``H`` and ``W`` multiples of ``patch``.
        patch: patch side (int >= 1). d_model: embedding width (int >= 1).

    Shapes: ``(batch, C, H, W)`` -> ``(batch, 1 + (H/patch)(W/patch), d_model)``; token 0 is the
    class token. Parameters: ``proj`` (``nn.Conv2d(C, d_model, patch, stride=patch)``),
    ``cls`` ``(1, 1, d_model)`` (zeros), ``pos`` ``(tokens, d_model)`` (``N(0, 0.02)``).

    Raises:
        ValueError: (construction) sizes that are not positive ints, a patch that does not
            divide ``H`` or ``W``; (call) an input of another shape.
    """

    def __init__(self, image_shape, patch: int, d_model: int):
        super().__init__()
        shape = tuple(int(d) for d in image_shape)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"image_shape={tuple(image_shape)} is not allowed: use (C, H, W)")
        for name, v in (("patch", patch), ("d_model", d_model)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} is not allowed: use an int >= 1")
        C, H, W = shape
        if H % patch or W % patch:
            divisors = [p for p in range(1, min(H, W) + 1) if H % p == 0 and W % p == 0]
            raise ValueError(f"patch={patch} does not divide the image size {H}x{W}: use a "
                             f"patch size that divides both (one of {divisors})")
        self.image_shape, self.patch, self.d_model = shape, patch, d_model
        self.n_tokens = 1 + (H // patch) * (W // patch)
        self.proj = nn.Conv2d(C, d_model, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.randn(self.n_tokens, d_model) * POSITION_STD)

    def extra_repr(self) -> str:
        return f"image_shape={self.image_shape}, patch={self.patch}, tokens={self.n_tokens}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != self.image_shape:
            raise ValueError(f"input of shape {tuple(x.shape)} is not allowed: use (batch, "
                             f"{', '.join(map(str, self.image_shape))})")
        z = self.proj(x).flatten(2).transpose(1, 2)  # (batch, patches, d_model)
        return torch.cat([self.cls.expand(z.shape[0], -1, -1), z], dim=1) + self.pos  # traceable


class ClassTokenHead(nn.Module):
    """ViT head: ``LayerNorm`` then ``Linear(d_model, classes)`` on the class token (token 0).
    ``(batch, tokens, d_model)`` -> ``(batch, classes)``."""

    def __init__(self, d_model: int, classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x[:, 0]))


class TokenEmbedding(nn.Module):
    """Decoder input: token embedding plus learned positions (GPT-2's input layer, no dropout).

    Args:
        vocab: vocabulary size. positions: the longest sequence the model accepts (its
            context length). d_model: width. (Each an int >= 1.)

    Shapes: ``int64`` ids ``(batch, T)`` with ``T <= positions`` -> ``(batch, T, d_model)``
    (``tok(ids) + pos[:T]``). Parameters: ``tok`` (``nn.Embedding(vocab, d_model)``), ``pos``
    ``(positions, d_model)`` (``N(0, 0.02)``).

    Raises:
        ValueError: sizes that are not positive ints; (call) ids that are not a 2-D integer
            tensor, a sequence longer than ``positions`` (named with both lengths).
    """

    def __init__(self, vocab: int, positions: int, d_model: int):
        super().__init__()
        for name, v in (("vocab", vocab), ("positions", positions), ("d_model", d_model)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} is not allowed: use an int >= 1")
        self.vocab, self.positions, self.d_model = vocab, positions, d_model
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(positions, d_model) * POSITION_STD)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, positions={self.positions}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"token ids of shape {tuple(ids.shape)} and dtype {ids.dtype} are "
                             f"not allowed: use an integer tensor (batch, tokens)")
        T = ids.shape[1]
        if T > self.positions:
            raise ValueError(f"a sequence of {T} tokens is longer than the model's "
                             f"{self.positions} positions: use sequences of at most "
                             f"{self.positions} tokens (or build the model with more positions)")
        return self.tok(ids) + self.pos[:T]


class LMHead(nn.Module):
    """Decoder head: final ``LayerNorm`` then ``Linear(d_model, vocab)`` at every position.
    ``(batch, T, d_model)`` -> logits ``(batch, T, vocab)``."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))
