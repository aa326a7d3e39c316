"""The main job's settings: :class:`JobConfig` (one field per flag of ``experiments/train.py``,
the defaults live here), reading a run's ``config.json`` (:func:`read_config`,
:func:`run_facts`); the allowed values and the validation are :mod:`layerpar.validation`
(re-exported here)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from .validation import (BIAS_ACTIONS, BUNDLED, DEVICES, LANGUAGE_MODELS, METHODS,  # noqa: F401
                         OPTIMIZER_NAMES, SEQUENCE_TASKS, validate)

__all__ = ["JobConfig", "read_config", "run_facts", "METHODS", "BUNDLED", "LANGUAGE_MODELS",
           "SEQUENCE_TASKS", "BIAS_ACTIONS", "DEVICES", "OPTIMIZER_NAMES"]


@dataclass
class JobConfig:
    """Settings of one run of the main job (see ``experiments/train.py --help`` for each).
    :meth:`validated` checks them for a world of ``world`` ranks and fills in ``dp``,
    ``stages`` and ``method`` (``serial=True`` means ``method="serial"``)."""

    dataset: str = "mnist5k"
    data_root: str | None = None
    test_fraction: float = 0.2
    val_fraction: float = 0.0
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
    d_model: int = 32
    heads: int = 4
    d_ff: int = 0
    patch: int = 7
    context: int = 64
    buffer_layers: int = 1
    dropout: float = 0.0
    drop_path: float = 0.0
    hidden: int = 32
    seq_len: int = 1024
    gru_coarse: str = "power"
    gru_eval_rtol: float = 1e-5
    multilevel_init: int = 0
    init_epochs: str = "2"
    prolong: str = "constant"
    levels: int = 3
    cfactor: int = 4
    fwd_iters: int = 2
    bwd_iters: int = 1
    relax: str = "F,FCF"
    tol: float = 0.0
    warm_start: bool | None = None
    warm_start_adjoint: bool = False
    nested_iteration: bool = False
    adjoint: str = "mgrit"
    skip_first_relaxation: bool = False
    spatial_coarsening: str = ""
    spatial_restrict: str | None = None
    spatial_prolong: str | None = None
    method: str = "mgrit"
    serial: bool = False
    epochs: int = 2
    batch_size: int = 50
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_schedule: str = "none"
    warmup_epochs: int = 0
    lr_step_epochs: int = 1
    lr_gamma: float = 0.1
    device: str = "cpu"
    tied: bool = False
    clip_grad_norm: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    eval_batch_size: int = 500
    stages: int = 0
    dp: int = 0
    threads: int = 0
    guard: str = "warn"
    bias_monitor: str = "off"
    bias_every: int = 50
    bias_ratio: float = 0.5
    bias_window: int = 2
    checkpoint_every: int = 0
    resume: str | None = None
    out: str | None = None
    overwrite: bool = False
    tensorboard: bool = False
    no_progress: bool = False
    debug: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "JobConfig":
        """The settings of a run's ``config.json`` (or ``summary.json``'s ``config``) as a
        config: keys that are settings become fields; the facts the job adds beside them
        (``argv``, ``world_size``, ``P_L``, ``input_shape``, ``num_classes``, ...) are
        ignored (:func:`run_facts` keeps them). Not validated: call :meth:`validated`.

        Raises:
            TypeError: ``d`` is not a dict.
        """
        if not isinstance(d, dict):
            raise TypeError(f"a run config must be a dict (config.json), got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, path) -> "JobConfig":
        """:meth:`from_dict` of the JSON file ``path`` (a run folder's ``config.json``; a
        run folder is read as its ``config.json``). Reading runs no code from the file.

        Raises:
            FileNotFoundError: no such file. ValueError: not JSON, or not a JSON object.
        """
        return cls.from_dict(read_config(path))

    def to_dict(self) -> dict:
        """The settings as a plain dict (for ``config.json`` and ``metrics.h5``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "serial"}

    def validated(self, world: int) -> "JobConfig":
        """A checked copy with ``method``, ``dp`` and ``stages`` resolved
        (:func:`layerpar.validation.validate`).

        Raises:
            ValueError: the first setting that is not allowed, named as its flag with the
                allowed values (the same on every rank; no communication).
        """
        c = dataclasses.replace(self)
        validate(c, world)
        return c


def read_config(path) -> dict:
    """The JSON object of ``path`` (``RUN/config.json``, or a run folder): plain JSON only.

    Raises:
        FileNotFoundError: no such file. ValueError: not JSON, or not a JSON object.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such run config (a run folder holds config.json)")
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a JSON run config: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} is not a JSON object (a run config): {type(d).__name__}")
    return d


def run_facts(d: dict) -> dict:
    """The entries of a run config ``d`` that are not :class:`JobConfig` settings (``argv``,
    ``world_size``, ``input_shape``, ``num_classes``, ...)."""
    names = {f.name for f in dataclasses.fields(JobConfig)}
    return {k: v for k, v in d.items() if k not in names}
