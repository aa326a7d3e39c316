"""The fuzzer's networks: a spec (a small JSON-able dict) -> a :class:`Twin`, the layer-parallel
model on a communicator and its serial PyTorch twin with the same weights (float64).

Spec keys: ``kind`` (``dense``, ``conv``, ``transformer``, ``multiseg``: a
:class:`~mgrit.nn.LayerParallelNet`; ``gru``: a :class:`~mgrit.nn.ParallelGRU`), ``step``
(``shipped``; ``user``: a user step class; ``buffer``: a user class with a per-layer registered
buffer; ``subclass``/``subclass_buffer``: a subclass of the shipped step that overrides
``forward``, without / with a per-layer buffer), ``layers`` (N), ``levels`` (1: the pipelined
one-level path; 2: MGRIT), ``norm`` (``l2``/``inf``, the solver's residual norm), ``compiled``
(steps wrapped in ``torch.compile``), ``seed`` (weights), ``spatial`` (``conv`` only, optional:
``None`` or the keyword arguments of :class:`mgrit.spatial.SpatialCoarsening` for the coarse
level; ``grid="vertex"`` uses 5 x 5 pixels, else 4 x 4).

Serial twin: ``net.to_serial()`` of an uncompiled build with the same seeds, i.e.
``nn.Sequential`` of the ordinary modules and ``ResidualStep(step, h)`` layers; global keys
(``named_global_parameters``) are its ``named_parameters`` keys. GRU: an ``nn.GRUCell`` unrolled.
Step classes live at module level: ``to_serial`` pickles modules between ranks.
"""
from __future__ import annotations

import torch
from mpi4py import MPI
from torch import nn

from mgrit.nn import (ConvStep, DenseStep, LayerParallelNet, LayerParallelResNet, ParallelGRU,
                      TransformerStep)
from mgrit.options import MGRITOptions
from mgrit.spatial import SpatialCoarsening

KINDS = ("dense", "conv", "transformer", "multiseg", "gru")
STEPS = ("shipped", "user", "buffer", "subclass", "subclass_buffer")
W, CH, HW, TOK, DM, SEQ = 3, 2, 4, 3, 4, 4  # widths, channels, pixels, tokens, d_model, GRU steps


class UserDense(nn.Module):
    """A user step: ``tanh(W x + b) * (1 + x / 10)`` (not a shipped class). Buffer ``poison``
    (0): set to 1, the forward is unchanged but its vector-Jacobian product is NaN (the
    unselected branch of ``torch.where`` is NaN), as serial autograd computes it."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("poison", torch.tensor(0.0))

    def forward(self, x):
        y = torch.tanh(self.lin(x)) * (1.0 + 0.1 * x)
        return torch.where(self.poison > 2, torch.sqrt(1 - self.poison * (2 + y * y)), y)


class BufferDense(UserDense):
    """A user step keeping a per-layer value in a registered buffer (the documented way)."""

    def __init__(self, width, k):
        super().__init__(width)
        self.register_buffer("shift", torch.tensor(0.1 * (k + 1)))

    def forward(self, x):
        y = torch.tanh(self.lin(x) + self.shift)  # the poison as in UserDense (nan_backward)
        return torch.where(self.poison > 2, torch.sqrt(1 - self.poison * (2 + y * y)), y)


class UserConv(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return torch.tanh(self.conv(x))


class BufferConv(UserConv):
    def __init__(self, ch, k):
        super().__init__(ch)
        self.register_buffer("shift", torch.tensor(0.05 * (k + 1)))

    def forward(self, x):
        return torch.tanh(self.conv(x) - self.shift)


class HalfDense(DenseStep):
    """Subclass of a shipped step overriding ``forward`` (issue 22 item 1)."""

    def forward(self, x):
        return 0.5 * super().forward(x)


class ScaledDense(DenseStep):
    def __init__(self, width, k):
        super().__init__(width, "tanh")
        self.register_buffer("scale", torch.tensor(1.0 + 0.2 * k))

    def forward(self, x):
        return self.scale * super().forward(x)


class HalfConv(ConvStep):
    def forward(self, x):
        return 0.5 * super().forward(x)


class ScaledConv(ConvStep):
    def __init__(self, ch, k):
        super().__init__(ch, 3, "tanh")
        self.register_buffer("scale", torch.tensor(1.0 + 0.2 * k))

    def forward(self, x):
        return self.scale * super().forward(x)


class BufferTokenMix(nn.Module):
    """A user transformer-shaped step with a per-layer buffer: LayerNorm, then a linear map
    over features and one over tokens; states ``(batch, tokens, d)``."""

    def __init__(self, tokens, d, k):
        super().__init__()
        self.norm, self.feat, self.tok = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(tokens, tokens)
        self.register_buffer("shift", torch.tensor(0.1 * (k + 1)))

    def forward(self, x):
        z = self.feat(self.norm(x))
        return torch.tanh(self.tok(z.transpose(1, 2)).transpose(1, 2) + self.shift)


class HalfTransformer(TransformerStep):
    def forward(self, x):
        return 0.5 * super().forward(x)


class ScaledTransformer(TransformerStep):
    def __init__(self, d, k):
        super().__init__(d, 2, d_ff=2 * d)
        self.register_buffer("scale", torch.tensor(1.0 + 0.2 * k))

    def forward(self, x):
        return self.scale * super().forward(x)


def step_maker(kind: str, step: str, width: int = W):
    """``make_step(k)`` for a layer kind and step variant (float64 modules)."""
    if kind in ("dense", "multiseg"):
        table = {"shipped": lambda k: DenseStep(width, "tanh"), "user": lambda k: UserDense(width),
                 "buffer": lambda k: BufferDense(width, k),
                 "subclass": lambda k: HalfDense(width, "tanh"),
                 "subclass_buffer": lambda k: ScaledDense(width, k)}
    elif kind == "conv":
        table = {"shipped": lambda k: ConvStep(CH, 3, "tanh"), "user": lambda k: UserConv(CH),
                 "buffer": lambda k: BufferConv(CH, k),
                 "subclass": lambda k: HalfConv(CH, 3, "tanh"),
                 "subclass_buffer": lambda k: ScaledConv(CH, k)}
    elif kind == "transformer":
        table = {"shipped": lambda k: TransformerStep(DM, 2, d_ff=2 * DM),
                 "user": lambda k: TransformerStep(DM, 2, d_ff=2 * DM, causal=True),
                 "buffer": lambda k: BufferTokenMix(TOK, DM, k),
                 "subclass": lambda k: HalfTransformer(DM, 2, d_ff=2 * DM),
                 "subclass_buffer": lambda k: ScaledTransformer(DM, k)}
    else:
        raise ValueError(f"kind={kind!r} has no steps: use one of {KINDS[:4]}")
    make = table[step]
    return lambda k: make(k).double()


def pixels(spec: dict | None) -> int:
    """The conv kind's side length: 5 on a spatially coarsened vertex grid, else 4."""
    sp = (spec or {}).get("spatial") or {}
    return 5 if sp.get("grid") == "vertex" else HW


def input_shape(kind: str, spec: dict | None = None) -> tuple:
    """One sample's input shape for a network kind (``spec``: its pixels, see :func:`pixels`)."""
    hw = pixels(spec)
    return {"dense": (2,), "multiseg": (2,), "conv": (1, hw, hw), "transformer": (TOK, 2),
            "gru": (SEQ, 2)}[kind]


def options(spec: dict) -> MGRITOptions:
    return MGRITOptions(max_levels=spec["levels"], cfactor=2, tol=1e-13, max_iter=80,
                        norm=spec["norm"])


def _segment(spec, comm, kind, width, shape, seed, compiled):
    make = step_maker(kind, spec["step"], width)
    if compiled:
        plain = make
        make = lambda k: torch.compile(plain(k))  # noqa: E731  (how a user compiles steps)
    o = options(spec)
    sp = spec.get("spatial") if kind == "conv" else None
    return LayerParallelResNet.build(make, spec["layers"], shape, comm=comm, seed=seed, T=2.0,
                                     forward=o, backward=o,
                                     spatial=None if sp is None else SpatialCoarsening(**sp))


def build_net(spec: dict, comm: MPI.Comm, compiled: bool | None = None,
              seed: int | None = None) -> nn.Module:
    """The layer-parallel model of ``spec`` on ``comm`` (every rank of it calls this)."""
    compiled = spec.get("compiled", False) if compiled is None else compiled
    seed = spec["seed"] if seed is None else seed
    kind = spec["kind"]
    torch.manual_seed(seed)  # ordinary modules: the same on every rank (build keeps the RNG)
    if kind == "gru":
        o = options(spec)
        return ParallelGRU(2, W, comm=comm, forward=o, backward=o).double()
    seg = lambda k, width, shape: _segment(spec, comm, k, width, shape, seed + 1, compiled)  # noqa
    if kind == "dense":
        parts = (nn.Linear(2, W), seg("dense", W, (W,)), nn.Linear(W, 2))
    elif kind == "conv":
        hw = pixels(spec)
        parts = (nn.Conv2d(1, CH, 3, padding=1), seg("conv", CH, (CH, hw, hw)),
                 nn.Sequential(nn.Flatten(), nn.Linear(CH * hw * hw, 2)))
    elif kind == "transformer":
        parts = (nn.Linear(2, DM), seg("transformer", DM, (TOK, DM)),
                 nn.Sequential(nn.Flatten(), nn.Linear(TOK * DM, 2)))
    elif kind == "multiseg":
        second = _segment(spec, comm, "dense", W + 1, (W + 1,), seed + 2, compiled)
        parts = (nn.Linear(2, W), seg("dense", W, (W,)), nn.Tanh(), nn.Linear(W, W + 1), second,
                 nn.Linear(W + 1, 2))
    else:
        raise ValueError(f"kind={kind!r} is not allowed: use one of {KINDS}")
    return LayerParallelNet(*[p.double() for p in parts])


class GRUSerial(nn.Module):
    """``nn.GRUCell`` unrolled over the sequence: the serial twin of :class:`ParallelGRU`."""

    def __init__(self, gru: ParallelGRU):
        super().__init__()
        self.cell = nn.GRUCell(gru.input_size, gru.hidden_size).double()
        with torch.no_grad():
            for n, p in self.cell.named_parameters():
                p.copy_(getattr(gru, n))

    def forward(self, x):
        h = torch.zeros(x.shape[0], self.cell.hidden_size, dtype=x.dtype)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return h


class Twin:
    """The layer-parallel model ``lp`` and its serial twin ``ser`` (every rank holds the whole
    serial model). Global keys name parameters and step modules on both sides."""

    def __init__(self, spec: dict, comm: MPI.Comm, seed: int | None = None):
        self.spec, self.comm = spec, comm
        self.gru = spec["kind"] == "gru"
        self.lp = build_net(spec, comm, seed=seed)
        if self.gru:
            self.ser = GRUSerial(self.lp)
        else:
            plain = self.lp if not spec.get("compiled") else build_net(spec, comm, False, seed)
            self.ser = plain.to_serial()

    # -- where things live ------------------------------------------------------------------
    @property
    def holds_output(self) -> bool:
        return self.comm.rank == self.comm.size - 1 if self.gru else self.lp.is_last

    @property
    def holds_input(self) -> bool:
        return self.comm.rank == 0 if self.gru else self.lp.is_first

    def lp_params(self) -> dict:
        """This rank's parameters by global key."""
        if self.gru:
            return {f"cell.{n}": p for n, p in self.lp.named_parameters()}
        return dict(self.lp.named_global_parameters())

    def ser_params(self) -> dict:
        return dict(self.ser.named_parameters())

    def lp_modules(self) -> dict:
        """This rank's step and ordinary modules by global name (GRU: the model itself)."""
        if self.gru:
            return {"cell": self.lp}
        return dict(self.lp.named_global_modules())

    def ser_module(self, name: str) -> nn.Module:
        return self.ser.get_submodule(name)

    def step_names(self) -> list:
        """Global names of this rank's residual step modules (``"{i}.F"``)."""
        return [n for n in self.lp_modules() if n.endswith(".F")]

    def all_step_names(self) -> list:
        return [n for n, _ in self.ser.named_modules() if n.endswith(".F") and n.count(".") == 1]

    # -- calls ---------------------------------------------------------------------------------
    def lp_forward(self, x):
        return self.lp(x)

    def ser_forward(self, x):
        return self.ser(x)

    def lp_loss(self, out, w):
        if self.holds_output:
            return (out * w).sum() + 0.1 * (out ** 2).sum()
        return out.sum()  # the placeholder: every rank takes part in the backward

    @staticmethod
    def ser_loss(out, w):
        return (out * w).sum() + 0.1 * (out ** 2).sum()

    def lp_x_grad(self, x):
        """The input gradient as serial autograd has it, where this rank can tell (else None)."""
        if self.gru:  # each rank fills its own time rows: the sum over ranks is the whole
            g = torch.zeros_like(x) if x.grad is None else x.grad.clone()
            self.comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
            return None if x.grad is None else g
        return x.grad if self.holds_input else "skip"
