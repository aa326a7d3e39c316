"""Dropout and DropPath (stochastic depth) inside layer-parallel steps: one mask per training
forward and layer, whatever solves the chain.

MGRIT applies a layer many times per forward (every relaxation sweep, every cycle, the coarse
levels, a ``torch.utils.checkpoint`` recomputation, the adjoint's linearizations); a mask
redrawn at each application would make the layer a different function in every sweep, the
solve would converge to no fixed network and the gradients would be wrong. Here a mask is a
pure function of

* the forward's **seed**: one int64 drawn from PyTorch's default generator when a training
  forward of the segment starts (:func:`draw_seed`; every rank draws it the same way, so with
  the default generators in the same state on every rank -- ``torch.manual_seed(s)`` on every
  rank -- every rank gets the same seed), and
* the **global layer index** ``k`` and the module's **slot** (its position among the
  stochastic modules of layer ``k``, in ``modules()`` order), and the shape of its input,

through a ``torch.Generator`` seeded with :func:`mask_seed`. So ``P = 1, 2, 3`` layer ranks
give identical masks for the same seed, ``torch.manual_seed(s)`` before a forward reproduces
it as in serial PyTorch, and the next forward draws new masks. The masks never depend on
which rank owns a layer or on the rank count.

:class:`Dropout` (elementwise, ``p``; kept values scaled by ``1/(1-p)``, as ``nn.Dropout``)
and :class:`DropPath` (per sample: the whole branch is dropped for a sample with probability
``p``, kept ones scaled by ``1/(1-p)``; Huang et al. 2016, "Deep networks with stochastic
depth", as used in ViTs by timm's ``DropPath``) read the seed from the :class:`NoiseSource`
their segment attaches to them (:func:`attach`). Outside a segment (no source, or no seed set:
a module called on its own) they behave like ``nn.Dropout``: a fresh mask from the default
generator on every call. In evaluation mode, or with ``p = 0``, they are the identity.

Serial reference: :meth:`LayerParallelResNet.to_serial` and :func:`~mgrit.nn.serial_resnet`
give layers whose stochastic modules draw the same masks from the same seed (a forward
pre-hook on the first layer, :func:`seed_on_entry`, draws the seed exactly as the segment's
forward does).

With data-parallel replicas each replica draws the masks of its own shard from the same seed
(the masks then repeat across replicas' shards): a ``--dp`` run with dropout is not the
one-replica run; only BatchNorm has that property.

**One random stream per network** (:func:`share_stream`). The layer ranks of one network are
one serial network, so they share one stream of PyTorch's default generator, the first layer
rank's: a training forward of a segment with stochastic modules on ``P > 1`` ranks first gives
every rank the generator state of the segment's first layer rank (one broadcast) and then
draws the seed, so the seed agrees even when the ranks' generators differ (per-rank seeds,
``torch.manual_seed(1000 + rank)``; or an ``nn.Dropout`` in the opening, which only the first
rank runs). :class:`~mgrit.nn.LayerParallelNet` does the same before every other segment and,
after its last part, from the rank holding the output, so that ordinary modules around the
segments (an ``nn.Dropout`` in the opening or closing, ``torch.rand`` anywhere) draw what the
serial network draws. "Serial" is then: the serial network seeded as the first layer rank
(with the same seed on every rank, the same seed), the generators of all layer ranks equal
after every training forward. Evaluation forwards share nothing.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import torch
from mpi4py import MPI
from torch import nn

__all__ = ["Dropout", "DropPath", "NoiseSource", "STOCHASTIC_TYPES", "attach", "draw_seed",
           "share_stream",
           "mask_seed", "seed_on_entry", "seed_serial", "plain_dropout_error"]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant (splitmix64)
_M64 = (1 << 64) - 1


def _splitmix(z: int) -> int:
    z = (z + _MIX) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def mask_seed(seed: int, layer: int, slot: int) -> int:
    """Seed of the mask of module ``slot`` of global layer ``layer`` in the forward with
    ``seed`` (a 63-bit int; splitmix64 of the three, so neighbouring layers get unrelated
    streams)."""
    return _splitmix(_splitmix(_splitmix(int(seed) & _M64) ^ int(layer)) ^ int(slot)) >> 1


def share_stream(comm: MPI.Comm, root: int) -> None:
    """Every rank of ``comm`` takes ``root``'s default CPU generator state (and the current
    CUDA device's, where CUDA is initialized on both): one broadcast; nothing on one rank
    (module doc)."""
    if comm.Get_size() == 1:
        return
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    mine = (torch.default_generator.get_state().numpy().tobytes(),
            torch.cuda.get_rng_state().numpy().tobytes() if cuda else None) \
        if comm.Get_rank() == root else None
    cpu, dev = comm.bcast(mine, root=root)
    if comm.Get_rank() != root:  # set only where it differs: an equal state is left untouched
        if cpu != torch.default_generator.get_state().numpy().tobytes():
            torch.default_generator.set_state(torch.frombuffer(bytearray(cpu), dtype=torch.uint8))
        if dev is not None and cuda:
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(dev), dtype=torch.uint8))


def draw_seed() -> int:
    """One int64 from PyTorch's default CPU generator (consumes it as one ``torch.randint``)."""
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))


class NoiseSource:
    """The per-forward seed shared by the stochastic modules of one segment (one per
    :class:`~mgrit.nn.resnet.LayerParallelResNet`, and one per serial twin).

    Attributes:
        seed: the current forward's seed, or ``None`` (modules then act like ``nn.Dropout``).
        masks: cache of the current forward's masks (``None``: no cache), keyed by
            ``(layer, slot, shape, dtype, device)``; a forward's autograd node keeps its own.
    """

    def __init__(self):
        self.seed: int | None = None
        self.masks: dict | None = None

    @contextlib.contextmanager
    def use(self, seed: int | None, masks: dict | None = None):
        """Make ``seed`` (and its mask cache) current inside the block; the previous ones are
        restored after it (nested forwards, a backward inside another forward's scope)."""
        old = self.seed, self.masks
        self.seed, self.masks = seed, masks
        try:
            yield
        finally:
            self.seed, self.masks = old

    def __deepcopy__(self, memo):  # a copy starts without a current forward
        return NoiseSource()

    def mask(self, layer: int, slot: int, shape, dtype, device, p: float) -> torch.Tensor:
        """The keep mask, scaled by ``1/(1-p)``, of shape ``shape`` (the current seed)."""
        key = (layer, slot, tuple(shape), dtype, device)
        m = None if self.masks is None else self.masks.get(key)
        if m is None:
            g = torch.Generator(device=device)
            g.manual_seed(mask_seed(self.seed, layer, slot))
            with torch.no_grad():
                keep = torch.rand(shape, generator=g, device=device, dtype=torch.float32) >= p
                m = keep.to(dtype) / (1.0 - p)
            if self.masks is not None:
                self.masks[key] = m
        return m


def _check_p(name: str, p) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"{name}: p={p!r} is not allowed: use a number in [0, 1)")
    return float(p)


class _Stochastic(nn.Module):
    #: never stacked with other layers (``mgrit.nn.chains.stacking``'s documented opt-out)
    batchable = False

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = _check_p(type(self).__name__, p)
        self.noise: NoiseSource | None = None  # set by attach()
        self.layer, self.slot = None, 0

    def extra_repr(self) -> str:
        where = "" if self.layer is None else f", layer={self.layer}, slot={self.slot}"
        return f"p={self.p}{where}"

    def _mask_shape(self, x: torch.Tensor) -> tuple:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        src = self.noise
        if src is None or src.seed is None or self.layer is None:  # outside a segment
            keep = torch.rand(self._mask_shape(x), device=x.device) >= self.p
            return x * (keep.to(x.dtype) / (1.0 - self.p))
        return x * src.mask(self.layer, self.slot, self._mask_shape(x), x.dtype, x.device, self.p)


class Dropout(_Stochastic):
    """``nn.Dropout(p)`` with a mask that is a function of (forward seed, layer, slot) inside a
    layer-parallel segment (module doc). Any shape; ``p`` in ``[0, 1)`` (default 0.5)."""

    def _mask_shape(self, x):
        return tuple(x.shape)


class DropPath(_Stochastic):
    """Stochastic depth (Huang et al. 2016; timm's ``DropPath``): drops the whole input of a
    sample with probability ``p`` (a residual branch: put it on ``F``'s output), scales kept
    samples by ``1/(1-p)``. Input ``(batch, ...)``; ``p`` in ``[0, 1)`` (default 0.5)."""

    def _mask_shape(self, x):
        return (x.shape[0],) + (1,) * (x.dim() - 1)


#: the stochastic modules a segment seeds
STOCHASTIC_TYPES = (_Stochastic,)
#: torch's dropout modules, which draw from the default generator on every call
_PLAIN = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
          nn.FeatureAlphaDropout)


def plain_dropout_error(steps: Sequence[nn.Module], first: int) -> str | None:
    """A message if a step contains one of torch's own dropout modules (they would draw a new
    mask at every MGRIT application), naming the layer and the replacement."""
    for j, s in enumerate(steps):
        for name, m in s.named_modules():
            if isinstance(m, _PLAIN):
                return (f"layer {first + j} contains {type(m).__name__} ({name or 'the step'}), "
                        f"which draws a new mask at every application, i.e. in every MGRIT "
                        f"sweep: use mgrit.nn.steps.Dropout(p) (same masks in every sweep, "
                        f"the adjoint and recomputation; one mask per forward and layer) or "
                        f"DropPath(p) for stochastic depth")
    return None


def attach(steps: Sequence[nn.Module], first: int, source: NoiseSource) -> tuple:
    """Give every stochastic module of ``steps`` (layer ``first + j`` is ``steps[j]``) the
    ``source``, its global layer index and slot. Returns ``(count, error)``: how many modules
    were found, and a message if one module object sits in two layers (it has one index)."""
    seen, count = {}, 0
    for j, s in enumerate(steps):
        slot = 0
        for m in s.modules():
            if isinstance(m, STOCHASTIC_TYPES):
                if id(m) in seen and seen[id(m)] != first + j:
                    return count, (f"the {type(m).__name__} module of layer {seen[id(m)]} is "
                                   f"also used by layer {first + j}: a stochastic module draws "
                                   f"its mask from its layer index; give each layer its own")
                seen[id(m)] = first + j
                m.noise, m.layer, m.slot = source, first + j, slot
                slot += 1
                count += 1
    return count, None


def any_stochastic(steps: Sequence[nn.Module], comm: MPI.Comm) -> bool:
    """Whether any layer on any rank of ``comm`` has a stochastic module (collective)."""
    local = any(isinstance(m, STOCHASTIC_TYPES) for s in steps for m in s.modules())
    return bool(comm.allreduce(local, op=MPI.LOR)) if comm.Get_size() > 1 else local


def seed_on_entry(first_layer: nn.Module, source: NoiseSource):
    """Forward pre-hook for a serial twin: when ``first_layer`` runs in training mode, draw a
    seed with :func:`draw_seed` (as the segment's forward does) and make it ``source``'s
    current seed (no mask cache). Returns the hook handle."""
    def hook(module, args):
        source.seed = draw_seed() if module.training else None
        source.masks = None
    return first_layer.register_forward_pre_hook(hook)


def seed_serial(layers: Sequence[nn.Module]) -> None:
    """Make the serial layers ``layers`` (``ResidualStep`` s of one segment, global layer ``k``
    is ``layers[k]``) draw the segment's masks: a fresh :class:`NoiseSource` attached to their
    stochastic modules and :func:`seed_on_entry` on ``layers[0]``. Nothing when they have
    none. Raises ValueError if one stochastic module sits in two layers."""
    steps = [getattr(l, "F", l) for l in layers]
    if not any(isinstance(m, STOCHASTIC_TYPES) for s in steps for m in s.modules()):
        return
    source = NoiseSource()
    error = attach(steps, 0, source)[1]
    if error:
        raise ValueError(error)
    seed_on_entry(layers[0], source)


def drew_message() -> str:
    """The error of a solve during which torch's default generator moved: a step drew from it
    or, when this process runs other threads, possibly one of them (a data loader; the
    generator is one per process, so the check cannot tell the threads apart)."""
    msg = ("a step drew random numbers from torch's default generator during the solve "
           "(e.g. F.dropout or torch.rand in its forward): MGRIT applies a layer many times "
           "per forward, so it would be a different function in every sweep; use "
           "mgrit.nn.steps.Dropout / DropPath modules")
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if not others:
        return msg
    return (f"torch's default generator moved during the solve: either {msg}; or another "
            f"thread of this process drew from it meanwhile ({len(others)} other thread(s) "
            f"running: {', '.join(repr(n) for n in others[:3])}; e.g. a data loader): give "
            f"that thread its own torch.Generator (torch.rand(..., generator=g)); the "
            f"generator is shared by all threads, so this check cannot tell them apart")


def rng_unchanged(before: torch.Tensor) -> bool:
    """Whether the default CPU generator is in state ``before`` (``get_state()``)."""
    return bool(torch.equal(before, torch.default_generator.get_state()))

