"""Step modules as MGRIT chains, and what every chain solve inside autograd relies on (room
``chains`` of :mod:`mgrit.nn`; imports the solver core -- ``mgrit.propagator``,
``mgrit.collective`` -- and torch, nothing else of ``mgrit.nn``).

* :mod:`mgrit.nn.chains.propagators`: :class:`ForwardChain` and :class:`AdjointChain`, the
  forward and adjoint propagators of a residual chain (coarse levels rediscretized);
* :mod:`mgrit.nn.chains.contract`: the contracts of the fast paths and the fingerprint checked
  on every forward;
* :mod:`mgrit.nn.chains.stacking`: batched evaluation of several layers with stacked
  parameters, and the proof that it is exact;
* :mod:`mgrit.nn.chains.compiled`: state-dict keys that do not depend on ``torch.compile``;
* :mod:`mgrit.nn.chains.agreement`: the agreement of every rank before a collective backward
  (shared by the layer-parallel ResNet and the parallel-in-time GRU).
"""
from .propagators import AdjointChain, ForwardChain, _Stacked  # noqa: F401 (_Stacked: older scripts)

__all__ = ["ForwardChain", "AdjointChain"]
