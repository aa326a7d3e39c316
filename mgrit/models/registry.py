"""The registry of the networks the main job builds from its flags: one table, :data:`MODELS`.

Adding a model is one builder function (in a module of :mod:`mgrit.models`) and one entry in
:data:`MODELS`::

    def build_mymodel(cfg, in_shape, num_classes, comm=None, form="network"):
        ...

A builder reads the attributes it needs from ``cfg`` (the main job's
:class:`~layerpar.jobconfig.JobConfig`, or any object with those attributes), seeds
every weight from ``cfg.seed`` independently of the rank count, and returns for

* ``form="network"``: a :class:`~mgrit.nn.LayerParallelNet` on the layer communicator
  ``comm``, or the equivalent serial ``nn.Module`` (same initial weights) when ``comm`` is None;
* ``form="layers"``: a list of blocks for layer-wise training (``layerwise``), or
  ``ValueError`` if the model has no such form.

Builders raise ``ValueError`` (naming the flag) for configurations that do not fit the data.
"""
from __future__ import annotations

from typing import Callable

from mpi4py import MPI

from .cifar import build_cifar_resnet
from .recurrent import build_gru
from .resnet import build_resnet
from .transformer import build_gpt, build_staged_resnet, build_vit

__all__ = ["MODELS", "FORMS", "LANGUAGE_MODELS", "build_model"]

#: name (``--model``) -> builder ``(cfg, in_shape, num_classes, comm=None, form="network")``.
MODELS: dict[str, Callable] = {
    "resnet": build_resnet,                # mgrit.models.resnet
    "staged-resnet": build_staged_resnet,  # mgrit.models.transformer
    "vit": build_vit,                      # mgrit.models.transformer
    "gpt": build_gpt,                      # mgrit.models.transformer (a language model)
    "gru": build_gru,                      # mgrit.models.recurrent
    "cifar-resnet": build_cifar_resnet,    # mgrit.models.cifar
}
#: The forms a builder returns (module doc).
FORMS = ("network", "layers")
#: The models of :data:`MODELS` trained on a text corpus (``data.text.TEXT_CORPORA``) with a
#: next-token loss.
LANGUAGE_MODELS = ("gpt",)


def build_model(name: str, cfg, in_shape, num_classes: int, comm: MPI.Comm | None = None,
                form: str = "network"):
    """Build model ``name`` (see module doc). Raises ValueError for an unknown name or form."""
    if name not in MODELS:
        raise ValueError(f"model {name!r} is unknown: use one of {sorted(MODELS)}")
    if form not in FORMS:
        raise ValueError(f"form={form!r} is not allowed: use one of {list(FORMS)}")
    return MODELS[name](cfg, tuple(in_shape), int(num_classes), comm=comm, form=form)
