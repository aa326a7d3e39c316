"""Planner CLI: recommend MGRIT settings for a dense ResNet and predict scaling (mgrit.perf).

    python experiments/plan.py --layers 4096 --width 8 --batch 64 --ranks 64

Calibrates step costs on this machine (a short run on ``--calib-layers`` layers, 1 thread),
then prints the recommendation (m, L, iterations) for ``--ranks`` and the predicted training-step
times and speedups for P = 1, 2, 4, ..., 1024. Message cost: ``--latency``/``--bandwidth``
(defaults: a nominal interconnect, 10 us and 10 GB/s; the oversubscribed 2-core measurement of
bench_layerparallel is far worse and reflects scheduling, not the network).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mgrit import perf  # noqa: E402
from mgrit.nn import DenseStep, LayerParallelResNet, serial_resnet  # noqa: E402
from mgrit.nn.chains import AdjointChain  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402


def _med(fn, reps=5):
    ts = []  # CPU time of this one-thread process: robust on a shared machine
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        ts.append(time.process_time() - t0)
    return statistics.median(ts)


def calibrate(width: int, batch: int, n: int = 256, act: str = "tanh") -> perf.TrainCosts:
    """Measured costs of one DenseStep ResNet layer (serial autograd and MGRIT chains)."""
    torch.set_num_threads(1)
    x = torch.randn(batch, width)
    net = serial_resnet(lambda k: DenseStep(width, act), n)
    lp = LayerParallelResNet.build(lambda k: DenseStep(width, act), n, (width,),
                                   forward=MGRITOptions(max_levels=2, cfactor=4, tol=0, max_iter=1))
    with torch.no_grad():
        sf = _med(lambda: net(x)) / n
    out = net(x)
    sb = _med(lambda: (out ** 2).mean().backward(retain_graph=True)) / n
    lp(x)
    ch, u1 = lp._chain, torch.randn(batch, width)
    adj = AdjointChain(ch, n, lp._states)
    B = lambda c: (lambda k: c.step_batch(torch.randn(k, batch, width), list(range(k)),  # noqa: E731
                                          list(range(1, k + 1)), 0))
    with torch.no_grad():
        fwd = perf.calibrate_step(lambda: ch.step(u1, 0, 1, 0), B(ch), repeats=3, inner=5,
                                  clock=time.process_time)
        adjc = perf.calibrate_step(lambda: adj.step(u1, 0, 1, 0), B(adj), repeats=3, inner=5,
                                  clock=time.process_time)
    lam = torch.randn(n, batch, width)
    pg = _med(lambda: adj.parameter_gradients(lam, True), 3) / n
    opt = torch.optim.SGD(lp.parameters(), 1e-3)
    for p in lp.parameters():
        p.grad = torch.zeros_like(p)
    return perf.TrainCosts(fwd, adjc, sf, sb, pgrad_item=pg, per_layer=_med(opt.step, 3) / n,
                           nbytes=batch * width * x.element_size(), refresh=_med(ch.refresh, 3) / n)


def main(argv=None):
    ap = argparse.ArgumentParser(description="MGRIT planner (mgrit.perf cost model): calibrates "
                                 "step costs on this machine, recommends m, L and iterations, and "
                                 "prints predicted scaling up to P = 1024",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--layers", type=int, required=True, help="N, residual layers")
    ap.add_argument("--width", type=int, default=8, help="state width of the dense steps")
    ap.add_argument("--batch", type=int, default=64, help="mini-batch size")
    ap.add_argument("--ranks", type=int, required=True, help="P, layer-parallel ranks to plan for")
    ap.add_argument("--act", default="tanh", choices=("tanh", "relu", "smoothrelu"),
                    help="activation of the steps")
    ap.add_argument("--kf", type=int, default=2, help="forward MGRIT iterations")
    ap.add_argument("--kb", type=int, default=1, help="adjoint MGRIT iterations")
    ap.add_argument("--relax", default="F", help="relaxation: F, FCF, FCFCF, ...")
    ap.add_argument("--latency", type=float, default=10e-6, help="message latency [s]")
    ap.add_argument("--bandwidth", type=float, default=10e9, help="message bandwidth [bytes/s]")
    ap.add_argument("--calib-layers", type=int, default=256,
                    help="layers of the network used to calibrate step costs")
    a = ap.parse_args(argv)
    if a.ranks < 1 or a.layers < a.ranks:
        ap.error(f"--layers {a.layers} must be >= --ranks {a.ranks} >= 1")
    for name in ("width", "batch", "kf", "kb", "calib_layers"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)} is not allowed: use an int >= 1")
    if not (a.latency >= 0 and a.bandwidth > 0):
        ap.error(f"--latency={a.latency} / --bandwidth={a.bandwidth} are not allowed: use "
                 f"latency >= 0 and bandwidth > 0")
    from mgrit.options import relaxation_sweeps
    try:
        relaxation_sweeps(a.relax)
    except ValueError as e:
        ap.error(f"--relax: {e}")
    costs = calibrate(a.width, a.batch, a.calib_layers, a.act)
    comm = perf.CommCost(a.latency, a.bandwidth)
    kw = dict(K_f=a.kf, K_b=a.kb, relax=a.relax)
    print(f"calibrated per step: forward single {costs.fwd.single * 1e6:.1f} us, batched "
          f"{costs.fwd.call * 1e6:.1f} us/call + {costs.fwd.item * 1e6:.2f} us/interval; adjoint "
          f"single {costs.adj.single * 1e6:.1f} us; serial autograd {costs.serial_fwd * 1e6:.1f} + "
          f"{costs.serial_bwd * 1e6:.1f} us/layer; message {comm.message(costs.nbytes) * 1e6:.1f} us")
    p = perf.plan(a.layers, a.ranks, costs, comm, **kw)
    t = p.times
    print(f"\nrecommendation for N={a.layers}, P={a.ranks}: max_levels={p.levels}, cfactor={p.cfactor}, "
          f"relax={p.relax}, forward iterations {p.K_f}, backward iterations {p.K_b} (tol=0, warm start)")
    print(f"predicted training step: MGRIT {t['mgrit']['train'] * 1e3:.2f} ms, serial "
          f"{t['serial']['train'] * 1e3:.2f} ms, layer-wise MP {t['layerwise']['train'] * 1e3:.2f} ms, "
          f"pipelined (M=4) {t['pipelined']['train'] * 1e3:.2f} ms -> {p.speedup_vs_layerwise:.1f}x over "
          f"layer-wise, {p.speedup_vs_serial:.1f}x over serial")
    print("\n|    P |   m | L | MGRIT fwd ms | MGRIT train ms | layer-wise ms | pipelined ms | vs layer-wise | vs serial |")
    print("|-----:|----:|--:|-----:|-----:|-----:|-----:|-----:|-----:|")
    for q in perf.scaling_table(a.layers, costs, comm, **kw):
        t = q.times
        print(f"| {q.P:4d} | {q.cfactor:3d} | {q.levels} | {t['mgrit']['forward'] * 1e3:8.2f} | "
              f"{t['mgrit']['train'] * 1e3:8.2f} | {t['layerwise']['train'] * 1e3:8.2f} | "
              f"{t['pipelined']['train'] * 1e3:8.2f} | {q.speedup_vs_layerwise:6.1f}x | {q.speedup_vs_serial:6.1f}x |")
    print("\nIteration counts are inputs (not predicted): inexact training as in TorchBraid (2/1); "
          "check the residual history (LayerParallelResNet.last_forward.residuals) on the real net.")


if __name__ == "__main__":
    main()
