"""One layer-parallel segment: :class:`LayerParallelResNet`, a residual chain solved by MGRIT
forward and adjoint MGRIT backward inside autograd (room ``resnet`` of :mod:`mgrit.nn`; imports
the rooms ``steps`` and ``chains`` and the solver core, never ``gru`` or the network modules
above it).

* :mod:`mgrit.nn.resnet.segment`: the class (construction, :meth:`~LayerParallelResNet.build`,
  the forward and its solve);
* :mod:`mgrit.nn.resnet.structure`: the structure of the step modules (checks, tie groups,
  the fast paths' per-call contract, the serial fallback for hooks and autocast);
* :mod:`mgrit.nn.resnet.global_view`: the network seen from every rank (``to_serial``, the
  global state dict);
* :mod:`mgrit.nn.resnet.controls`: the solver accessors (forward/backward solver, warm start,
  ``set_options``);
* :mod:`mgrit.nn.resnet.bridge`: the autograd node (forward solve; adjoint solve and
  parameter-gradient sweep in backward);
* :mod:`mgrit.nn.resnet.pipelined`: the one-level exact path (layer-wise model parallelism in
  autograd);
* :mod:`mgrit.nn.resnet.tied`: weight-tied layers, also across ranks;
* :mod:`mgrit.nn.resnet.tiespec`: the ``tie`` declaration (whole steps or parameters), normalized;
* :mod:`mgrit.nn.resnet.seeding`: per-layer seeded construction (:func:`layer_seed`) and the
  serial reference :func:`serial_resnet`.
"""
from .seeding import layer_seed, serial_resnet
from .segment import LayerParallelResNet

__all__ = ["LayerParallelResNet", "serial_resnet", "layer_seed"]
