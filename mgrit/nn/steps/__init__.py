"""The step modules ``F`` of a residual layer ``x_{k+1} = x_k + h F(x_k)`` and how stateful
ones behave inside MGRIT solves (room ``steps`` of :mod:`mgrit.nn`; imports only torch and
mpi4py, nothing else of ``mgrit``).

* :mod:`mgrit.nn.steps.basic`: :class:`ResidualStep` (one layer ``u + h F(u)``), the dense and
  convolutional steps :class:`DenseStep`, :class:`ConvStep`, :class:`TwoConvStep`, the factory
  :func:`make_step`, :class:`SmoothReLU` and the activations;
* :mod:`mgrit.nn.steps.transformer`: :class:`TransformerStep` (pre-LN attention + MLP block);
* :mod:`mgrit.nn.steps.batchnorm`: BatchNorm inside steps (batch statistics in every
  application, running statistics once per training forward);
* :mod:`mgrit.nn.steps.stochastic`: :class:`Dropout` and :class:`DropPath` (one mask per
  training forward and layer, whatever solves the chain).

The names below are importable from ``mgrit.nn.steps``.
"""
from .basic import (ACTIVATIONS, ConvStep, DenseStep, ResidualStep, SmoothReLU, TwoConvStep,
                    activation, make_step)
from .stochastic import DropPath, Dropout
from .transformer import TransformerStep

__all__ = ["SmoothReLU", "activation", "DenseStep", "ConvStep", "TwoConvStep", "ResidualStep",
           "ACTIVATIONS", "make_step", "TransformerStep", "Dropout", "DropPath"]
