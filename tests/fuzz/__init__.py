"""Differential fuzzer (issue 22): placeholder docstring, rewritten below."""
from .program import KNOWN_BROKEN_ON_MAIN  # noqa: F401
