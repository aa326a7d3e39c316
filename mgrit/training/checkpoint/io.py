"""The checkpoint file: plain contents, atomic writes, loading that never runs code.

A checkpoint holds only tensors and plain containers (dict, list, tuple, str, int, float,
bool, None), so it loads with ``torch.load(weights_only=True)``: PyTorch's restricted
unpickler, which rejects every other object before it is built. A crafted file (a pickle
whose ``__reduce__`` runs a command) is reported as unsafe and nothing in it runs. RNG states
are stored as tensors and lists (:func:`rng_state`), options as dicts.

Writes are atomic: ``torch.save`` to ``PATH.tmp``, ``fsync``, ``os.replace`` onto ``PATH``,
``fsync`` of the directory; a failed write removes ``PATH.tmp`` and leaves ``PATH`` as it was,
and an interrupted one is a :class:`KeyboardInterrupt` saying so (not torch's ``unexpected pos``).

Integrity: the file carries a SHA-256 digest (key ``sha256``) of its contents (every tensor's
dtype, shape and bytes, every plain value, in a fixed order), verified on read, so flipped bytes
in a tensor (which torch's zip reader does not check) are an error naming the file instead of
silently wrong weights or optimizer state. Files written before the digest existed load unchecked.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import random
import re

import numpy as np
import torch

__all__ = ["FORMAT", "check_plain", "rng_state", "set_rng_state", "write_atomic", "read_file"]

FORMAT = "layerpar-checkpoint-2"
_SCALARS = (str, int, float, bool, type(None))


def check_plain(obj, where: str = "checkpoint") -> None:
    """Raise TypeError naming the first value of ``obj`` that is not a tensor or a plain
    container/scalar (such a value could not be loaded with ``weights_only=True``)."""
    if type(obj) in _SCALARS or torch.is_tensor(obj):  # exact types: np.float64 would
        return                                            # pickle as a numpy object
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; use str or int keys")
            check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(obj).__name__}: checkpoints hold only tensors, dicts, "
                    f"lists, tuples, str, int, float, bool and None (convert it, e.g. a "
                    f"dataclass with dataclasses.asdict)")


def rng_state() -> dict:
    """This process's torch (and CUDA), numpy and Python ``random`` states as tensors/lists."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    st = {"torch": torch.get_rng_state(),
          "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                    "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
          "python": {"version": int(version), "state": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = list(torch.cuda.get_rng_state_all())
    return st


def set_rng_state(st: dict) -> None:
    """Inverse of :func:`rng_state`."""
    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    p = st["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _fsync_dir(path: str) -> None:
    """Make the rename durable. Some file systems refuse to open or fsync a directory
    (``OSError``); the file itself is already synced then, so that case is accepted."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        return
    finally:
        os.close(fd)


def digest(obj) -> str:
    """SHA-256 (hex) of a checkpoint's plain contents: containers walked in a fixed order
    (dict entries sorted by key), tensors by dtype, shape and bytes, scalars by type and repr.
    Raises TypeError for other objects (see :func:`check_plain`)."""
    h = hashlib.sha256()

    def walk(o):
        if isinstance(o, torch.Tensor):
            t = o.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(o.shape)}".encode())
            if t.numel():
                h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            h.update(f"D{len(o)}".encode())
            for k in sorted(o, key=repr):
                walk(k)
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            h.update(f"{type(o).__name__[0]}{len(o)}".encode())
            for v in o:
                walk(v)
        elif isinstance(o, _SCALARS):
            h.update(f"S{type(o).__name__}:{o!r};".encode())
        else:
            raise TypeError(f"cannot digest {type(o).__name__}")
    walk(obj)
    return h.hexdigest()


def _dump(obj, fh) -> None:
    """Serialize ``obj`` into the open file (tests replace this to simulate slow writes)."""
    torch.save(obj, fh)


def write_atomic(path: str, obj) -> None:
    """Write ``obj`` to ``path`` atomically (see module doc). On any failure ``PATH.tmp`` is
    removed and the exception propagates; ``path`` is untouched. A Ctrl-C inside the write
    (whatever error torch's writer makes of it) is a :class:`KeyboardInterrupt` saying so."""
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        obj = {k: v for k, v in obj.items() if k != "sha256"}
        obj["sha256"] = digest(obj)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(tmp, "wb") as fh:
            _dump(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        if _interrupted(exc):  # e.g. torch's "unexpected pos" after a Ctrl-C inside its writer
            raise KeyboardInterrupt(f"the checkpoint write to {path} was interrupted (Ctrl-C); "
                                    f"{path} is unchanged (the previous checkpoint, if any, "
                                    f"is intact)") from exc
        raise
    _fsync_dir(os.path.dirname(path))


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling, a :class:`KeyboardInterrupt`."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__context__
    return False


def _reason(exc: BaseException) -> str:
    """The first sentence of torch's WeightsUnpickler error (e.g. ``Unsupported global:
    GLOBAL builtins.open was not an allowed global by default``)."""
    text = " ".join(str(exc).split())
    m = re.search(r"WeightsUnpickler error: (.*?)(\. |$)", text)
    return (m.group(1) if m else text)[:200]


def read_file(path: str) -> tuple:
    """``(checkpoint dict, None)`` or ``(None, (kind, message))`` with kind ``"missing"`` or
    ``"bad"``. Loads with ``weights_only=True``: nothing in the file is executed."""
    if not os.path.exists(path):
        return None, ("missing", f"checkpoint {path!r} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        return None, ("bad", f"checkpoint {path!r} was refused by torch's weights-only loader "
                             f"({_reason(exc)}): it is damaged, not a checkpoint, or holds "
                             f"objects other than tensors and plain containers (which could run "
                             f"code); nothing in it was loaded or run")
    except Exception as exc:  # noqa: BLE001 - any other failure of torch.load is a bad file
        return None, ("bad", f"checkpoint {path!r} is not readable ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:300]})")
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        got = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        return None, ("bad", f"checkpoint {path!r} is not a {FORMAT} file (found {got!r})")
    want = ckpt.pop("sha256", None)
    if want is not None:
        try:
            got = digest(ckpt)
        except TypeError as exc:
            got = f"undigestable ({exc})"
        if got != want:
            return None, ("bad", f"checkpoint {path!r} is corrupted: the SHA-256 digest of its "
                                 f"contents does not match the one written with it (bytes changed "
                                 f"after it was saved); use another checkpoint or start without "
                                 f"--resume")
    return ckpt, None
