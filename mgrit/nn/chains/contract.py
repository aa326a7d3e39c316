"""The eligibility contracts of ``mgrit.nn``'s fast paths and the fingerprint checked on every
forward (the rationale: ``docs/fast_paths.rst``; the torch internals it relies on:
``docs/torch_internals.rst``).

* Native kernels (``forward_batched``, ``vjp_batched``, ...) run only for a module whose class
  defines them at or below the class that defines ``forward`` (:func:`kernel`), with no
  instance ``forward`` and no overridden ``__call__``; :func:`kernel_obstacle` says why not.
* Batched evaluation and the stacked snapshot: layers differ only in parameter and buffer
  values, one dtype and device per name, no module hooks.
* MGRIT: a step's forward is a pure function of its input and tensors; module hooks (on a
  step or global, :func:`global_hooks_registered`) or ``torch.autocast``
  (:func:`autocast_enabled`) make the forward run the serial pipeline instead.

:class:`Fingerprint` records, for a rank's step modules, the identity and count of every entry
of their ``_parameters`` / ``_buffers`` / ``_modules``, whether any hook is registered, the
``training`` pattern where it matters, in O(1) per call; when :meth:`Fingerprint.same` is
False the fast paths are rebuilt or the general path is taken. Not covered: plain Python
attributes assigned after build and ``__class__`` assignment (call ``refresh_structure()``).
"""
from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

__all__ = ["kernel", "kernel_obstacle", "Fingerprint", "autocast_enabled",
           "global_hooks_registered", "hooks_suspended", "quiet"]

#: per-module hook dicts that change what calling a module does (torch's own names)
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_TRAINING = operator.itemgetter("training")
_KERNEL_OK: dict = {}  # (class, name) -> bool
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def global_hooks_registered() -> bool:
    """True when module hooks are registered for every module (``register_module_forward_hook``
    and friends)."""
    return any(getattr(_torch_module, name, None) for name in _GLOBAL_HOOKS)


@contextlib.contextmanager
def hooks_suspended(root: nn.Module):
    """Inside, no module hook fires: neither those on ``root``'s modules nor global module
    hooks (the hook dicts are swapped for empty ones and put back on exit, also on an error).

    For the layer recomputations of an MGRIT backward. Serial autograd never calls a layer in a
    backward, so a hook registered between a forward and its backward (the forward ran MGRIT
    because no hook was registered then; with hooks it runs the serial pipeline) must not fire
    there. Cost: one pass over ``root``'s modules; used only when :meth:`Fingerprint.hooked`.
    """
    saved = []
    for m in root.modules():
        for name in MODULE_HOOKS:
            d = m.__dict__.get(name)
            if d:
                saved.append((m.__dict__, name, d))
                m.__dict__[name] = OrderedDict()
    glob = [(name, getattr(_torch_module, name)) for name in _GLOBAL_HOOKS
            if getattr(_torch_module, name, None)]
    for name, _ in glob:
        setattr(_torch_module, name, OrderedDict())
    try:
        yield
    finally:
        for space, name, d in saved:
            space[name] = d
        for name, d in glob:
            setattr(_torch_module, name, d)


def _definer(cls: type, name: str):
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _kernel_ok(cls: type, name: str) -> bool:
    owner = _definer(cls, name)
    if owner is None:
        return False
    fwd = _definer(cls, "forward")
    call = _definer(cls, "__call__")
    return (fwd is not None and issubclass(owner, fwd) and call is nn.Module
            and _definer(cls, "_call_impl") is nn.Module)


def kernel(module: nn.Module, name: str):
    """``module``'s fast-path method ``name`` (bound), or ``None`` where the contract forbids
    it: the class defining ``name`` must be the class defining ``forward`` or a subclass of it
    (never a kernel inherited from a class whose ``forward`` is not the one called), neither
    ``__call__`` nor ``forward`` overridden on the class or the instance, and
    ``module.kernel_obstacle()`` (when defined) ``None``. Cached per class; O(1)."""
    cls = type(module)
    ok = _KERNEL_OK.get((cls, name))
    if ok is None:
        ok = _KERNEL_OK[(cls, name)] = _kernel_ok(cls, name)
    if not ok or "forward" in vars(module):
        return None
    check = getattr(module, "kernel_obstacle", None)
    if check is not None and check() is not None:
        return None
    return getattr(module, name)


def kernel_obstacle(module: nn.Module, name: str = "forward_batched") -> str | None:
    """Why ``module``'s ``name`` kernel may not run (a message), ``None`` when it may or when
    the class has none (then the general path runs anyway)."""
    if not hasattr(type(module), name):
        return None
    if kernel(module, name) is not None:
        return None
    check = getattr(module, "kernel_obstacle", None)
    reason = check() if check is not None else None
    return reason or (f"{type(module).__name__}.{name} is inherited from a class whose forward "
                      f"is not {type(module).__name__}.forward")


def autocast_enabled(device: torch.device) -> bool:
    """Whether ``torch.autocast`` is active for ``device``'s type (and, for CUDA states, CPU)."""
    return torch.is_autocast_enabled(device.type) or (
        device.type != "cpu" and torch.is_autocast_enabled("cpu"))


class _Watched(dict):
    """A module's ``_parameters`` / ``_buffers`` / ``_modules`` dict that counts its changes in
    :data:`_EPOCH` (reads are the plain ``dict``'s; only writes run Python)."""

    __slots__ = ()

    def __setitem__(self, key, value):
        _bump()
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        _bump()
        dict.__delitem__(self, key)

    def _changed(name):  # noqa: N805 - wraps dict's other mutating methods
        method = getattr(dict, name)

        def changed(self, *args, **kwargs):
            _bump()
            return method(self, *args, **kwargs)
        changed.__name__ = name
        return changed

    pop = _changed("pop")
    popitem = _changed("popitem")
    clear = _changed("clear")
    update = _changed("update")
    setdefault = _changed("setdefault")
    __ior__ = _changed("__ior__")
    del _changed

    def __reduce_ex__(self, protocol):  # copies and pickles are plain dicts
        return dict, (dict(self),)


class _WatchedHooks(OrderedDict):
    """A module's hook dict (``_forward_hooks`` ...) that counts its changes in :data:`_EPOCH`
    (registration writes, ``handle.remove()`` deletes)."""

    def __setitem__(self, key, value):
        _bump()
        OrderedDict.__setitem__(self, key, value)

    def __delitem__(self, key):
        _bump()
        OrderedDict.__delitem__(self, key)

    def pop(self, *args):
        _bump()
        return OrderedDict.pop(self, *args)

    def clear(self):
        _bump()
        OrderedDict.clear(self)

    def __reduce_ex__(self, protocol):
        return OrderedDict, (list(self.items()),)


#: changes of any watched dict (every Fingerprint's modules); a Fingerprint rescans its
#: modules only when this moved since its last look. ``_QUIET``: > 0 while this package swaps
#: tensors in and out on purpose (``functional_call`` of the batched path): not a change.
_EPOCH = [0]
_QUIET = [0]


def _bump():
    if not _QUIET[0]:
        _EPOCH[0] += 1


class quiet:
    """Context: dict writes inside are this package's own temporary swaps (``functional_call``
    restores every tensor it replaces), not changes of the modules."""

    def __enter__(self):
        _QUIET[0] += 1

    def __exit__(self, *exc):
        _QUIET[0] -= 1


def _watch(m: nn.Module) -> None:
    """Give ``m`` watched dicts (the same contents); a hook dict that is not empty stays as it
    is (handles of hooks registered before hold it), and is then scanned on every call."""
    d = m.__dict__
    for name in ("_parameters", "_buffers", "_modules"):
        if type(d.get(name)) is dict:
            d[name] = _Watched(d[name])
    for name in MODULE_HOOKS:
        h = d.get(name)
        if type(h) is OrderedDict and not h:
            d[name] = _WatchedHooks()


class Fingerprint:
    """The facts of the module docstring for the module trees under ``root`` (the
    ``nn.ModuleList`` of a rank's steps), recorded by :meth:`take` and compared by
    :meth:`same` and :meth:`hooked`. ``epoch`` counts the records (a forward's node keeps the
    epoch it ran with).

    Cost per call, O(1) in the number of layers: :meth:`take` gives every module of the trees
    watched ``_parameters`` / ``_buffers`` / ``_modules`` and hook dicts, whose writes count in
    a global counter; :meth:`same` compares that counter with the one it last saw, and only when
    it moved (a write anywhere) compares every entry's identity and count with the record (a
    few C-level passes over flat lists). ``training`` flags are plain attributes: with
    ``training=True`` (the batched path calls the template's modules, whose flags then apply to
    every layer) their pattern is compared on every call, one pass over the modules; the native
    kernels and per-layer calls do not depend on another module's flags."""

    def __init__(self, root: nn.Module, training: bool = True):
        self.root = root
        self.epoch = 0
        self.take(training)

    def take(self, training: bool = True) -> None:
        """Record the current facts (after the fast paths were rebuilt from them);
        ``training``: whether the fast paths depend on the ``training`` pattern."""
        mods = list(self.root.modules())
        for m in mods:
            _watch(m)
        dicts = [d for m in mods for d in (m._modules, m._parameters, m._buffers)]
        self._dicts = dicts
        self._total = sum(map(len, dicts))
        self._owners = [d for d in dicts for _ in d]
        self._keys = [k for d in dicts for k in d]
        self._values = list(map(operator.getitem, self._owners, self._keys))
        self._hooks = [getattr(m, h) for m in mods for h in MODULE_HOOKS]
        self._unwatched = [h for h in self._hooks if type(h) is not _WatchedHooks]
        self._hooked = any(self._hooks)
        # (a torch.compile wrapper has no own flag: it reads its module's, recorded anyway)
        self._mdicts = [vars(m) for m in mods if "training" in vars(m)] if training else []
        self._training = bytes(map(_TRAINING, self._mdicts))
        # modules per step when every step has the same tree (training patterns repeat)
        per = [sum(1 for _ in s.modules()) for s in self.root.children()]
        self._period = per[0] if per and len(set(per)) == 1 and 1 + sum(per) == len(mods) else 0
        self._seen = _EPOCH[0]
        self.epoch += 1
        # what a forward's node keeps (its modules' structure) to accept a backward after
        # rebuilds that came back to it (torch.func.functional_call swaps tensors in and out)
        self.record = (self._owners, self._keys, self._values, self._training)

    def matches(self, record) -> bool:
        """Whether the current record (of the latest :meth:`take`, after :meth:`same`) has the
        same entries, by identity, and ``training`` pattern as ``record`` (an earlier
        :attr:`record`)."""
        owners, keys, values, training = record
        return (len(values) == len(self._values) and training == self._training
                and keys == self._keys and all(map(operator.is_, owners, self._owners))
                and all(map(operator.is_, values, self._values)))

    def __setstate__(self, state):
        """A copy or unpickled model holds plain dicts (see ``_Watched.__reduce_ex__``): its
        next check fails and rebuilds the fast paths, which watches the copied dicts."""
        self.__dict__.update(state)
        self._total = self._seen = -1

    def _scan(self) -> bool:
        """The full comparison of the structure with the record (after a watched write)."""
        if sum(map(len, self._dicts)) != self._total:
            return False
        try:
            if not all(map(operator.is_, map(operator.getitem, self._owners, self._keys),
                           self._values)):
                return False
        except KeyError:
            return False
        self._hooked = any(self._hooks)
        self._seen = _EPOCH[0]
        return True

    def same(self) -> bool:
        """Whether the recorded facts still hold (a ``training`` pattern that changed but is
        the same at every layer is accepted and recorded: the batching proof still holds)."""
        if _EPOCH[0] != self._seen and not self._scan():
            return False
        if self._mdicts:
            training = bytes(map(_TRAINING, self._mdicts))
            if training != self._training:
                n = self._period
                body = training[1:]
                if not n or body != body[:n] * (len(body) // n):
                    return False
                self._training = training
        return True

    def hooked(self) -> bool:
        """Whether a module hook is registered on any module under ``root`` or globally."""
        if _EPOCH[0] != self._seen and not self._scan():  # the structure changed too
            self._hooked = any(self._hooks)
        return (self._hooked or (bool(self._unwatched) and any(self._unwatched))
                or global_hooks_registered())
