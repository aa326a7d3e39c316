"""The torch versions layerpar is tested with, checked when ``mgrit`` is imported.

The fast paths' fingerprint (:mod:`mgrit.nn.chains.contract`) relies on internals of
``torch.nn.Module`` that PyTorch does not promise to keep (``docs/torch_internals.rst``), so an
untested torch is refused: ``ImportError`` naming the installed and the tested versions. Set
``LAYERPAR_ALLOW_UNTESTED_TORCH=1`` to import anyway (a ``RuntimeWarning``; run
``python -m pytest tests/nn/test_torch_internals.py`` first). Reads the installed metadata only:
importing ``mgrit`` still does not import torch. Keep :data:`TESTED` and ``setup.cfg``'s
``torch>=...,<...`` the same (``tests/house/test_package_meta.py`` compares them).
"""
from __future__ import annotations

import os
import re
import warnings
from importlib import metadata

__all__ = ["TESTED", "ALLOW_ENV", "check", "tested"]

#: [lowest, first untested) as (major, minor): the versions the suite has passed with
TESTED = ((2, 13), (2, 14))
ALLOW_ENV = "LAYERPAR_ALLOW_UNTESTED_TORCH"


def _major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def tested(version: str) -> bool:
    """Whether torch ``version`` (e.g. ``"2.13.0+cpu"``) is in :data:`TESTED`."""
    mm = _major_minor(version)
    return mm is not None and TESTED[0] <= mm < TESTED[1]


def check(version: str | None = None) -> None:
    """Raise ``ImportError`` when the installed torch (or ``version``) is not a tested one,
    unless :data:`ALLOW_ENV` is ``1`` (then a ``RuntimeWarning``). No torch installed: nothing
    (importing torch fails later with its own message)."""
    if version is None:
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return
    if tested(version):
        return
    lo, hi = (f"{a}.{b}" for a, b in TESTED)
    msg = (f"layerpar is tested with torch>={lo},<{hi}; torch {version} is installed. Its fast "
           f"paths rely on torch.nn.Module internals (docs/torch_internals.rst) that another "
           f"version may change, which could give wrong gradients silently. Install "
           f"torch=={lo}.* (README: pip install torch=={lo}.0 -e '.[mpich,dev]'), or set "
           f"{ALLOW_ENV}=1 to import anyway after python -m pytest "
           f"tests/nn/test_torch_internals.py passes")
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return
    raise ImportError(msg)
