"""In-process correctness on a device (one process, float64, exact MGRIT solves to 1e-13):
called by ``gpu_session.py``. Each check returns the worst relative error (loss, every gradient,
every running statistic after 3 SGD steps; outputs in evaluation mode) of a layer-parallel
network on ``dev`` against an independent reference:

* ``converged``: ``bench_gpu.correctness`` (N = 256, 3 levels, output and input gradient) vs
  serial stepping on the CPU;
* ``bn_dense``, ``bn_conv``, ``bn_variants``: BatchNorm steps (the MPI test cases' steps,
  ``tests/mpi_cases/nn/stateful_cases.py``) vs the independently built serial network trained by
  autograd on the CPU;
* ``dropout``, ``vit_dropout``: Dropout/DropPath steps vs the serial network on the same device
  (the masks come from a generator on the tensors' device, so a CPU run draws other masks);
* ``tied``: every layer one step module (``tie=lambda k: 0``) vs ``to_serial()`` on the CPU.
"""
from __future__ import annotations

import torch
from mpi4py import MPI
from torch.nn import functional as F

from mgrit.nn import DenseStep, LayerParallelResNet
from mgrit.options import MGRITOptions
from tests.mpi_cases.nn import stateful_cases as sc

__all__ = ["run_checks"]

STEPS = 3


def _rel(a, b):
    a, b = a.detach().cpu(), b.detach().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-4))


def _stateful(kind, dev):
    """Layer-parallel (P = 1, 2 levels) on ``dev`` vs serial on the CPU (BatchNorm) or on
    ``dev`` (dropout: the device's generator draws the masks)."""
    torch.set_default_dtype(torch.float64)
    net, ser, in_shape = sc._nets(kind, MPI.COMM_SELF)
    ref_dev = dev if kind in ("dropout", "vit") else torch.device("cpu")
    net, ser = net.to(dev), ser.to(ref_dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ser.parameters(), lr=0.1)
    worst = 0.0
    for i, (x, y) in enumerate(sc._batches(in_shape, 6, STEPS)):
        for o in (opt, ropt):
            o.zero_grad(set_to_none=True)
        torch.manual_seed(100 + i)
        lr_ = F.cross_entropy(ser(x.to(ref_dev)), y.to(ref_dev))
        lr_.backward()
        torch.manual_seed(100 + i)
        loss = net.loss(net(x.to(dev)), y.to(dev))
        loss.backward()
        worst = max(worst, abs(loss.item() - lr_.item()) / abs(lr_.item()))
        ref = dict(ser.named_parameters())
        for key, p in net.named_global_parameters():
            worst = max(worst, _rel(p.grad, ref[key].grad))
        sd, rsd = net.gather_state_dict(), ser.state_dict()
        for key, v in rsd.items():
            if key.endswith("num_batches_tracked"):
                worst = max(worst, 0.0 if int(sd[key]) == int(v) else 1.0)
            else:
                worst = max(worst, _rel(sd[key], v))
        opt.step()
        ropt.step()
    net.eval()
    ser.eval()
    x = sc._batches(in_shape, 5, 1, seed=99)[0][0]
    with torch.no_grad():
        worst = max(worst, _rel(net(x.to(dev)), ser(x.to(ref_dev))))
    torch.set_default_dtype(torch.float32)
    return {"rel_err": worst, "reference": f"serial autograd on {ref_dev.type}"}


def _tied(dev, n=16, width=4):
    """Weight-tied layers: gradients summed over every application."""
    opts = MGRITOptions(max_levels=2, cfactor=4, tol=1e-13, max_iter=60)
    lp = LayerParallelResNet.build(lambda k: DenseStep(width, "tanh").double(), n, (width,),
                                   forward=opts, backward=opts, seed=1, tie=lambda k: 0)
    ser = lp.to_serial()
    lp = lp.to(dev)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, width, dtype=torch.float64, generator=g)
    ser(x).square().sum().backward()
    lp(x.to(dev)).square().sum().backward()
    worst = _rel(lp(x.to(dev)), ser(x))
    ref = dict(ser.named_parameters())
    for key, p in lp.named_parameters():
        k = next(k for k in ref if k.endswith(key.split(".", 2)[-1]) and ref[k].shape == p.shape)
        worst = max(worst, _rel(p.grad, ref[k].grad))
    return {"rel_err": worst, "reference": "to_serial() autograd on cpu",
            "n_params_lp": sum(1 for _ in lp.parameters()),
            "n_params_serial": sum(1 for _ in ser.parameters())}


def run_checks(dev, log, tol=1e-10):
    """All checks; each ``{"rel_err", "reference", "pass"}`` or ``{"error"}``."""
    from experiments.benchmarks import bench_gpu
    out = {}
    checks = [("converged", lambda: dict(zip(("out_rel_err", "grad_rel_err", "cycles"),
                                              bench_gpu.correctness(dev, 256))))]
    names = {"dense": "bn_dense", "conv": "bn_conv", "bnvar": "bn_variants", "dropout": "dropout",
             "vit": "vit_dropout"}
    checks += [(names[k], (lambda k=k: _stateful(k, dev))) for k in names]
    checks.append(("tied", lambda: _tied(dev)))
    for name, fn in checks:
        try:
            r = fn()
            if "rel_err" not in r:
                r["rel_err"] = max(r["out_rel_err"], r["grad_rel_err"])
                r["reference"] = "serial stepping on cpu"
            r["pass"] = r["rel_err"] <= tol
        except Exception as e:  # noqa: BLE001 -- reported as a failure
            r = {"error": f"{type(e).__name__}: {str(e)[:400]}", "pass": False}
        finally:
            torch.set_default_dtype(torch.float32)
        out[name] = r
        log(f"[check] {name}: {r}")
    return out
