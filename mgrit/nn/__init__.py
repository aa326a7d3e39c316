"""Layer-parallel networks on the MGRIT solver (import ``mgrit.nn``): residual segments solved
by MGRIT forward and adjoint-MGRIT backward, ordinary modules and autograd around them.
Public names (``__all__``): :class:`LayerParallelNet` (ordinary modules and layer-parallel
segments in order: ``(opening, resnet, closing)``, staged ResNets, serial buffer layers around a
segment), :class:`LayerParallelResNet` (one segment), :func:`serial_resnet` (its serial
reference), the step modules :class:`DenseStep`, :class:`ConvStep`, :class:`TwoConvStep`,
:class:`TransformerStep` (pre-LN attention + MLP block) and the factory :func:`make_step`;
:class:`ParallelGRU` (a GRU solved parallel in time) and :class:`GRUSequenceClassifier`. Also
importable from here: :class:`SmoothReLU`, :class:`ResidualStep`, :func:`layer_seed`. Depth
transfer of weights between networks of N and f*N layers (multilevel initialization, Cyr,
Guenther, Schroder 2019; MG/Opt) is in :mod:`mgrit.nn.depth` (``prolong``, ``restrict``,
``transfer_weights``, ``DepthTransfer``). Weight-tied layers, also across ranks
(``LayerParallelResNet.build(..., tie=lambda k: 0)``: one module for every layer;
``tie={"lin.weight": lambda k: 0}``: one parameter; replicas kept identical, gradients summed
over the layer ranks inside the backward) are in :mod:`mgrit.nn.resnet.tied`.
Depends on torch, mpi4py and the solver core (``mgrit.comm``, ``grid``,
``options``, ``solver``); never imports ``mgrit.parallel``, ``mgrit.training`` or
``experiments``. Uses only the layer communicator handed to each segment (never
``COMM_WORLD``).

Rooms (sub-packages); each imports only the rooms it names, and no room imports the modules at
the top:

* :mod:`mgrit.nn.steps` -- the step modules ``F`` (dense, conv, transformer block) and how
  BatchNorm and Dropout/DropPath behave inside solves. Imports no other room.
* :mod:`mgrit.nn.chains` -- step modules as MGRIT chains (forward and adjoint propagators), the
  fast paths' contract and stacked evaluation, compile-neutral state-dict keys, the agreement
  before a collective backward. Imports no other room.
* :mod:`mgrit.nn.resnet` -- one layer-parallel segment, :class:`LayerParallelResNet` (its
  autograd node, the one-level exact path, weight ties, seeded construction, solver controls).
  Imports ``steps`` and ``chains``.
* :mod:`mgrit.nn.gru` -- :class:`ParallelGRU` and :class:`GRUSequenceClassifier`. Imports
  ``chains``.
* the modules at the top, above every room: :mod:`mgrit.nn.net` (:class:`LayerParallelNet`)
  with :mod:`mgrit.nn.segments` (its layout and checks) and ``_p2p`` (its transfers between
  segments); :mod:`mgrit.nn.depth` with ``_depth_plan`` (depth transfer). They may import every
  room.

Example: a complete script; run it with ``mpiexec -n P python -m mpi4py example.py`` for any
``P`` up to 8 -- it prints the same losses for every ``P`` (``tests/nn/test_segments_mpi.py`` runs
this text as written on 1, 2 and 3 ranks)::

    import torch
    from mpi4py import MPI
    from torch import nn

    from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet
    from mgrit.options import MGRITOptions

    comm = MPI.COMM_WORLD  # the layer communicator: layers are split over its ranks
    fwd = MGRITOptions(max_levels=2, cfactor=4, tol=0, max_iter=2)  # inexact: 2 forward cycles
    bwd = MGRITOptions(max_levels=2, cfactor=4, tol=0, max_iter=1)  # and 1 adjoint cycle


    def segment(width, n_layers, seed):  # one MGRIT chain of residual layers x + h tanh(Wx + b)
        return LayerParallelResNet.build(lambda k: DenseStep(width, "tanh"), n_layers, (width,),
                                         comm=comm, seed=seed, forward=fwd, backward=bwd)


    torch.manual_seed(0)  # build() keeps this RNG state: same weights for every P
    net = LayerParallelNet(nn.Linear(2, 8),        # opening: on segment 1's first layer rank
                           segment(8, 16, seed=1),  # segment 1: 16 layers of width 8
                           nn.Linear(8, 4),         # transition: on segment 1's last layer rank
                           segment(4, 16, seed=2),  # segment 2: 16 layers of width 4
                           nn.Linear(4, 3))         # head: on segment 2's last layer rank
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)  # this rank's parameters
    x = torch.randn(64, 2)  # the same batch on every rank
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    for step in range(3):
        optimizer.zero_grad()
        loss = net.loss(net(x), y)  # every rank; the real loss on the last layer rank
        loss.backward()             # every rank: one adjoint MGRIT solve per segment
        optimizer.step()
        print(step, net.from_last(loss.item()))  # the last layer rank's loss, on every rank

``net.to_serial()`` gives the equivalent ``nn.Sequential`` on every rank; exact mode (a
tolerance instead of ``tol=0``, float64) reproduces its gradients to round-off.
"""
from .gru import GRUSequenceClassifier, ParallelGRU
from .net import LayerParallelNet
from .resnet import LayerParallelResNet, layer_seed, serial_resnet
from .steps import (ConvStep, DenseStep, ResidualStep, SmoothReLU, TransformerStep, TwoConvStep,
                    make_step)

__all__ = ["LayerParallelNet", "LayerParallelResNet", "serial_resnet", "DenseStep", "ConvStep",
           "TwoConvStep", "TransformerStep", "make_step", "ParallelGRU", "GRUSequenceClassifier"]
