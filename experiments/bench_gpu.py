"""Layer-parallel MGRIT vs serial propagation on one GPU (one process).

On a GPU a serial ResNet forward of N tiny layers is N dependent kernel launches; MGRIT with
concurrent (batched) relaxation replaces the F-sweeps by m-1 launches over N/m intervals each
(Kirby et al. 2020 used one CUDA stream per block for the same effect). This script measures,
side by side in one run, for each configuration: serial forward (no autograd), MGRIT forward
(2 levels, relax F, 2 iterations), serial training step (autograd), MGRIT training step
(2 forward / 1 backward iterations), after checking that a converged float64 MGRIT solve on CUDA
equals serial stepping on the CPU.

Usage: ``python experiments/bench_gpu.py [--out DIR] [--quick]`` (skips without CUDA).
Writes ``bench_gpu.md`` to ``--out`` (default ``experiments/results``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from mgrit.nn import DenseStep, LayerParallelResNet, make_step  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.training import report as reporting  # noqa: E402


def timed(fn, dev, repeats):
    fn()
    torch.cuda.synchronize(dev)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def correctness(dev):
    """Converged float64 MGRIT on CUDA vs serial stepping on the CPU (relative error)."""
    opts = MGRITOptions(max_levels=3, cfactor=4, tol=1e-12, max_iter=60)
    lp = LayerParallelResNet.build(lambda k: DenseStep(8, "tanh").double(), 256, (8,),
                                   forward=opts, backward=opts, T=4.0)
    x = torch.randn(16, 8, dtype=torch.float64)
    ref_net = lp.to_serial()
    xr = x.clone().requires_grad_(True)
    ref = ref_net(xr)
    ref.square().sum().backward()
    lp = lp.to(dev)
    xg = x.to(dev).requires_grad_(True)
    y = lp(xg)
    y.square().sum().backward()
    err_y = ((y.cpu() - ref).norm() / ref.norm()).item()
    err_g = ((xg.grad.cpu() - xr.grad).norm() / xr.grad.norm()).item()
    return err_y, err_g, lp.last_forward.iterations


def bench(dev, n, width, batch, m, repeats):
    fwd = MGRITOptions(max_levels=2, cfactor=m, relax="F", tol=0, max_iter=2)
    bwd = MGRITOptions(max_levels=2, cfactor=m, relax="F", tol=0, max_iter=1)
    lp = LayerParallelResNet.build(lambda k: make_step("dense", width, "tanh"), n, (width,),
                                   forward=fwd, backward=bwd, warm_start=False)
    ser = lp.to_serial().to(dev)
    lp = lp.to(dev)
    x = torch.randn(batch, width, device=dev)

    def fs():
        with torch.no_grad():
            ser(x)

    def fm():
        with torch.no_grad():
            lp(x)

    def ts():
        ser.zero_grad()
        ser(x).square().sum().backward()

    def tm():
        lp.zero_grad()
        lp(x).square().sum().backward()

    t = {k: timed(f, dev, repeats) for k, f in (("fs", fs), ("fm", fm), ("ts", ts), ("tm", tm))}
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--quick", action="store_true", help="fewer configurations and repeats")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return
    dev = "cuda:0"
    meta = reporting.run_metadata()
    meta["device"] = torch.cuda.get_device_name(0) + f", torch {torch.__version__}"
    err_y, err_g, its = correctness(dev)
    print(f"float64 CUDA MGRIT vs CPU serial: output {err_y:.2e}, input grad {err_g:.2e} ({its} cycles)")
    configs = [(1024, 8, 64, 32), (4096, 8, 64, 64)] if args.quick else [
        (1024, 8, 64, 32), (4096, 8, 64, 16), (4096, 8, 64, 64), (4096, 64, 256, 64),
        (16384, 8, 64, 128)]
    rows = []
    for n, width, batch, m in configs:
        t = bench(dev, n, width, batch, m, 3 if args.quick else 5)
        row = [n, width, batch, m, t["fs"] * 1e3, t["fm"] * 1e3, t["fs"] / t["fm"],
               t["ts"] * 1e3, t["tm"] * 1e3, t["ts"] / t["tm"]]
        print(row, flush=True)
        rows.append(row)
    body = (f"Correctness: float64, N = 256, 3 levels, converged MGRIT on CUDA vs serial on CPU: "
            f"output rel. error {err_y:.2e}, input-gradient rel. error {err_g:.2e}.\n\n"
            "Speed: float32, dense tanh steps, MGRIT 2 levels, relax F, 2 forward / 1 backward "
            "iterations (inexact), median of repeats, CUDA-synchronized wall clock.\n\n"
            + reporting.markdown_table(
                ["N", "width", "batch", "m", "serial fwd [ms]", "MGRIT fwd [ms]", "fwd speedup",
                 "serial train [ms]", "MGRIT train [ms]", "train speedup"], rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reporting.write_table(out / "bench_gpu.md", "Layer-parallel MGRIT vs serial on one GPU", meta, body)
    print(f"wrote {out / 'bench_gpu.md'}")


if __name__ == "__main__":
    main()
