"""The top-level package ``data`` must be layerpar's, not a user's ``data.py`` that shadows it.

layerpar keeps its data sets in a top-level package named ``data`` (layout kept for users'
scripts). Python imports the first ``data`` on ``sys.path``, and a script's own folder (or the
working folder for ``python -c`` / ``python -m``) comes first: a ``data.py`` or ``data/``
package there would be imported instead and fail later in a confusing way (``'data' is not a
package``). :func:`require_data_package` runs when :mod:`mgrit.training` is imported and turns
that into one line naming the file that shadows ours and what to do.
"""
from __future__ import annotations

import importlib

__all__ = ["require_data_package"]


def require_data_package() -> None:
    """Import ``data`` and check it is layerpar's (the marker ``data.__layerpar_data__``).

    Raises:
        ImportError: one line naming the file or folder that shadows layerpar's ``data``
            package and how to fix it (rename it, or run from another folder).
    """
    mod = importlib.import_module("data")
    if getattr(mod, "__layerpar_data__", False) is True:
        return
    where = getattr(mod, "__file__", None) or ", ".join(getattr(mod, "__path__", [])) or repr(mod)
    raise ImportError(f"{where} shadows layerpar's 'data' package (imported instead of it); rename "
                      f"that file/folder or run from another folder")
