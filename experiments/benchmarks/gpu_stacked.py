"""MGRIT training step with stacked-leaf parameters on one GPU (one process).

Measures, for the dense tanh ResNet of ``gpu_concurrency.py`` (batch 64, float32, 2 levels,
relax F, 2 forward / 1 adjoint cycles, no warm start; m = 32 at N = 1024, 64 at N = 4096), the
training step (forward, ``mean(out^2)``, backward, ``SGD(foreach=True)``) of:

* ``mgrit_layer``: ``LayerParallelResNet`` with one leaf per layer and name (the old step);
* ``mgrit_stacked``: ``LayerParallelResNet(stacked_parameters=True)`` (one leaf per name);
* ``serial_eager``: the ``nn.Sequential`` of ``to_serial()``;
* ``lean_graph``: ``mgrit.perf.LeanResNet``'s training step captured in a CUDA graph (the
  strongest serial of ``gpu_session.json``; CUDA only).

The two MGRIT variants are timed twice, interleaved (layer, stacked, layer, stacked), so the
table shows their spread. Every time is a CUDA-event median after warm-up
(:func:`gpu_concurrency.timeit`, host clock on a CPU). Before timing, a float64 check: the
stacked model's gradients (per name, ``(N, *shape)``) against the per-layer model's, the same
weights and input, on the device (tolerance 1e-10, relative in the 2-norm).

Usage: ``python experiments/benchmarks/gpu_stacked.py --out DIR [--device cpu]`` (``cpu``:
tiny sizes, to check the code paths); writes ``DIR/gpu_stacked.json`` and ``DIR/gpu_stacked.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from experiments.benchmarks.gpu_concurrency import LR, _graph, _rel, _train, timeit  # noqa: E402
from experiments.benchmarks.gpu_session import provenance  # noqa: E402
from mgrit.nn import LayerParallelResNet, make_step  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.perf.lean import LeanResNet  # noqa: E402
from mgrit.reporting import writers  # noqa: E402

GRAD_TOL = 1e-10


def build(n, width, m, dev, stacked, dtype=torch.float32, seed=0, levels=2):
    """The MGRIT model (``stacked_parameters=stacked``) on ``dev`` in ``dtype``; the same
    weights for both values of ``stacked``."""
    fwd = MGRITOptions(max_levels=levels, cfactor=m, relax="F", tol=0, max_iter=2)
    bwd = MGRITOptions(max_levels=levels, cfactor=m, relax="F", tol=0, max_iter=1)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        lp = LayerParallelResNet.build(lambda k: make_step("dense", width, "tanh"), n, (width,),
                                       forward=fwd, backward=bwd, warm_start=False, seed=seed,
                                       stacked_parameters=stacked)
    finally:
        torch.set_default_dtype(old)
    return lp.to(dev)


def grad_check(n, width, m, dev, batch=64):
    """Float64: one forward + backward of both models; the relative difference of each
    name's stacked gradient and of the loss."""
    layer = build(n, width, m, dev, False, torch.float64)
    stacked = build(n, width, m, dev, True, torch.float64)
    torch.manual_seed(1)
    x = torch.randn(batch, width, dtype=torch.float64).to(dev)
    losses = []
    for net in (layer, stacked):
        loss = net(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
    got = dict(stacked.named_parameters())
    names = [nm for nm, _ in layer.steps[0].named_parameters()]
    errs = {}
    for nm in names:
        want = torch.stack([dict(s.named_parameters())[nm].grad for s in layer.steps])
        errs[nm] = _rel(got["stacked." + nm].grad, want)
    return {"N": n, "width": width, "m": m, "dtype": "float64", "grad_rel_err": errs,
            "loss_rel_err": _rel(losses[1], losses[0]), "max_rel_err": max(errs.values()),
            "tol": GRAD_TOL, "pass": max(errs.values()) <= GRAD_TOL}


def bench(n, width, m, dev, batch, log):
    """Training-step times of every variant of one configuration."""
    layer, stacked = build(n, width, m, dev, False), build(n, width, m, dev, True)
    ser = layer.to_serial().to(dev)
    torch.manual_seed(1)
    x = torch.randn(batch, width).to(dev)
    row = {"N": n, "width": width, "batch": batch, "m": m, "train": {}, "checks": {}}
    T, C = row["train"], row["checks"]
    with torch.no_grad():
        ref = ser(x)
        C["mgrit_fwd_rel_err"] = _rel(layer(x), ref)
        C["stacked_vs_layer_fwd_rel_err"] = _rel(stacked(x), layer(x))
    steps = {"mgrit_layer": _train(layer, torch.optim.SGD(layer.parameters(), lr=LR, foreach=True), x),
             "mgrit_stacked": _train(stacked, torch.optim.SGD(stacked.parameters(), lr=LR, foreach=True), x)}
    C["leaves"] = {"mgrit_layer": len(list(layer.parameters())),
                   "mgrit_stacked": len(list(stacked.parameters()))}
    for rnd in (1, 2):  # interleaved A B A B: the spread between rounds
        for name, fn in steps.items():
            T[f"{name}_{rnd}"] = timeit(fn, dev)
            log(f"  {name} round {rnd}: {T[f'{name}_{rnd}']['median_s'] * 1e3:.2f} ms")
    T["serial_eager"] = timeit(_train(ser, torch.optim.SGD(ser.parameters(), lr=LR, foreach=True), x), dev)
    log(f"  serial_eager: {T['serial_eager']['median_s'] * 1e3:.2f} ms")
    if dev.type == "cuda":
        lean = LeanResNet.from_sequential(ser.cpu())
        lean = LeanResNet(*(t.to(dev) for t in lean.weights()), lean.h, lean.act)
        try:
            g, _ = _graph(lambda: lean.train_step(x, LR), dev)
            T["lean_graph"] = timeit(g.replay, dev)
            log(f"  lean_graph: {T['lean_graph']['median_s'] * 1e3:.2f} ms")
        except Exception as e:  # noqa: BLE001 -- reported, not hidden
            C["lean_graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def _ms(stats):
    return f"{stats['median_s'] * 1e3:.3g} ({stats['q1_s'] * 1e3:.3g}-{stats['q3_s'] * 1e3:.3g})"


def table(res):
    """Markdown: the training-step medians (quartiles) in ms and the ratios."""
    lines = ["| N | width | m | serial eager | lean graph | MGRIT per-layer (r1 / r2) | "
             "MGRIT stacked (r1 / r2) | stacked / per-layer | stacked vs lean graph |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        T = r["train"]
        lay = min(T["mgrit_layer_1"]["median_s"], T["mgrit_layer_2"]["median_s"])
        stk = min(T["mgrit_stacked_1"]["median_s"], T["mgrit_stacked_2"]["median_s"])
        lg = T.get("lean_graph")
        lines.append(
            f"| {r['N']} | {r['width']} | {r['m']} | {_ms(T['serial_eager'])} | "
            f"{_ms(lg) if lg else '-'} | {_ms(T['mgrit_layer_1'])} / {_ms(T['mgrit_layer_2'])} | "
            f"{_ms(T['mgrit_stacked_1'])} / {_ms(T['mgrit_stacked_2'])} | {stk / lay:.2f} | "
            f"{lg['median_s'] / stk:.2f}x |" if lg else
            f"| {r['N']} | {r['width']} | {r['m']} | {_ms(T['serial_eager'])} | - | "
            f"{_ms(T['mgrit_layer_1'])} / {_ms(T['mgrit_layer_2'])} | "
            f"{_ms(T['mgrit_stacked_1'])} / {_ms(T['mgrit_stacked_2'])} | {stk / lay:.2f} | - |")
    lines += ["", "| gradient check (float64) | max relative difference | loss | tolerance | pass |",
              "|---|---|---|---|---|"]
    for c in res["grad_checks"]:
        lines.append(f"| N = {c['N']}, width {c['width']}, m = {c['m']} | {c['max_rel_err']:.2g} | "
                     f"{c['loss_rel_err']:.2g} | {c['tol']:g} | {c['pass']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("FAIL: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    quick = dev.type == "cpu"
    configs = ([(64, 8, 4), (64, 4, 8)] if quick else
               [(1024, 8, 32), (1024, 32, 32), (4096, 8, 64), (4096, 32, 64)])
    t0, meta = time.time(), provenance(dev)
    res = {"meta": meta, "torch": torch.__version__, "batch": args.batch, "rows": [],
           "grad_checks": [],
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(s):
        print(s, flush=True)
    for n, width, m in ([(32, 8, 4)] if quick else [(1024, 8, 32), (1024, 32, 32)]):
        res["grad_checks"].append(grad_check(n, width, m, dev, args.batch))
        log(f"[grad] N={n} w={width}: {res['grad_checks'][-1]['max_rel_err']:.2e}")
    for n, width, m in configs:
        log(f"[bench] N={n} width={width} batch={args.batch} m={m}")
        res["rows"].append(bench(n, width, m, dev, args.batch, log))
        (out / "gpu_stacked.json").write_text(json.dumps(res, indent=1))
    res["wall_s"] = time.time() - t0
    res["meta"] = writers.finish_metadata(meta)
    (out / "gpu_stacked.json").write_text(json.dumps(res, indent=1))
    (out / "gpu_stacked.md").write_text(table(res))
    print(table(res))
    print(f"wrote {out / 'gpu_stacked.json'} in {res['wall_s']:.0f} s")
    return 0 if all(c["pass"] for c in res["grad_checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
