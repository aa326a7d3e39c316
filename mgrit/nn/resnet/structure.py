"""The structure of a :class:`~mgrit.nn.resnet.LayerParallelResNet`'s step modules: the checks
made at construction and by ``refresh_structure`` (unsupported modules, parameters shared across
layers, weight-tie groups), the parameter lists derived from the modules, the per-call check of
the fast paths' contract (:mod:`mgrit.nn.chains.contract`: rebuild when the modules changed),
and the agreed decision to run a forward as the serial pipeline (module hooks, autocast).

A mixin: the ResNet owns the state (``steps``, ``_groups``, ``_tied``, ``_chain``,
``_fingerprint``, ...); these methods read and rebuild it. Communication only where a method
says so (``refresh_structure``, ``check_tied_replicas``, ``_setup_ties``, ``_serial_reason``).
"""
from __future__ import annotations

import itertools
import warnings

from ...collective import agreed, allgather_within
from ...comm import raise_agreed
from ..chains.contract import autocast_enabled, global_hooks_registered
from ..chains.transforms import substituted, transform_error
from ..steps import batchnorm, stochastic
from .tied import TiedLayers

__all__ = ["StepStructure"]

#: why a forward runs the serial pipeline (index: agreed code, the largest of every rank's)
_SERIAL_REASONS = (None, "torch.autocast is active",
                   "module hooks are registered on the step modules (or globally)",
                   "torch.func.functional_call substituted tensors for the step parameters")



class StepStructure:
    """Structure checks and fast-path upkeep of a :class:`~mgrit.nn.LayerParallelResNet` (see
    there: ``refresh_structure``, ``check_tied_replicas``, ``batching_obstacle``)."""

    def _structure_error(self) -> str | None:
        """This rank's unsupported modules and parameters shared across layers (a message).
        Also collects the BatchNorms and numbers the Dropout/DropPath modules of the steps."""
        self._bns = batchnorm.batch_norms(self.steps)
        error = (stochastic.plain_dropout_error(self.steps, self.first)
                 or batchnorm.batchnorm_error(self.steps, self.first)
                 or stochastic.attach(self.steps, self.first, self._noise)[1])
        if error:
            return error
        if self._groups is not None:
            return TiedLayers(self._groups, self.steps, self.first, self.partition,
                              self.comm).structure_error(self.steps)
        if self.comm.Get_size() > 1:
            owner = {}
            for k, s in enumerate(self.steps):
                for name, p in s.named_parameters():
                    j, first_name = owner.setdefault(id(p), (k, name))
                    if j != k:
                        return (f"layers {self.first + j} and {self.first + k} share the "
                                f"parameter {first_name!r} (the same Parameter object): "
                                f"parameters shared between layers are supported on one layer "
                                f"rank only, unless declared with tie=... (with P = "
                                f"{self.comm.Get_size()} every rank holds a copy, which tie "
                                f"keeps identical); declare it with tie (tie={{"
                                f"{first_name!r}: lambda k: 0}} for this parameter, or a "
                                f"function for whole step modules), give each layer its "
                                f"own parameters or use P = 1")
        return None

    def _setup_ties(self) -> None:
        """The tie groups' replicas and gradient layout (collective; see :mod:`.tied`)."""
        if self._groups is None:
            self._tied = None
            return
        self._tied = TiedLayers(self._groups, self.steps, self.first, self.partition, self.comm)
        self._tied.setup()

    def check_tied_replicas(self) -> None:
        """Raise ``ValueError`` on every rank if the replicas of a weight-tied group (``tie``)
        are not bitwise identical across the layer ranks (collective: one ``allgather``;
        nothing to do without ties spanning ranks)."""
        if self._tied is not None and self._tied.spanning:
            error = self._tied.replica_error()  # from one allgather: the same on every rank
            if error:
                raise ValueError(error)

    def _collect_parameters(self) -> None:
        """The unique parameters (autograd inputs) and, per layer and parameter of that layer,
        its index among them (tied parameters: several layers point to one index); the
        parameters and buffers whose versions the one-level path checks (``_checked``)."""
        leaves = getattr(self, "_leaves", None)
        if leaves is not None:  # stacked_parameters=True: one leaf per name
            self._params = list(leaves.snapshot(True).values())
            self._substituted, self._param_index = False, []
        else:
            self._params = list(self.steps.parameters())  # deduplicated: shared ones once
            self._substituted = substituted(self._params)  # functional_call's fast weights
            index = {id(p): i for i, p in enumerate(self._params)}
            self._param_index = [index[id(p)] for s in self.steps for p in s.parameters()]
        self._checked = self._params + batchnorm.checked_buffers(self.steps)

    def _checked_names(self) -> list:
        """Names of :attr:`_checked` for error messages (global layer index and name)."""
        names = {}
        if getattr(self, "_leaves", None) is not None:
            for n, t in self._leaves.snapshot(True).items():
                names[id(t)] = f"stacked parameter 'stacked.{n}'"
        for j, s in enumerate(self.steps):
            for n, t in s.named_parameters():
                names.setdefault(id(t), f"parameter {n!r} of layer {self.first + j}")
            for n, t in s.named_buffers():
                names.setdefault(id(t), f"buffer {n!r} of layer {self.first + j}")
        return [names.get(id(t), "a tensor of this rank's layers") for t in self._checked]

    def refresh_structure(self) -> None:
        """Re-read the step modules now. Rarely needed: every forward compares a fingerprint
        of the step modules (:mod:`mgrit.nn.chains.contract`: parameters, buffers and submodules
        replaced or added, dtypes, devices, ``training``, hooks) with the one its fast paths
        were built from and rebuilds them when it changed. Still useful after assigning a plain
        Python attribute of a step (``step._c = 2.0``; not in the fingerprint) and to re-check
        unsupported modules and parameters shared across layers (a ValueError on every rank).
        Collective over the layer communicator."""
        raise_agreed(self.comm, self._structure_error())
        self._setup_ties()
        self._stochastic = stochastic.any_stochastic(self.steps, self.comm)
        self._restructure()

    def _restructure(self) -> None:
        """Rebuild what was derived from the step modules: the parameter lists, the batched
        chain (batching proof, stacked tensors), the tie groups' parameter references and the
        fingerprint. Local (no message)."""
        if getattr(self, "_leaves", None) is not None:
            self._leaves.install()  # .to() replaced the leaves' data: new views
        self._collect_parameters()
        if self._tied is not None and self._params:
            self._tied.rebind(self.steps, self._params[0].dtype, self._params[0].device)
            # a tied parameter replaced on some layers only (the tie is broken): the next
            # forward is refused on every rank (agreed with _transform_error's message)
            self._tie_error = self._tied.structure_error(self.steps)
        self._chain.rebuild(self.steps)
        self._fingerprint.take(training=self._reads_training())

    def _reads_training(self) -> bool:
        """Whether the fast path in use applies one module's ``training`` flags to other
        layers (the batched ``vmap`` path calls the template's modules)."""
        stack = self._chain._stack
        return stack is not None and not stack._native

    def _check_contract(self) -> None:
        """The per-call check of :mod:`mgrit.nn.chains.contract`: rebuild the fast paths when the
        step modules changed since they were built."""
        leaves = getattr(self, "_leaves", None)
        if leaves is not None and leaves.check():  # leaves replaced: views re-made
            self._restructure()
            return
        if not self._fingerprint.same():
            self._restructure()

    def _transform_error(self, x0) -> str | None:
        """This rank's refusal of the forward (:mod:`mgrit.nn.chains.transforms`; not agreed)."""
        error = transform_error("LayerParallelResNet", itertools.chain((x0,), self._params))
        tie_error = getattr(self, "_tie_error", None)
        if error is None and tie_error:
            error = (f"{tie_error} (a parameter of a tie group was replaced on some of its "
                     f"layers since construction; replace it on every layer of the group, "
                     f"then call refresh_structure())")
        error = error or (self._leaves.error if getattr(self, "_leaves", None) else None)
        if error is None and self._substituted and self._tied is not None and self._tied.size:
            error = ("torch.func.functional_call with weight-tied layers (tie=...) is not "
                     "supported: the replicas of a tie group on other ranks would not see the "
                     "substituted tensors")
        return error

    def _serial_reason(self, error: str | None = None) -> str | None:
        """Why this forward must run the serial pipeline instead of MGRIT (hooks on the steps
        or global module hooks; autocast; tensors substituted for the parameters by
        ``torch.func.functional_call``), agreed by every rank (when ``P > 1``: one
        ``allgather`` with the collective deadline), or ``None``. ``error``: this rank's
        refusal of the forward (:meth:`_transform_error`), raised as a ValueError on every
        rank when any rank has one."""
        code = (3 if self._substituted else 2 if self._fingerprint.hooked()
                else 1 if autocast_enabled(self.device) else 0)
        if self.comm.Get_size() > 1:  # the most serious reason of any rank, on every rank
            got = allgather_within(self.comm, (code, error), "the forward's path")
            code = max(c for c, _ in got)
            error = "; ".join(f"rank {r}: {e}" for r, (_, e) in enumerate(got) if e) or None
        if error:  # the same message on every rank
            raise agreed(ValueError(error))
        reason = _SERIAL_REASONS[code]
        if reason:
            why = ("hooks fire once per layer on the serial states" if "hook" in reason else
                   "gradients reach the substituted tensors" if "functional" in reason else
                   "autocast has serial semantics in the forward and the backward")
            warnings.warn(f"LayerParallelResNet: {reason}: this forward runs the layers one after "
                          f"the other (the serial pipeline across the ranks), so that {why}, as "
                          f"in serial PyTorch, instead of the MGRIT solve (no layer parallelism "
                          f"while this lasts)", stacklevel=3)
        return reason

    @property
    def batching_obstacle(self) -> str | None:
        self._check_contract()
        if global_hooks_registered():
            return "global module hooks are registered"
        if self._fingerprint.hooked():
            return "module hooks are registered on the step modules"
        if self._chain.batched:
            return None
        return self._chain.batching_obstacle or "global module hooks are registered"
