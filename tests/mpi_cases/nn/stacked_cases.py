"""Stacked-leaf parameters (``LayerParallelResNet(stacked_parameters=True)``) against serial
PyTorch autograd in float64, run on k ranks by tests/nn/test_stacked_leaves.py (k = 1 in
process, k = 2 through the MPI harness): gradients and three optimizer steps, and the state
dict of the unstacked model."""
import torch
from mpi4py import MPI

from mgrit.nn import serial_resnet
from tests.mpi_cases.nn.nn_cases import DT, WIDTH, _build, _maker, _rand


def _rows(model, name):
    """``[(global layer, tensor)]`` of this rank's rows of the stacked leaf ``name``."""
    w = model.stacked.get_parameter(name)
    return [(model.first + j, w[j]) for j in range(w.shape[0])]


def _serial_param(ser, k, name):
    return ser[k].F.get_parameter(name)


def check_stacked_matches_serial(n=13, steps=3, optimizer="sgd", comm=None):
    """Loss, input gradient, every parameter gradient and the parameters after ``steps``
    optimizer steps of the stacked model equal serial autograd's (absolute error over
    ``max(1, |serial|)``); returns the worst error (the max over ranks)."""
    comm = comm or MPI.COMM_WORLD
    torch.set_default_dtype(DT)
    x, w = _rand(5, WIDTH, seed=3), _rand(5, WIDTH, seed=4)
    model = _build("dense", "tanh", n, 2, 4, seed=7, comm=comm, stacked_parameters=True)
    plain = _build("dense", "tanh", n, 2, 4, seed=7, comm=comm)
    a, b = plain.state_dict(), model.state_dict()  # identical keys (order too) and values
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a), "state_dict differs"
    ser = serial_resnet(_maker("dense", "tanh"), n, 2.0, 7)
    names = [k[len("stacked."):] for k, _ in model.named_parameters()]
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
            "adam": lambda ps: torch.optim.Adam(ps, lr=0.05)}[optimizer]
    opt_m, opt_s = make(model.parameters()), make(ser.parameters())
    worst = 0.0

    def err(a, b):
        return ((a.detach() - b.detach()).abs().max() / max(1.0, b.abs().max().item())).item()
    for _ in range(steps):
        opt_m.zero_grad()
        opt_s.zero_grad()
        xs = x.clone().requires_grad_(True)
        ys = ser(xs)
        (ys * w).sum().backward()
        xm = x.clone().requires_grad_(True) if model.is_first else None
        out = model(xm, batch_size=5)
        ((out * w).sum() if model.is_last else out.sum()).backward()
        if model.is_last:
            worst = max(worst, err(out, ys))
        if model.is_first:
            worst = max(worst, err(xm.grad, xs.grad))
        for name in names:
            g = model.stacked.get_parameter(name).grad
            for j, (k, _) in enumerate(_rows(model, name)):
                worst = max(worst, err(g[j], _serial_param(ser, k, name).grad))
        opt_m.step()
        opt_s.step()
    for name in names:
        for k, row in _rows(model, name):
            worst = max(worst, err(row, _serial_param(ser, k, name)))
    worst = comm.allreduce(worst, op=MPI.MAX)
    assert worst <= 1e-12, f"stacked parameters vs serial autograd: {worst:.3g}"
    return f"{worst:.1e}"
