"""Character-level text corpora for language models, offline: :func:`load_text` and friends.

Corpus (the only one; :data:`TEXT_CORPORA`):

``pydoc-topics``
    The Python Language Reference and library documentation topics that CPython ships inside
    itself for ``help()``: the module ``pydoc_data.topics`` of the standard library, a dict
    ``topics`` of about 80 entries (``"assert"``, ``"atom-identifiers"``, ``"bltin-code-objects"``,
    ...) of English prose with code examples, generated from the reStructuredText sources of
    the CPython documentation by its ``pydoc-topics`` Sphinx builder (``make pydoc-topics`` in
    CPython's ``Doc/``).
    Licence: the Python documentation is under the PSF License Agreement (Python Software
    Foundation License Version 2; https://docs.python.org/3/license.html), shipped with every
    CPython installation, so it is available on a fresh machine without a download. Its size
    depends on the Python version (465,126 characters, 103 distinct, in CPython 3.11.7; other
    versions differ): :attr:`TextInfo.sha256` identifies the exact text of a run.
    The corpus is the entries joined in sorted key order, separated by one blank line
    (``"\\n\\n"``).

Samples. The vocabulary is the sorted set of the corpus' characters (train and validation
text; :func:`vocabulary`), each character an ``int64`` id. The split is contiguous and seeded:
the validation text is one contiguous span of ``round(test_fraction * n)`` characters starting
at ``numpy.random.default_rng(seed).integers(0, n - n_val + 1)``; the training text is what
precedes it and what follows it (two pieces). Each piece is cut into non-overlapping windows of
``context + 1`` characters with stride ``context`` (no window crosses the seam or the
validation span): ``x = window[:-1]``, ``y = window[1:]`` (the next character at every
position). Leftover characters at the end of a piece (fewer than ``context + 1``) are dropped.

The splits are :class:`data.Split` objects with ``x`` and ``y`` ``int64`` ``(n, context)``,
``num_classes`` = vocabulary size and ``class_names`` = the characters (so
``"".join(split.class_names[i] for i in ids)`` decodes). No torch or mpi4py is imported.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

import numpy as np

from .split import Split

try:  # standard library, but some distributions strip it: then corpus_text() says so
    from pydoc_data.topics import topics as _PYDOC_TOPICS
except ImportError as _exc:  # kept for the message of corpus_text()
    _PYDOC_TOPICS, _PYDOC_ERROR = None, f"{type(_exc).__name__}: {_exc}"

__all__ = ["TEXT_CORPORA", "TextInfo", "corpus_text", "vocabulary", "encode", "decode",
           "split_text", "load_text"]

#: Names :func:`load_text` accepts.
TEXT_CORPORA = ("pydoc-topics",)


@dataclass(frozen=True)
class TextInfo:
    """Where a corpus' text comes from: ``name``, ``source`` (module and Python version),
    ``licence``, ``chars`` (length), ``sha256`` (hex digest of the UTF-8 text)."""

    name: str
    source: str
    licence: str
    chars: int
    sha256: str


def _check_name(name: str) -> str:
    if name not in TEXT_CORPORA:
        raise ValueError(f"text corpus {name!r} is unknown: use one of {list(TEXT_CORPORA)}")
    return name


def corpus_text(name: str = "pydoc-topics") -> tuple[str, TextInfo]:
    """The whole text of corpus ``name`` and its :class:`TextInfo`.

    Raises:
        ValueError: unknown name. FileNotFoundError: this Python ships no ``pydoc_data``
            (some distributions strip it: install the full standard library, e.g. Debian's
            ``libpython3-stdlib``/``python3-doc``, or use a python.org / pyenv build).
    """
    _check_name(name)
    topics = _PYDOC_TOPICS
    if topics is None:
        raise FileNotFoundError(
            f"text corpus {name!r} needs the standard-library module pydoc_data.topics, which "
            f"this Python ({sys.executable}) does not ship: use a full CPython installation "
            f"({_PYDOC_ERROR})")
    text = "\n\n".join(topics[k] for k in sorted(topics))
    version = ".".join(map(str, sys.version_info[:3]))
    info = TextInfo(name=name,
                    source=f"pydoc_data.topics of CPython {version} (the documentation topics "
                           f"of help(); {len(topics)} entries)",
                    licence="PSF License Agreement (Python documentation)",
                    chars=len(text), sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())
    return text, info


def vocabulary(text: str) -> list:
    """The sorted distinct characters of ``text`` (id ``i`` is ``vocabulary(text)[i]``)."""
    return sorted(set(text))


def encode(text: str, vocab: list) -> np.ndarray:
    """``int64`` ids of ``text``'s characters in ``vocab``.

    Raises:
        ValueError: a character that is not in ``vocab`` (named with its position).
    """
    index = {ch: i for i, ch in enumerate(vocab)}
    try:
        return np.fromiter((index[ch] for ch in text), dtype=np.int64, count=len(text))
    except KeyError as exc:
        pos = next(i for i, ch in enumerate(text) if ch not in index)
        raise ValueError(f"character {exc.args[0]!r} at position {pos} is not in the "
                         f"vocabulary of {len(vocab)} characters") from None


def decode(ids, vocab: list) -> str:
    """The characters of ``ids`` (any integer sequence or array)."""
    return "".join(vocab[int(i)] for i in np.asarray(ids).reshape(-1))


def _windows(ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of ``context + 1`` ids with stride ``context``."""
    n = (len(ids) - 1) // context if len(ids) > context else 0
    if n == 0:
        return np.zeros((0, context), np.int64), np.zeros((0, context), np.int64)
    idx = np.arange(n)[:, None] * context + np.arange(context + 1)[None, :]
    w = ids[idx]
    return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])


def split_text(n: int, test_fraction: float, seed: int) -> tuple[int, int]:
    """``(start, stop)`` of the contiguous validation span of a text of ``n`` characters (see
    the module doc).

    Raises:
        ValueError: ``test_fraction`` outside (0, 1), a negative or non-int ``seed``.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction={test_fraction} is not allowed: use a number in (0, 1)")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} is not allowed: use an int >= 0")
    n_val = int(round(test_fraction * n))
    start = int(np.random.default_rng(int(seed)).integers(0, n - n_val + 1))
    return start, start + n_val


def load_text(name: str = "pydoc-topics", context: int = 64, seed: int = 0,
              test_fraction: float = 0.1) -> tuple[Split, Split]:
    """Train and validation windows of corpus ``name`` (see the module doc).

    Args:
        name: one of :data:`TEXT_CORPORA`.
        context: characters per sample (int >= 1; the model's sequence length).
        seed: position of the validation span (int >= 0).
        test_fraction: validation share of the characters, in (0, 1).

    Returns:
        ``(train, test)`` :class:`data.Split` s: ``x``, ``y`` ``int64`` ``(n, context)`` with
        ``y[i, t]`` the character after ``x[i, t]``; ``num_classes`` the vocabulary size;
        ``class_names`` the vocabulary; ``source`` names the corpus, Python version, licence
        and SHA-256 of the text.

    Raises:
        ValueError: bad arguments, or a split with no complete window (a ``context`` too long
            for the corpus or the validation share). FileNotFoundError: see :func:`corpus_text`.
    """
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 1:
        raise ValueError(f"context={context!r} is not allowed: use an int >= 1")
    text, info = corpus_text(name)
    vocab = vocabulary(text)
    ids = encode(text, vocab)
    a, b = split_text(len(ids), test_fraction, seed)
    pieces = [_windows(ids[:a], context), _windows(ids[b:], context)]
    xtr = np.concatenate([p[0] for p in pieces])
    ytr = np.concatenate([p[1] for p in pieces])
    xte, yte = _windows(ids[a:b], context)
    for what, x, chars in (("training", xtr, len(ids) - (b - a)), ("validation", xte, b - a)):
        if len(x) == 0:
            raise ValueError(f"the {what} text of {name!r} ({chars} characters) holds no window "
                             f"of context + 1 = {context + 1} characters: use a shorter "
                             f"--context or another --test-fraction")
    source = (f"{info.source}; licence: {info.licence}; {info.chars} characters, sha256 "
              f"{info.sha256[:16]}; validation characters {a}..{b - 1}")
    common = dict(num_classes=len(vocab), class_names=list(vocab), name=name, source=source)
    return (Split(x=xtr, y=ytr, split="train", **common),
            Split(x=xte, y=yte, split="test", **common))
