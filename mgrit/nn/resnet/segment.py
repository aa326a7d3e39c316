"""Layer-parallel ResNet: MGRIT forward solve, adjoint-MGRIT backward, ordinary autograd outside.

``x_{k+1} = x_k + h F_k(x_k)``, ``k = 0..N-1``, ``h = T / N``; each rank of the layer
communicator holds a contiguous block of layers (:class:`mgrit.grid.Partition`). Autograd
bridge after TorchBraid's ``braid_function.py`` (:mod:`mgrit.nn.resnet.bridge`): each forward is one
autograd node whose forward is an MGRIT solve and whose backward is an MGRIT solve of the
adjoint chain (Guenther et al. 2020, SIMODS) followed by one parallel sweep of parameter
vector-Jacobian products, so optimizers see ordinary ``.grad`` on every rank.

Every rank of the layer communicator calls ``forward`` and ``backward``; the final state
exists on the last layer rank, the input gradient on the first. Exact mode (iterate to a
tolerance) reproduces serial backpropagation; inexact mode (fixed small iteration counts,
``tol = 0``; TorchBraid: 2 forward / 1 backward) costs less per step but gives a biased
gradient (a few percent relative error; measure it with :mod:`mgrit.training` 's bias
monitor), with a warm start from the previous batch's states. Whether either mode is faster
than serial or data-parallel training depends on the network and the machine: on 2 CPU cores
only deep, narrow networks gain (``experiments/results/``). ``adjoint="serial"`` is Kirby et al.'s variant: MGRIT
forward, the backward chain swept serially across ranks (a one-level adjoint solve).

When both solves have one level (``max_levels=1``), there is nothing for MGRIT to do: the
forward records the rank's layers in autograd as serial PyTorch does, pipelined across the
ranks (:mod:`mgrit.nn.resnet.pipelined`; same autograd semantics, bitwise serial autograd on one
rank). With a batched chain the node's parameter inputs are the stacked parameters
(``torch.stack`` with autograd): no Python work per parameter tensor in the bridge.

The step modules stay ordinary modules after build. Every forward (and every MGRIT backward)
checks the fingerprint of :mod:`mgrit.nn.chains.contract` and rebuilds the fast paths when the modules
changed (parameters replaced, submodules swapped, ...), so a user never has to announce a
change. Module hooks on the steps (or global module hooks) and ``torch.autocast`` make the
forward take the serial pipeline of the one-level path whatever the options (a
``UserWarning`` says so): hooks then fire once per layer on the serial states, their returned
values used as in serial, and autocast has serial semantics in the backward too -- MGRIT would
run each layer many times on intermediate iterates and its adjoint outside autocast. The
decision is agreed by every rank (one ``Allreduce`` of an int per forward when ``P > 1`` and the
solve has several levels). State-dict keys do not depend on ``torch.compile`` of steps
(:mod:`mgrit.nn.chains.compiled`).

The class's other parts are mixins of the same room: the structure checks and the fast paths'
upkeep (:mod:`mgrit.nn.resnet.structure`), the global views (:mod:`mgrit.nn.resnet.global_view`)
and the solver accessors (:mod:`mgrit.nn.resnet.controls`).
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, Sequence

import torch
from mpi4py import MPI
from torch import nn

from ...collective import guarded
from ...comm import raise_agreed
from ...grid import Partition
from ...options import MGRITOptions
from ...solver import MGRIT
from ..chains.compiled import compile_neutral_keys
from ..chains.contract import Fingerprint
from ..chains.propagators import ForwardChain
from ..chains.transforms import compile_disabled, transform_error
from ..steps import batchnorm, stochastic
from .bridge import MGRITFunction
from .controls import SolverControls
from .global_view import GlobalView
from .pipelined import one_level, pipelined_forward
from .seeding import make_layers
from .spatial import spatial_error
from .structure import StepStructure
from .tied import tie_groups

__all__ = ["LayerParallelResNet"]


class LayerParallelResNet(StepStructure, GlobalView, SolverControls, nn.Module):
    """This rank's block of a forward-Euler ResNet, solved layer-parallel by MGRIT.

    Args:
        steps: the step modules ``F_k`` of this rank's layers ``first .. first+len(steps)-1``
            (see :meth:`build`, which creates them for the default partition). Each maps a
            state ``(batch, *state_shape)`` to the same shape. BatchNorm: batch statistics in
            every application, running statistics once per training forward from the final
            states (:mod:`mgrit.nn.steps.batchnorm`). Dropout: :class:`mgrit.nn.steps.Dropout`
            / ``DropPath``, one mask per training forward and layer (:mod:`mgrit.nn.steps.stochastic`);
            torch's ``nn.Dropout*`` (a new mask at every application) raise ValueError.
            Layers may share parameters (the same ``Parameter`` object, e.g. one module for
            every layer) with ``P = 1``: gradients are summed as serial autograd sums them.
            With ``P > 1`` sharing must be declared with ``tie`` (below); undeclared sharing
            is refused (ValueError on every rank) where it is visible: between layers of one
            rank here, and any parameter not created by ``make_step(k)`` in :meth:`build`.
            Frozen parameters (``requires_grad=False``) get no gradient and cost no work.
        n_layers: ``N``, the global number of residual layers (``>= P``).
        state_shape: shape of one sample's state, e.g. ``(width,)`` or ``(C, H, W)``.
        T: final time (default 1.0); ``h = T / N``.
        comm: layer-parallel communicator (default ``COMM_SELF``).
        forward, backward: :class:`~mgrit.options.MGRITOptions` of the forward and adjoint
            solves (defaults: 2 levels, cfactor 4, exact to 1e-10 abs / 50 cycles).
            For inexact training use ``tol=0`` with ``max_iter`` 2 (forward) / 1 (backward).
        adjoint: ``"mgrit"`` (default) or ``"serial"`` (Kirby et al. 2020: serial sweep
            across ranks, exact adjoint of the MGRIT-approximate forward states).
        warm_start: start each forward solve from the previous training forward's states (same
            batch shape). Default ``None``: on when ``forward.tol == forward.rtol == 0``.
            Forwards under ``torch.no_grad()`` (evaluation) use but never replace them. Only
            the initial guess: no gradient depends on it.
        warm_start_adjoint: start each adjoint solve from the previous one's adjoints
            (Guenther et al.'s simultaneous training warm-starts both directions; default
            False, as TorchBraid).
        partition: layer ownership (default :meth:`Partition.even`).
        tie: weight-tied layers, also across ranks (:mod:`mgrit.nn.resnet.tied`): ``None`` (default:
            none), a function of the **global** layer index ``k -> group key`` or a sequence
            of ``N`` keys (``None``: untied). ``tie=lambda k: 0``: every layer uses one module
            (a time-invariant ODE network, ALBERT); ``tie=lambda k: k // 4``: groups of four
            layers, a group may span two ranks. The layers of a group on one rank must be the
            same module (:meth:`build` makes them so); each rank holding a group keeps a
            replica, made bitwise identical at construction (the values of the rank holding
            the group's first layer) and kept so: the backward itself sums each group's
            gradient over the layer ranks (one ``Allreduce`` per backward), so ``.grad`` is
            the serial gradient on every rank, with no extra call. ValueError (every rank):
            sharing that ``tie`` does not declare, a group whose layers use different
            parameters, replicas of different shapes or dtypes.
        spatial: ``None`` (default) or a :class:`mgrit.spatial.SpatialCoarsening`: the
            coarse levels it lists run on coarser feature maps (``state_shape`` ``(C, L)``,
            ``(C, H, W)`` or ``(C, D, H, W)``), in the forward and (transposed operators) the
            adjoint solve; a coarse step is the layer's module applied to the coarse state
            with the coarse step size. BatchNorm on a coarse level: batch statistics of the
            coarse state, running statistics never updated there. ValueError (every rank):
            sizes that do not coarsen, bad user operators, a layer that cannot run at a
            coarse size (e.g. a Linear over flattened pixels), naming it.

    Autograd: each forward in grad mode is one autograd node that owns its forward states and
    stacked parameters, so any PyTorch pattern works as in serial autograd: several forwards
    before one backward, gradient accumulation over micro-batches (F1 B1 F2 B2 or F1 F2 B1 B2),
    ``torch.autograd.grad``, ``retain_graph=True``, evaluation forwards in between,
    ``torch.utils.checkpoint`` (both modes; the forward solve is then recomputed in the
    backward, in inexact mode from the latest warm start, so its states may differ from the
    first solve's by the solver's inexactness). Every rank must backpropagate the same forwards (each backward is a collective
    adjoint solve); ranks run them in the same order because the autograd engine runs ready
    nodes by descending creation order, and one small agreement per backward turns a mismatch
    into a RuntimeError on every rank. A parameter changed in place between a forward and its
    backward (``optimizer.step()``) raises autograd's "modified by an inplace operation"
    RuntimeError on every rank, as serial autograd does; so does a second backward without
    ``retain_graph``. Double backward (``create_graph=True``) is refused with a RuntimeError.

    Attributes:
        first: global index of this rank's first layer.
        is_first: whether this rank holds layer 0; ``is_last``: layer N-1.
        last_forward: the :class:`~mgrit.solver.MGRITResult` of the latest forward solve
            (residual history, stats; diagnostics only); ``last_backward``: of the adjoint.
        batching_obstacle: why this rank's layers are evaluated one by one (``None`` when
            batched; see :mod:`mgrit.nn.chains.stacking`).
    """

    def __init__(self, steps: Sequence[nn.Module], n_layers: int, state_shape: Sequence[int],
                 T: float = 1.0, comm: MPI.Comm | None = None,
                 forward: MGRITOptions | None = None, backward: MGRITOptions | None = None,
                 adjoint: str = "mgrit", warm_start: bool | None = None,
                 partition: Partition | None = None, warm_start_adjoint: bool = False,
                 tie: Callable[[int], Hashable] | Sequence[Hashable] | None = None,
                 spatial=None):
        super().__init__()
        self.comm = MPI.COMM_SELF if comm is None else comm
        P, rank = self.comm.Get_size(), self.comm.Get_rank()
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers={n_layers!r} is not allowed: use an int >= 1")
        if isinstance(T, bool) or not isinstance(T, (int, float)) or not math.isfinite(T) or T <= 0:
            raise ValueError(f"T={T!r} is not allowed: use a finite number > 0")
        if adjoint not in ("mgrit", "serial"):
            raise ValueError(f"adjoint={adjoint!r} is not allowed: use 'mgrit' or 'serial'")
        for name, o in (("forward", forward), ("backward", backward)):
            if o is not None and not isinstance(o, MGRITOptions):
                raise ValueError(f"{name}={o!r} is not allowed: use MGRITOptions or None")
        try:
            shape = torch.Size(state_shape)
        except TypeError:
            shape = None
        if shape is None or any(d < 1 for d in shape):
            raise ValueError(f"state_shape={state_shape!r} is not allowed: use a tuple of "
                             f"positive ints (one sample's state, without the batch dimension)")
        self.partition = Partition.even(n_layers, P) if partition is None else partition
        a, b = self.partition.block(rank)
        self.first, n_local = a, min(b, n_layers) - a
        error = None
        if len(steps) != n_local:
            error = (f"holds layers {a}..{a + n_local - 1} ({n_local}) but got {len(steps)} "
                     f"step modules")
        self.steps = nn.ModuleList(steps)
        self._noise = stochastic.NoiseSource()  # the forward's seed for Dropout/DropPath
        self._rng_error = None
        self._groups, self._tied = None, None
        try:
            self._groups = tie_groups(tie, n_layers)
        except ValueError as exc:
            error = error or str(exc)
        raise_agreed(self.comm, error or self._structure_error())  # same message everywhere
        self._setup_ties()
        self._stochastic = stochastic.any_stochastic(self.steps, self.comm)
        self._collect_parameters()
        self.n_layers, self.T, self.h = n_layers, float(T), float(T) / n_layers
        self.state_shape = shape
        self.fwd_opts = forward or MGRITOptions(max_levels=2, cfactor=4, tol=1e-10, max_iter=50)
        self.bwd_opts = backward or MGRITOptions(max_levels=2, cfactor=4, tol=1e-10, max_iter=50)
        if adjoint == "serial":
            self.bwd_opts = MGRITOptions(max_levels=1)
        self.adjoint = adjoint
        inexact = self.fwd_opts.tol == 0 and self.fwd_opts.rtol == 0
        self.warm_start = inexact if warm_start is None else bool(warm_start)
        p = next(self.steps[0].parameters(), None) if len(self.steps) else None
        self.dtype = p.dtype if p is not None else torch.get_default_dtype()
        self.device = p.device if p is not None else torch.device("cpu")
        self.is_first, self.is_last = a == 0, min(b, n_layers) == n_layers
        self._chain = ForwardChain(self.steps, a, self.h, batched=self.fwd_opts.batched)
        self.spatial = spatial
        kw = dict(dtype=self.dtype, device=self.device, comm=self.comm)
        self._fsolver = MGRIT(self._chain, n_layers, options=self.fwd_opts,
                              partition=self.partition, spatial=spatial, **kw)
        self._bsolver = MGRIT(self._chain, n_layers, options=self.bwd_opts,
                              partition=self.partition.reversed(),
                              spatial=None if spatial is None else spatial.transposed(), **kw)
        raise_agreed(self.comm, spatial_error(self))  # sizes, operators, coarse-size probes
        self.warm_start_adjoint = bool(warm_start_adjoint)
        self._warm = self._warm_adj = None
        self.last_forward = self.last_backward = None
        self._forward_count = 0  # numbers the forwards (the same on every rank: collective)
        self._token = torch.zeros(0, device=self.device, requires_grad=True)  # MGRITFunction
        # checked on every forward (contract.py)
        self._fingerprint = Fingerprint(self.steps, training=self._reads_training())
        compile_neutral_keys(self)  # state-dict keys without torch.compile's "_orig_mod."

    @classmethod
    def build(cls, make_step: Callable[[int], nn.Module], n_layers: int,
              state_shape: Sequence[int], comm: MPI.Comm | None = None, seed: int = 0,
              tie: Callable[[int], Hashable] | Sequence[Hashable] | None = None,
              spatial=None, **kwargs) -> "LayerParallelResNet":
        """Create this rank's layers with ``make_step(k)`` (seeded by :func:`layer_seed`, so the
        weights do not depend on the number of ranks) and wrap them. The caller's RNG states
        (CPU, and CUDA when initialized) are the same after ``build`` as before: whatever is
        created afterwards does not depend on the number of ranks either.

        ``tie`` (see the class): a group's module is made once per rank, by
        ``make_step(k0)`` seeded with ``layer_seed(seed, k0)`` (``k0``: the group's first
        layer), and used for all its layers there; :func:`serial_resnet` with the same
        ``tie`` builds the same weights. ``make_step`` may also return one module made
        elsewhere (``lambda k: shared``); the replicas then get the values of the rank
        holding ``k0``.

        With ``P > 1`` every parameter of an untied layer ``k`` must be created by the call
        ``make_step(k)`` (ValueError on every rank otherwise): a parameter made elsewhere may be
        shared with layers of other ranks, where each rank would train its own copy (declare
        it with ``tie``). To start from given weights, build and then
        :meth:`load_global_state_dict`. ``spatial``: as the class's."""
        comm = MPI.COMM_SELF if comm is None else comm
        part = kwargs.pop("partition", None) or Partition.even(n_layers, comm.Get_size())
        a, b = part.block(comm.Get_rank())
        try:
            groups = tie_groups(tie, n_layers)
        except ValueError as exc:
            raise_agreed(comm, str(exc))
        steps, foreign = make_layers(make_step, range(a, min(b, n_layers)), seed, groups)
        if groups is not None:  # a tied layer's parameters are the group's: never foreign
            foreign = [(k, n) for k, n in foreign if groups[k] is None]
        if comm.Get_size() > 1:
            raise_agreed(comm, None if not foreign else (
                f"parameter {foreign[0][1]!r} of layer {foreign[0][0]} was not created by "
                f"make_step({foreign[0][0]}) (it is shared with a module built elsewhere): with "
                f"P = {comm.Get_size()} layer ranks a parameter shared between layers would be "
                f"a separate copy on every rank; create each layer's parameters inside "
                f"make_step, declare the sharing with tie=..., or use P = 1"))
        return cls(steps, n_layers, state_shape, comm=comm, partition=part, tie=tie,
                   spatial=spatial, **kwargs)

    # -- autograd bridge ----------------------------------------------------------------
    @compile_disabled  # torch.compile: a graph break, the solve runs eagerly (chains.transforms)
    def forward(self, x0: torch.Tensor | None = None, batch_size: int | None = None) -> torch.Tensor:
        """MGRIT solve of all states.

        Args:
            x0: the input state ``(batch, *state_shape)`` on the first layer rank (may require
                grad). Elsewhere its values are ignored; a tensor given there only links it to
                the graph (its gradient there is ``None``: it does not reach this rank's part).
            batch_size: the batch size on ranks that do not hold ``x0``.

        Returns:
            ``x_N`` ``(batch, *state_shape)`` on the last layer rank; elsewhere an empty
            placeholder tensor connected to the parameters (call ``.sum().backward()`` on it,
            or on anything built from it, so that this rank joins the adjoint solve). In grad
            mode both always require grad (also when every parameter is frozen), so that every
            rank takes part in the backward.

        In training mode with Dropout/DropPath in the steps, every rank first takes the first
        layer rank's default generator state (one broadcast) and draws one seed from it
        (:mod:`mgrit.nn.steps.stochastic`).

        Raises:
            ValueError: (every rank, before any other message) inside a functorch transform
                (``torch.func.vmap``, ``grad``, ``jvp``, ``jacrev``, ...) or with forward-mode
                AD dual tensors (:mod:`mgrit.nn.chains.transforms`); ``torch.compile`` runs
                this forward eagerly (a graph break). Under ``torch.func.functional_call``
                (tensors substituted for the step parameters, e.g. MAML's fast weights) the
                forward runs the serial pipeline (a ``UserWarning``): gradients reach the
                substituted tensors as in serial autograd.
        """
        seed = None
        if self._stochastic and self.training:  # one stream, the first layer rank's: one seed
            stochastic.share_stream(self.comm, self.partition.owner(0))
            seed = stochastic.draw_seed()
        # an error on one rank only ends the job (mgrit.collective), whatever the launch line
        with self._noise.use(seed, None if seed is None else {}), guarded("layer-parallel forward"):
            return self._forward(x0, batch_size)

    def _forward(self, x0, batch_size):
        """The body of :meth:`forward`, inside the forward's noise scope."""
        if self.is_first:
            if x0 is None:
                raise ValueError("x0 is required on the first layer rank")
            batch = x0.shape[0]
        else:
            if batch_size is None:
                raise ValueError("batch_size is required on ranks other than the first layer "
                                 "rank (they do not hold x0): call forward(x0, batch_size=B) on "
                                 "every rank, or use LayerParallelNet, which passes it")
            batch = int(batch_size)
        self._forward_count += 1
        self._check_contract()  # the fast paths' contract, on every call (mgrit.nn.chains.contract)
        error = self._transform_error(x0)  # agreed by the first agreement of either path
        if one_level(self, torch.is_grad_enabled()):
            return pipelined_forward(self, x0, batch, error)
        if self._serial_reason(error):  # layer-wise model parallelism in autograd
            return pipelined_forward(self, x0, batch)
        if not torch.is_grad_enabled():  # evaluation: no node, keeps the training warm start
            return self._forward_solve(x0 if self.is_first else None, batch, False)[0]
        if not isinstance(x0, torch.Tensor):
            x0 = torch.zeros(0, dtype=self.dtype, device=self.device)
        if self._chain.batched and self.bwd_opts.batched and self.bwd_opts.max_levels > 1:
            snap = self._chain.refresh(grad=True)  # the node's inputs: one stack per name
            if snap:
                stacked = [snap[n] for n in self._chain._stack.names]
                return MGRITFunction.apply(self, batch, self._token, x0, snap, *stacked)
        return MGRITFunction.apply(self, batch, self._token, x0, None, *self._params)

    def _forward_solve(self, x0, batch: int, update_warm: bool, snapshot: dict | None = None):
        """One forward solve: ``(output, this rank's states, stacked-parameter snapshot)``
        (``snapshot``: the one to use, else a fresh one)."""
        shape = torch.Size((batch, *self.state_shape))
        stacked = self._chain.refresh() if snapshot is None else snapshot
        guess = self._warm if (self.warm_start and self._warm is not None
                               and self._warm.shape[1:] == shape) else None
        bns, rng = self._bns, torch.default_generator.get_state()
        with batchnorm.frozen_statistics(bns), \
                batchnorm.replicas_agree([self._fsolver], batchnorm.replica_comm(bns)):
            res = self._fsolver.solve(None if x0 is None else x0.detach(), initial_guess=guess,
                                      state_shape=shape)
        batchnorm.update_running_statistics(self.steps, res.states, bns)  # once per forward
        self._rng_error = None if stochastic.rng_unchanged(rng) else stochastic.drew_message()
        self.last_forward = res
        if self.warm_start and update_warm:
            self._warm = res.states
        if self.is_last:
            return res.states[-1].clone(), res.states, stacked
        return torch.zeros(0, dtype=self.dtype, device=self.device), res.states, stacked

    def _apply(self, fn, *args, **kwargs):
        """Keep the solvers' dtype/device in step with ``.to()``, ``.double()``, ``.cuda()``
        (and the stacked buffers, which ``.to()`` replaces)."""
        super()._apply(fn, *args, **kwargs)
        if "_fingerprint" not in self.__dict__:  # during __init__
            return self
        self._restructure()
        if self._params:
            self.dtype, self.device = self._params[0].dtype, self._params[0].device
            for solver in (self._fsolver, self._bsolver):
                solver.dtype, solver.device = self.dtype, self.device
            self._token = torch.zeros(0, device=self.device, requires_grad=True)
        if self._tied is not None:
            self._tied.rebind(self.steps, self.dtype, self.device)
        self._warm = self._warm_adj = None
        return self
