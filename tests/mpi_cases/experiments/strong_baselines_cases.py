"""MPI checks of ``experiments/benchmarks/strong_baselines.py`` and ``torch_pipeline.py``
(2 ranks): gradients and updates against the serial lean loop's closed-form backward (itself
checked against autograd in ``tests/experiments/test_strong_baselines.py``), float64."""
from __future__ import annotations

import torch
from mpi4py import MPI

from experiments.benchmarks.strong_baselines import LeanDataParallel, LeanOptim, random_lean
from experiments.benchmarks.torch_pipeline import SCHEDULES, TorchPipeline

N, W, B = 8, 3, 8


def _serial_grads(lean, x):
    out = lean.forward_store(x)
    lean.backward(out * (2.0 / out.numel()))
    return lean.gWT.clone(), lean.gb.clone()


def check_pipeline_gradients(schedules=tuple(SCHEDULES), ms=(2, 4)):
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    x = torch.randn(B, W, dtype=torch.float64)
    for name in schedules:
        for M in ms:
            lean = random_lean(N, W, seed=1, dtype=torch.float64)
            gW, gb = _serial_grads(lean, x)
            pipe = TorchPipeline(lean, comm, name, M, B, kind="sgd", lr=0.0)
            pipe.step(x)
            for i, (dW, db) in pipe.gradients().items():
                lo, hi = pipe.bounds[i], pipe.bounds[i + 1]
                e = max(float((dW - gW[lo:hi]).abs().max() / gW[lo:hi].abs().max()),
                        float((db - gb[lo:hi]).abs().max() / gb[lo:hi].abs().max()))
                assert e < 1e-12, f"{name} M={M} stage {i}: relative gradient error {e:.3g}"


def check_lean_data_parallel(kinds=("sgd", "adam")):
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    xs = [torch.randn(B, W, dtype=torch.float64) for _ in range(3)]
    for kind in kinds:
        ref = LeanOptim(random_lean(N, W, seed=2, dtype=torch.float64), kind, lr=0.05)
        dp = LeanDataParallel(random_lean(N, W, seed=2, dtype=torch.float64), comm, B, kind,
                              lr=0.05)
        for x in xs:
            ref.step(x)
            dp.step(x)
        e = float((dp.inner.net.WT - ref.net.WT).abs().max())
        assert e < 1e-12, f"{kind}: data-parallel weights differ from serial by {e:.3g}"
