"""Layer-parallel residual networks on the MGRIT solver (import ``mgrit.nn``).

Public surface: step modules (:class:`DenseStep`, :class:`ConvStep`, :class:`TwoConvStep`,
:class:`SmoothReLU`, :func:`make_step`), :class:`LayerParallelResNet` (MGRIT forward,
adjoint-MGRIT backward, ordinary autograd outside), :class:`LayerParallelNet` (opening ->
ResNet -> closing), and the serial reference :func:`serial_resnet`.

Example (every rank of ``comm``)::

    resnet = LayerParallelResNet.build(lambda k: DenseStep(8, "tanh"), n_layers=64,
                                       state_shape=(8,), comm=comm,
                                       forward=MGRITOptions(max_levels=3, cfactor=4, tol=0, max_iter=2),
                                       backward=MGRITOptions(max_levels=3, cfactor=4, tol=0, max_iter=1))
    net = LayerParallelNet(nn.Linear(2, 8), resnet, nn.Linear(8, 5))
    out = net(x)                       # same x on every rank
    net.loss(out, y).backward()        # every rank; real loss on the last layer rank
    optimizer.step()                   # ordinary torch.optim on this rank's parameters
"""
from .net import LayerParallelNet
from .resnet import LayerParallelResNet, layer_seed, serial_resnet
from .steps import ConvStep, DenseStep, ResidualStep, SmoothReLU, TwoConvStep, make_step

__all__ = ["LayerParallelNet", "LayerParallelResNet", "serial_resnet", "layer_seed", "DenseStep",
           "ConvStep", "TwoConvStep", "SmoothReLU", "ResidualStep", "make_step"]
