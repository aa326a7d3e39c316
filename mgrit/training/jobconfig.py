"""The main job's settings: :class:`JobConfig` (one field per flag of ``experiments/train.py``,
the defaults live here) and its validation, which needs no communication and gives the same
verdict on every rank."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from data import available_datasets

from ..options import relaxation_sweeps

__all__ = ["JobConfig", "METHODS", "BUNDLED"]

METHODS = ("serial", "mgrit", "sequential", "decoupled")
BUNDLED = ("mnist5k", "digits", "peaks")
_POSITIVE = ("layers", "width", "channels", "kernel", "levels", "fwd_iters", "bwd_iters",
             "epochs", "batch_size", "eval_batch_size")
_NON_NEGATIVE = ("limit_train", "limit_test", "seed", "threads", "dp", "stages",
                 "checkpoint_every")


@dataclass
class JobConfig:
    """Settings of one run of the main job (see ``experiments/train.py --help`` for each).
    :meth:`validated` checks them for a world of ``world`` ranks and fills in ``dp``,
    ``stages`` and ``method`` (``serial=True`` means ``method="serial"``)."""

    dataset: str = "mnist5k"
    data_root: str | None = None
    test_fraction: float = 0.2
    limit_train: int = 0
    limit_test: int = 0
    model: str = "resnet"
    step: str = "dense"
    layers: int = 32
    width: int = 32
    channels: int = 4
    kernel: int = 3
    T: float = 1.0
    activation: str = "tanh"
    levels: int = 3
    cfactor: int = 4
    fwd_iters: int = 2
    bwd_iters: int = 1
    relax: str = "F,FCF"
    tol: float = 0.0
    warm_start: bool | None = None
    warm_start_adjoint: bool = False
    adjoint: str = "mgrit"
    skip_first_relaxation: bool = False
    method: str = "mgrit"
    serial: bool = False
    epochs: int = 2
    batch_size: int = 50
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    seed: int = 0
    dtype: str = "float32"
    eval_batch_size: int = 500
    stages: int = 0
    dp: int = 0
    threads: int = 0
    guard: str = "warn"
    checkpoint_every: int = 0
    resume: str | None = None
    out: str | None = None
    no_progress: bool = False
    debug: bool = False

    def to_dict(self) -> dict:
        """The settings as a plain dict (for ``config.json`` and ``metrics.h5``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "serial"}

    def validated(self, world: int) -> "JobConfig":
        """A checked copy with ``method``, ``dp`` and ``stages`` resolved.

        Raises:
            ValueError: the first setting that is not allowed, named as its flag with the
                allowed values (the same on every rank; no communication).
        """
        c = dataclasses.replace(self)
        if c.serial:
            if c.method not in ("mgrit", "serial"):
                raise ValueError(f"--serial conflicts with --method {c.method}")
            c.method, c.serial = "serial", False
        if c.method not in METHODS:
            raise ValueError(f"--method={c.method!r} is not allowed: use one of {list(METHODS)}")
        for name in _POSITIVE:
            if getattr(c, name) < 1:
                raise ValueError(f"{_flag(name)}={getattr(c, name)} is not allowed: use an int >= 1")
        for name in _NON_NEGATIVE:
            if getattr(c, name) < 0:
                raise ValueError(f"{_flag(name)}={getattr(c, name)} is not allowed: use an int >= 0")
        if c.cfactor < 2:
            raise ValueError(f"--cfactor={c.cfactor} is not allowed: use an int >= 2")
        if c.kernel % 2 == 0:
            raise ValueError(f"--kernel={c.kernel} is not allowed: use an odd int")
        if (c.checkpoint_every or c.resume) and c.method not in ("mgrit", "serial"):
            raise ValueError(f"--checkpoint-every/--resume are supported with --method mgrit "
                             f"and serial, got --method {c.method}")
        if c.resume and not os.path.isfile(c.resume):
            raise ValueError(f"--resume={c.resume!r}: no such checkpoint file")
        for name in ("T", "lr"):
            v = getattr(c, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"--{name}={v} is not allowed: use a finite number > 0")
        if not (math.isfinite(c.tol) and c.tol >= 0):
            raise ValueError(f"--tol={c.tol} is not allowed: use 0 (inexact) or a number > 0")
        if not (math.isfinite(c.momentum) and 0 <= c.momentum < 1):
            raise ValueError(f"--momentum={c.momentum} is not allowed: use a number in [0, 1)")
        if not 0 < c.test_fraction < 1:
            raise ValueError(f"--test-fraction={c.test_fraction} is not allowed: use a number "
                             f"in (0, 1)")
        for r in c.relax.split(","):
            try:
                relaxation_sweeps(r.strip())
            except ValueError as e:
                raise ValueError(f"--relax={c.relax!r}: {e}") from None
        self._check_layout(c, world)
        self._check_dataset(c)
        return c

    @staticmethod
    def _check_layout(c: "JobConfig", world: int) -> None:
        if c.dp == 0:
            c.dp = world if c.method in ("serial", "sequential") else 1
        if world % c.dp:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(f"--dp={c.dp} does not divide the world size {world}: use one of "
                             f"{divisors}")
        P_L = world // c.dp
        if c.method in ("serial", "sequential") and P_L != 1:
            raise ValueError(f"--method {c.method} has no layer parallelism: use --dp {world} "
                             f"(= world size; replicas only), got --dp {c.dp}")
        if c.method == "mgrit" and c.layers < P_L:
            raise ValueError(f"--layers={c.layers} is smaller than the {P_L} layer ranks (world "
                             f"{world} / dp {c.dp}): use --layers >= {P_L} or fewer ranks")
        if c.method == "decoupled":
            K = c.stages or P_L
            if K % P_L:
                raise ValueError(f"--stages={K} is not a multiple of the {P_L} layer ranks "
                                 f"(world {world} / dp {c.dp})")
            if K > c.layers + 1:
                raise ValueError(f"--stages={K} exceeds the {c.layers + 1} layers (opening + "
                                 f"{c.layers} steps)")
            c.stages = K
        if c.batch_size < c.dp and c.method in ("sequential", "decoupled"):
            raise ValueError(f"--batch-size={c.batch_size} is smaller than --dp={c.dp}: "
                             f"layer-wise training needs a sample of every batch per replica")

    @staticmethod
    def _check_dataset(c: "JobConfig") -> None:
        if c.dataset in BUNDLED or c.dataset == "hdf5":
            return
        names = available_datasets()
        if c.dataset not in names:
            raise ValueError(f"--dataset={c.dataset!r} is unknown: use one of "
                             f"{sorted(set(names) | {'hdf5'})}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
