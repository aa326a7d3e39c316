"""The model zoo of the main job: the networks ``--model`` names, built layer-parallel or serial
from the same seeds, and the task pieces that belong to them.

One table, :data:`MODELS` in :mod:`~mgrit.models.registry` (no registration by import), maps a
name to its builder; :func:`build_model` calls it. Modules: ``registry`` (``MODELS``,
``build_model``, ``LANGUAGE_MODELS``), ``options`` (:func:`mgrit_options`, the MGRIT options of
every builder), ``resnet`` (``--model resnet``), ``transformer`` (``staged-resnet``, ``vit``,
``gpt``) + ``transformer_parts`` (embeddings, heads), ``cifar`` (``cifar-resnet``, He et al.
2016), ``recurrent`` (``gru``, Moon & Cyr 2022, and ``--dataset adding``), ``lm`` (the language
model's next-token loss, token accuracy, sampling and report callback).

Floor L4: imports the solver core, :mod:`mgrit.nn`, :mod:`mgrit.training` (``lm`` uses its
``SerialNet`` and records) and :mod:`data`; imported by the main job (:mod:`layerpar`),
experiments and tests, never by :mod:`mgrit.training` or lower.
"""
from .options import mgrit_options
from .registry import FORMS, LANGUAGE_MODELS, MODELS, build_model

__all__ = ["MODELS", "FORMS", "LANGUAGE_MODELS", "build_model", "mgrit_options"]
