"""The layerpar version: the single source read by ``setup.cfg`` (``version = attr:``) and
exported as ``mgrit.__version__`` and ``layerwise.__version__`` (``data.__version__`` reads the
installed metadata, so that ``data`` imports nothing from ``mgrit``)."""

__version__ = "0.2.0"
