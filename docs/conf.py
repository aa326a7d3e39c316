"""Sphinx configuration: ``python -m sphinx -W -b html docs docs/_build/html`` (or
``make -C docs html``) builds the site from these pages and the docstrings."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # the packages of this checkout, not an installed copy

from mgrit._version import __version__ as release  # noqa: E402  (the one version source)

project = "layerpar"
version = release
author = "layerpar authors"
copyright = "layerpar authors (MIT License)"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax",
              "sphinx.ext.viewcode"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields: no second description of dataclass fields
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autodoc_mock_imports = []
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"description": "Layer-parallel training with MGRIT, in pure Python",
                      "fixed_sidebar": True}
templates_path = []
html_static_path = []
