"""The extension point of the training loop for methods that run their own updates:
:class:`TrainingMethod` (layer-wise training: several local losses, optimizers or stages per
step) and :class:`MethodOptimizer` (the optimizers of such a method as one optimizer for
checkpoints).

:class:`~mgrit.training.Trainer` takes either a network and an optimizer (end-to-end training:
forward, one loss, backward, gradient averaging, one optimizer step) or a
:class:`TrainingMethod` in place of the network (``optimizer=None``). Everything else is the
same loop for both: the epochs and their global-batch schedule with every sample used, the
evaluation before training and after every epoch, the per-epoch metrics, callbacks (progress
bar, console line, ``metrics.h5``/``summary.json``/``curves.png``), checkpoint/resume, and
the fail-fast phases. ``layerwise`` implements the sequential (Kim 2019) and decoupled (DGL,
Belilovsky et al. 2020) methods this way.

What the loop calls, on every rank of the grid, in this order::

    initial evaluation:   inputs(test x) -> forward(chunk) (eval mode, no_grad)
    per epoch:            train(); begin_epoch(epoch, epochs, shards); xe = inputs(x)
      per batch:          train_step(xe[shard], y[shard], weight, after_backward) -> (loss, correct)
                          (after_backward() runs the callbacks' on_after_backward)
                          [checkpoint every N steps: save by state_dict() keys + optimizer]
      end_epoch();        epoch totals: from_last(sum over replicas)
      evaluation:         inputs(test x) -> forward(chunk) on every rank, loss on is_last

Depends on torch and mpi4py only.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from ..nn.chains.compiled import plain_module

__all__ = ["TrainingMethod", "MethodOptimizer"]


class TrainingMethod(nn.Module):
    """Base class of a training method run by :class:`~mgrit.training.Trainer` in place of a
    network: the method updates its parameters itself in :meth:`train_step`.

    A method is not a network: it implements the runtime's network protocol
    (:class:`~mgrit.nn.protocol.TrainableNet`) itself, as a module with no MGRIT segments and
    no weight ties (the solver and tie members below are constants; a model with MGRIT
    segments is a network: :class:`~mgrit.nn.protocol.NetMixin`).

    Subclasses register the modules this rank trains as submodules (their ``state_dict`` keys
    are the checkpoint's keys: use the keys of the whole network, so a checkpoint written on
    one grid loads on another), set :attr:`comm` (the grid's layer communicator) and
    :attr:`optimizer` (a :class:`MethodOptimizer`, or None: no optimizer state in
    checkpoints), and implement :meth:`train_step` and :meth:`forward`.

    Attributes:
        comm: the layer communicator the method spans (``grid.layer_comm``; ``COMM_SELF`` for
            one rank per replica). The Trainer checks it against the grid.
        optimizer: what checkpoints save and load as the optimizer (None: nothing).
    """

    def __init__(self, comm: MPI.Comm | None = None):
        super().__init__()
        self.comm = MPI.COMM_SELF if comm is None else comm
        self.optimizer: MethodOptimizer | None = None

    # -- the network interface of the loop (as mgrit.nn.LayerParallelNet) --------------------
    @property
    def last_rank(self) -> int:
        """The layer rank that holds the network's output (default: the last)."""
        return self.comm.Get_size() - 1

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the network's output (its :meth:`forward` returns it)."""
        return self.comm.Get_rank() == self.last_rank

    def from_last(self, value: Any) -> Any:
        """``value`` of the output rank on every layer rank (one ``bcast`` when ``comm`` has
        more than one rank)."""
        if self.comm.Get_size() == 1:
            return value
        return self.comm.bcast(value, root=self.last_rank)

    def loss(self, out: torch.Tensor, target: torch.Tensor,
             fn: Callable = F.cross_entropy) -> torch.Tensor | None:
        """``fn(out, target)`` on the output rank, None elsewhere (evaluation only: a method
        computes its training losses in :meth:`train_step`)."""
        return fn(out, target) if self.is_last else None

    def global_modules(self) -> list:
        """``[("", self)]``: the method under its own state-dict keys (a ``torch.compile``\\ d
        module as the module it wraps)."""
        return [("", plain_module(self))]

    def replicated_parameters(self) -> list:
        """The weights of every module inside that declares ``replicated_weights = True``."""
        return [p for m in self.modules() if getattr(m, "replicated_weights", False)
                for p in m.parameters()]

    def checkpoint_meta(self) -> dict:
        """``{"kind": "serial"}`` (saved in checkpoints)."""
        return {"kind": "serial"}

    # a method has no MGRIT segments and no weight-tied layers
    def tied_prefixes(self) -> dict:
        return {}

    def solver_segments(self) -> list:
        return []

    def solver_results(self) -> list:
        return []

    def solver_options(self) -> list:
        return []

    def exact_tolerance(self) -> None:
        return None

    def describe_solvers(self) -> list:
        return []

    def solver_summary(self) -> None:
        return None

    def owned_points(self) -> list:
        return []

    def warm_states(self) -> list:
        return []

    def set_warm_states(self, states: list) -> None:
        pass

    def tied_duplicates(self) -> list:
        return []

    def check_tied_replicas(self) -> None:
        pass

    # -- hooks --------------------------------------------------------------------------------
    def begin_epoch(self, epoch: int, epochs: int, shards: Sequence[int]) -> None:
        """Called before the first step of ``epoch`` (0-based) of a fit of ``epochs`` epochs,
        after ``train()``. ``shards``: this replica's sample count of every batch the epoch
        will run (after a resume mid-epoch: of the remaining ones). Default: nothing."""

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor the loop takes the rows of a batch or an evaluation chunk of ``x``
        from (the same length as ``x``). Default: ``x``; sequential training returns the
        cached outputs of its frozen layers."""
        return x

    def describe_epoch(self, epoch: int) -> str | None:
        """What the 0-based ``epoch`` trains, for the console's epoch line (e.g. which layer
        of a layer-by-layer schedule); None (default): nothing to add."""
        return None

    def train_step(self, x: torch.Tensor, y: torch.Tensor, weight: float,
                   after_backward: Callable[[], None]) -> tuple:
        """One update on this replica's shard ``x`` ``(n, ...)`` (rows of :meth:`inputs`),
        targets ``y`` ``(n,)``; ``n`` may be 0 (the replica still takes part in every
        collective). ``weight``: ``n / global batch size``. Call ``after_backward()`` after
        each backward pass, before its gradients are averaged and applied.

        Returns:
            ``(loss, correct)``: this replica's mean loss and number of correct predictions
            of the network's output on the rank that knows them (the output rank), ``(None,
            None)`` elsewhere and for an empty shard. No collective is needed for them: the
            loop takes the epoch totals from the output rank.
        """
        raise NotImplementedError

    def end_epoch(self) -> None:
        """Called after the last step of an epoch, before the totals and the evaluation
        (e.g. wait for outstanding messages, release gradients). Default: nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The network's output for a chunk of :meth:`inputs` rows (evaluation: called in
        eval mode under ``no_grad`` on every rank with the same chunk), on the output rank;
        anything (e.g. None) elsewhere."""
        raise NotImplementedError


def _unique(params: Iterable[nn.Parameter]) -> list:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class MethodOptimizer:
    """The optimizers of a training method, seen by checkpoints as one optimizer over
    ``params`` (the state of each parameter, by its index in ``params``).

    ``live()`` returns the method's current ``torch.optim.Optimizer`` objects (each parameter
    in at most one of them; optimizers may come and go, e.g. one per stage).
    :meth:`load_state_dict` hands every parameter's saved state to the live optimizer that
    holds it and keeps the rest until :meth:`adopt` is called with a new optimizer, so a
    checkpoint taken in the middle of a stage restores that stage's optimizer state when the
    stage is set up after loading. Hyper-parameters (learning rates) are the method's own
    configuration and are neither saved nor loaded.

    Raises:
        ValueError (from :meth:`state_dict`): a parameter held by two live optimizers or not
            among ``params``.
    """

    def __init__(self, params: Iterable[nn.Parameter],
                 live: Callable[[], Sequence[torch.optim.Optimizer]]):
        self.params = _unique(params)
        self._live = live
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._pending: dict = {}

    @property
    def param_groups(self) -> list:
        """One group holding every parameter (no hyper-parameters)."""
        return [{"params": self.params}]

    def _owners(self) -> list:
        out, seen = [], set()
        for opt in self._live():
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) not in self._index:
                        raise ValueError("a live optimizer holds a parameter that is not "
                                         "among the method's parameters")
                    if id(p) in seen:
                        raise ValueError("a parameter is held by two live optimizers: their "
                                         "states cannot be saved under one key")
                    seen.add(id(p))
            out.append(opt)
        return out

    def state_dict(self) -> dict:
        """``{"state": {index: state}, "param_groups": [{"params": [0..n-1]}]}`` of the live
        optimizers' states (tensors cloned) plus saved states not yet adopted."""
        state = {}
        for opt in self._owners():
            for p, s in opt.state.items():
                if s:
                    state[self._index[id(p)]] = {k: (v.detach().clone() if torch.is_tensor(v)
                                                     else v) for k, v in s.items()}
        for i, s in self._pending.items():
            state.setdefault(i, s)
        return {"state": state, "param_groups": [{"params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep ``state_dict["state"]`` (by parameter index) and give the live optimizers
        theirs; the ``param_groups`` entries are ignored."""
        self._pending = {int(i): s for i, s in state_dict["state"].items()}
        for opt in self._owners():
            self.adopt(opt)

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Load the kept saved states of ``optimizer``'s parameters into it (through its
        ``load_state_dict``, which casts them to the parameters' dtype and device)."""
        sd = optimizer.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        found = False
        for p, i in zip(params, ids):
            saved = self._pending.pop(self._index.get(id(p), -1), None)
            if saved is not None:
                sd["state"][i] = saved
                found = True
        if found:
            optimizer.load_state_dict(sd)
