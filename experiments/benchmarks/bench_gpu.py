"""Layer-parallel MGRIT vs serial propagation on one GPU (one process).

On a GPU a serial ResNet forward of N tiny layers is N dependent kernel launches; MGRIT with
concurrent (batched) relaxation replaces the F-sweeps by m-1 launches over N/m intervals each
(Kirby et al. 2020 used one CUDA stream per block for the same effect). This script measures,
side by side in one run, for each configuration: serial forward (no autograd), MGRIT forward
(2 levels, relax F, 2 iterations), serial training step (autograd), MGRIT training step
(2 forward / 1 backward iterations), after checking that a converged float64 MGRIT solve on CUDA
equals serial stepping on the CPU.

Usage: ``python experiments/benchmarks/bench_gpu.py [--out DIR] [--quick]`` (skips without CUDA).
Writes ``bench_gpu.md`` to ``--out`` (default ``experiments/results``).

``--dry-run`` (alias ``--device cpu``) runs the same code paths on the CPU with tiny sizes and one
repeat, so a test can keep the script from rotting on machines without a GPU; its table is
labeled as a dry run and its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "benchmarks"  # default results base folder

from mgrit.nn import DenseStep, LayerParallelResNet, make_step  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402


def sync(dev):
    """Wait for the device's queued kernels (nothing to wait for on the CPU)."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, repeats):
    fn()
    sync(dev)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def correctness(dev, n=256):
    """Converged float64 MGRIT on ``dev`` vs serial stepping on the CPU (relative error)."""
    opts = MGRITOptions(max_levels=3, cfactor=4, tol=1e-12, max_iter=60)
    lp = LayerParallelResNet.build(lambda k: DenseStep(8, "tanh").double(), n, (8,),
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--quick", action="store_true", help="fewer configurations and repeats")
    ap.add_argument("--device", default="cuda:0", help="cuda:K, or cpu (= --dry-run)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the same code paths on the CPU, tiny sizes, 1 repeat (for tests)")
    args = ap.parse_args(argv)
    dry = args.dry_run or torch.device(args.device).type == "cpu"
    if not dry and not torch.cuda.is_available():
        return reporting.skip("no CUDA device (torch.cuda.is_available() is False)")
    dev = "cpu" if dry else args.device
    meta = reporting.run_metadata()
    meta["device"] = ("cpu (DRY RUN: code-path check, numbers meaningless)" if dry else
                      torch.cuda.get_device_name(dev)) + f", torch {torch.__version__}"
    n_check = 32 if dry else 256
    err_y, err_g, its = correctness(dev, n_check)
    print(f"float64 MGRIT on {dev} vs CPU serial: output {err_y:.2e}, input grad {err_g:.2e} "
          f"({its} cycles)")
    if dry:
        configs, repeats = [(64, 8, 4, 8)], 1
    elif args.quick:
        configs, repeats = [(1024, 8, 64, 32), (4096, 8, 64, 64)], 3
    else:
        configs, repeats = [(1024, 8, 64, 32), (4096, 8, 64, 16), (4096, 8, 64, 64),
                            (4096, 64, 256, 64), (16384, 8, 64, 128)], 5
    rows = []
    for n, width, batch, m in configs:
        t = bench(dev, n, width, batch, m, repeats)
        row = [n, width, batch, m, t["fs"] * 1e3, t["fm"] * 1e3, t["fs"] / t["fm"],
               t["ts"] * 1e3, t["tm"] * 1e3, t["ts"] / t["tm"]]
        print(row, flush=True)
        rows.append(row)
    body = (f"Correctness: float64, N = {n_check}, 3 levels, converged MGRIT on {dev} vs serial on "
            f"CPU: output rel. error {err_y:.2e}, input-gradient rel. error {err_g:.2e}.\n\n"
            "Speed: float32, dense tanh steps, MGRIT 2 levels, relax F, 2 forward / 1 backward "
            "iterations (inexact), median of repeats, device-synchronized wall clock.\n\n"
            + reporting.markdown_table(
                ["N", "width", "batch", "m", "serial fwd [ms]", "MGRIT fwd [ms]", "fwd speedup",
                 "serial train [ms]", "MGRIT train [ms]", "train speedup"], rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = "Layer-parallel MGRIT vs serial on one GPU" + (" (DRY RUN on the CPU)" if dry else "")
    reporting.write_table(out / "bench_gpu.md", title, meta, body)
    print(f"wrote {out / 'bench_gpu.md'}")
    return 0 if err_y < 1e-8 and err_g < 1e-8 else 1


if __name__ == "__main__":
    sys.exit(main())
