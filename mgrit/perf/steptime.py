"""A layer-parallel ResNet's training step in the cost model: :class:`TrainCosts` (its calibrated
costs, :mod:`mgrit.perf.calibration`) and the predicted critical path of a step
(:func:`resnet_times`, :func:`training_times`). The step is the replay of the MGRIT solves
(:func:`mgrit.perf.model.simulate`) when it solves with MGRIT; with one level in both
directions it runs the exact path instead, a pipelined chain of autograd layers
(:mod:`mgrit.nn.resnet.pipelined`): ``N tau_pipe + (P - 1) beta`` per direction.

Below :mod:`mgrit.nn` in the layering (uses :mod:`mgrit.grid`/:mod:`mgrit.options` only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..grid import Hierarchy, Partition
from ..options import MGRITOptions
from .model import CommCost, StepCost, layerwise_time, simulate

__all__ = ["TrainCosts", "training_times", "resnet_times", "n_levels", "one_level_exact",
           "OUTSIDE_AGREEMENTS"]

#: Small collectives of a training step outside the MGRIT solves, per direction on more than
#: one rank (the forward's input check, the backward's bridge check); the count is held
#: against the real step's (``tests/mpi_cases/core/trace_cases.py``).
OUTSIDE_AGREEMENTS = 1


@dataclass(frozen=True)
class TrainCosts:
    """Calibrated costs of one network/batch and one configuration of the layer-parallel ResNet
    (:func:`mgrit.perf.calibration.chain_costs` times each through the code path that
    configuration runs). Seconds.

    * ``fwd``/``adj``: MGRIT step costs of the forward and adjoint chains (single steps and
      batched calls as the solver makes them; with the solver's bookkeeping per step);
    * ``serial_fwd``/``serial_bwd``: one layer of plain autograd forward (recording) and
      backward (``nn.Sequential``);
    * ``pgrad_item``: per layer, once per backward of an MGRIT solve: the parameter-gradient
      sweep, the adjoint's linearization (closed-form steps) and the autograd bridge's backward
      (the engine handing each layer's parameters their gradients);
    * ``per_layer``: the optimizer update per layer;
    * ``refresh``: per layer, once per MGRIT forward: the stacked-parameter snapshot (with
      autograd where the bridge's inputs are the stacked parameters) and the bridge's forward;
    * ``nbytes``: one state message;
    * ``solve_fixed``: the solver's fixed cost per solve (set-up, validation, state allocation
      not proportional to the work; :func:`mgrit.perf.calibration.solver_overhead_fit`);
    * ``pipe_fwd``/``pipe_bwd``: per layer, forward (recorded by autograd) and backward of the
      one-level exact path (:mod:`mgrit.nn.resnet.pipelined`: no solver, the rank's layers in
      autograd), ``pipe_fwd_fixed``/``pipe_bwd_fixed`` its fixed costs per forward / backward
      on one rank (0 when that path was not calibrated);
    * ``path_fwd``/``path_bwd`` (per layer, may be < 0) and ``fixed_fwd``/``fixed_bwd`` (per
      forward / backward): what the pieces above miss of the real MGRIT path, from the real
      path at smaller depths (:func:`mgrit.perf.calibration.path_residual`; 0 when not
      calibrated); ``path_eval``/``fixed_eval`` the same for an evaluation forward
      (``torch.no_grad``), relative to the replay alone (its snapshot included).
    """
    fwd: StepCost
    adj: StepCost
    serial_fwd: float
    serial_bwd: float
    pgrad_item: float = 0.0
    per_layer: float = 0.0
    nbytes: int = 0
    refresh: float = 0.0
    solve_fixed: float = 0.0
    pipe_fwd: float = 0.0
    pipe_bwd: float = 0.0
    pipe_fwd_fixed: float = 0.0
    pipe_bwd_fixed: float = 0.0
    path_fwd: float = 0.0
    path_bwd: float = 0.0
    fixed_fwd: float = 0.0
    fixed_bwd: float = 0.0
    path_eval: float = 0.0
    fixed_eval: float = 0.0


def n_levels(N: int, P: int, options: MGRITOptions) -> int:
    """Levels of MGRIT's hierarchy for ``N`` intervals on ``P`` ranks (as the solver builds it;
    the same on every rank)."""
    o = options
    return Hierarchy(Partition.even(N, P), 0, o.cfactor, o.max_levels, o.min_coarse).n_levels


def one_level_exact(N: int, P: int, fwd: MGRITOptions, bwd: MGRITOptions) -> bool:
    """Whether a training step runs the one-level exact path (:mod:`mgrit.nn.resnet.pipelined`, both
    solves one level): a pipelined chain of autograd layers instead of MGRIT solves."""
    return n_levels(N, P, fwd) == 1 and n_levels(N, P, bwd) == 1


def resnet_times(N: int, P: int, costs: TrainCosts, fwd: MGRITOptions, bwd: MGRITOptions,
                 K_f: int, K_b: int, comm: CommCost = CommCost(),
                 grad: bool = True, level_cost=None) -> tuple[float, float]:
    """Critical-path seconds ``(forward, backward)`` of the layer-parallel ResNet in one training
    step (optimizer excluded). MGRIT: the replay of ``K_f`` forward / ``K_b`` adjoint cycles
    plus the per-layer snapshot / gradient sweep and bridge, the solver's fixed costs and one
    agreement outside the solves in each of forward (the network's input check) and backward
    (the bridge's; both counted on the real step at P = 2, issue 34). Both solves one level:
    the exact path is a pipelined chain of autograd layers, ``N pipe + (P - 1) beta`` per
    direction plus its fixed costs and one agreement each (the forward's input check, the
    backward's). ``grad=False``: an evaluation forward (``torch.no_grad``; backward 0): the
    replay, the solver's fixed cost and the ``*_eval`` residual terms. ValueError: ``costs``
    not :class:`TrainCosts`, ``fwd``/``bwd`` not MGRITOptions, ``N < P``. ``level_cost``:
    spatial coarsening, each level's step cost relative to a fine step
    (:func:`mgrit.perf.model.spatial_level_cost`; default time-only)."""
    if not isinstance(costs, TrainCosts):
        raise ValueError(f"costs must be TrainCosts, got {type(costs).__name__}")
    for name, o in (("fwd", fwd), ("bwd", bwd)):
        if not isinstance(o, MGRITOptions):
            raise ValueError(f"{name} must be MGRITOptions, got {type(o).__name__}")
    beta, nl = comm.message(costs.nbytes), math.ceil(N / P)
    agree = OUTSIDE_AGREEMENTS * comm.reduction(P)
    if one_level_exact(N, P, fwd, bwd):
        return (layerwise_time(N, P, costs.pipe_fwd, beta) + costs.pipe_fwd_fixed + agree,
                layerwise_time(N, P, costs.pipe_bwd, beta) + costs.pipe_bwd_fixed + agree)
    f = simulate(N, P, fwd, K_f, None, costs.fwd, comm, costs.nbytes,
                 level_cost=level_cost).critical_path
    if not grad:
        return max(f + nl * costs.path_eval + costs.solve_fixed + costs.fixed_eval, 0.0), 0.0
    b = simulate(N, P, bwd, K_b, None, costs.adj, comm, costs.nbytes,
                 level_cost=level_cost).critical_path
    f += nl * (costs.refresh + costs.path_fwd) + costs.solve_fixed + costs.fixed_fwd + agree
    b += nl * (costs.pgrad_item + costs.path_bwd) + costs.solve_fixed + costs.fixed_bwd + agree
    return max(f, 0.0), max(b, 0.0)


def training_times(N: int, P: int, costs: TrainCosts, fwd: MGRITOptions, bwd: MGRITOptions,
                   K_f: int, K_b: int, comm: CommCost = CommCost(), level_cost=None) -> dict:
    """Predicted seconds of ``forward``, ``backward`` and ``train`` (step incl. optimizer) of
    ``serial`` (autograd, one rank), ``layerwise`` (blocking chain over ``P`` ranks) and
    ``mgrit`` (the layer-parallel ResNet with these options: ``K_f`` forward / ``K_b`` adjoint
    cycles, or the one-level exact path when both have one level; :func:`resnet_times`, with
    ``level_cost`` under spatial coarsening).
    Pipelining, data parallelism and hybrids with batch-size-dependent costs:
    :mod:`mgrit.perf.strategies`."""
    beta, nl = comm.message(costs.nbytes), math.ceil(N / P)
    sf, sb = costs.serial_fwd, costs.serial_bwd
    out = {"serial": {"forward": N * sf, "backward": N * sb},
           "layerwise": {"forward": layerwise_time(N, P, sf, beta),
                         "backward": layerwise_time(N, P, sb, beta)}}
    f, b = resnet_times(N, P, costs, fwd, bwd, K_f, K_b, comm, level_cost=level_cost)
    out["mgrit"] = {"forward": f, "backward": b}
    for k, v in out.items():
        v["train"] = v["forward"] + v["backward"] + (N if k == "serial" else nl) * costs.per_layer
    return out
