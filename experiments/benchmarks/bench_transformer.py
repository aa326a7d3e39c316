"""Benchmark: the forward of one rank's 16 transformer layers, batched vs a per-layer loop.

What is timed (float32, ``torch.set_num_threads(1)``, ``torch.no_grad()``, default-initialised
``TransformerStep(d_model, heads)`` layers with ``heads = max(1, d_model // 16)``, d_ff = 4 d_model;
encoder unless ``--causal``):

* loop: ``torch.stack([steps[b](x[b]) for b in range(L)])``, what the solver does without a
  batched kernel (``Propagator.step_batch``'s default); ``x`` is ``(L, batch, tokens, d_model)``;
* batched: ``steps[0].forward_batched(p, x)`` with the ``L`` layers' parameters stacked in ``p``
  (what ``mgrit.nn.chains`` calls in concurrent relaxation);
* o, the fixed cost of one per-layer call: ``TransformerStep(H, H, d_ff=H)`` (same number of
  heads ``H``, one feature per head) on a ``(1, 1, H)`` input -- every op is dispatched and
  allocated, next to nothing is computed; o_b likewise for a batched call of ``L`` such layers.

Each size runs R repeats; a repeat times the four calls back to back (the order of loop and
batched alternates between repeats), each over an inner count that makes its block last about
25 ms. speedup = the median over repeats of ``t_loop / t_batched``; times are medians.

The bound (``../shared/notes/performance.md``: on one CPU core batching removes per-call
overhead, not compute). With ``t = t_loop / L`` the per-layer call:

* ``bound = L t / (t_batched - G o_b)``: the speedup if the batched call cost only its compute
  (its measured time less its fixed cost: o_b for each of its G layer groups, see
  ``TransformerStep.chunk_elements``). ``speedup / bound = 1 - G o_b / t_batched`` says how much
  of the batched call is still overhead.
* ``t / (t - o)``: the speedup of a batched call with no overhead that computed exactly as
  fast as the loop's per-layer kernels. Batching can beat it: its larger kernels can compute
  faster, reported as ``inflation = (t_batched - G o_b) / (L (t - o))`` (< 1: the batched kernels
  need less time than the per-layer ones for the same work, > 1: more), and o (one tiny call)
  does not capture per-call costs that grow with the size (allocations, per-sequence setup).

Acceptance (issue 15): speedup >= 2 where per-call overhead dominates (here: ``o / t >= 1/2``),
and speedup near the bound elsewhere.

Two more tables time the batched call with each projection kernel of
``mgrit.nn.steps.transformer.LINEAR_KERNELS`` (``TransformerStep.linear_kernel``) and with each layer
group budget ``TransformerStep.chunk_elements`` (``forward_batched`` applies the layers in groups
whose largest intermediate stays within it; "all" = one group), interleaved the same way over
``max(3, R // 2)`` repeats, so that the defaults can be checked on the machine at hand.

Against the strongest serial baseline (issue 24, item 3): the same repeats also time the loop
with each layer ``torch.compile``'d (regional compilation; ``--no-compile`` or ``--smoke`` skip
it, a compile error is reported by its first line); a table gives loop, compiled loop and
batched call as median [IQR] (and the batched call's min-max), the batched call's speed-up over
the faster of the two serial loops, its error against the loop (exact up to round-off: no
MGRIT cycles here), and a verdict sentence; the raw per-repeat seconds per call are in
``bench_transformer.raw.json``. Data parallelism does not apply (one process times one rank's
layers). Full mode: 12 sizes, 10 repeats: 136 s (2 min) measured at 48a9d82, 2 idle cores
(``results/manifest.json``).

Writes ``experiments/results/benchmarks/bench_transformer.md`` (``--out DIR``: ``DIR/bench_transformer.md``).
Usage: ``OMP_NUM_THREADS=1 python experiments/benchmarks/bench_transformer.py [--smoke] [--causal]
[--repeats R] [--no-compile] [--out DIR]``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "benchmarks"  # default results base folder
from experiments.benchmarks import baselines_common as bc  # noqa: E402
from mgrit.nn.steps.transformer import LINEAR_KERNELS, TransformerStep  # noqa: E402
from mgrit.reporting.writers import markdown_table, run_metadata, write_raw, write_table  # noqa: E402

LAYERS = 16
CHUNKS = {"2^16": 2 ** 16, "2^18": 2 ** 18, "2^20": 2 ** 20, "all": 2 ** 62}
#: (d_model, tokens, batch): d_model 16..128, tokens 8..64, batch 4..64.
SIZES = [(16, 8, 4), (16, 16, 16), (16, 64, 64), (32, 8, 4), (32, 32, 16), (32, 64, 64),
         (64, 8, 4), (64, 16, 64), (64, 64, 16), (128, 8, 4), (128, 32, 16), (128, 64, 64)]
SMOKE_SIZES = [(16, 8, 4), (32, 4, 2)]
DOMINATED = 0.5  # o / t at or above which per-call overhead "dominates" a per-layer call


def heads_for(d_model: int) -> int:
    return max(1, d_model // 16)


def _stack(steps) -> dict:
    return {n: torch.stack([s.get_parameter(n).detach() for s in steps])
            for n, _ in steps[0].named_parameters()}


def _per_call(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def _inner(fn, block: float) -> int:
    """Calls per timed block so that a block lasts about ``block`` seconds (after a warm-up)."""
    fn()
    return max(1, math.ceil(block / max(_per_call(fn, 1), 1e-7)))


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _variants(module, attr: str, values: dict, fn, inner: int, repeats: int) -> dict:
    """Median time of ``fn`` with ``module.<attr>`` set to each of ``values`` (label -> value),
    interleaved over ``repeats`` (rotating order); the attribute is reset afterwards."""
    times = {k: [] for k in values}
    names = list(values)
    try:
        for r in range(repeats):
            for k in names[r % len(names):] + names[:r % len(names)]:
                setattr(module, attr, values[k])
                times[k].append(_per_call(fn, inner))
    finally:
        vars(module).pop(attr, None)  # back to the class default
    return {k: statistics.median(v) for k, v in times.items()}


def _groups(module, budgets: dict, batch: int, tokens: int, layers: int) -> dict:
    """Layers per group of ``forward_batched`` under each budget (label -> layers)."""
    out = {}
    try:
        for k, v in budgets.items():
            module.chunk_elements = v
            out[k] = min(layers, module.layer_group(batch, tokens))
    finally:
        vars(module).pop("chunk_elements", None)
    return out


def measure(d: int, tokens: int, batch: int, layers: int, repeats: int, block: float,
            causal: bool, compile_: bool = False) -> dict:
    """Times of one size (seconds) and the derived speedup, bound and kernel times."""
    H = heads_for(d)
    torch.manual_seed(0)
    steps = [TransformerStep(d, H, causal=causal) for _ in range(layers)]
    tiny = [TransformerStep(H, H, d_ff=H, causal=causal) for _ in range(layers)]
    p, pt = _stack(steps), _stack(tiny)
    x = torch.randn(layers, batch, tokens, d)
    xt = torch.randn(layers, 1, 1, H)
    template = steps[0]
    calls = {
        "loop": lambda: torch.stack([s(x[b]) for b, s in enumerate(steps)]),
        "batched": lambda: template.forward_batched(p, x),
        "o": lambda: tiny[0](xt[0]),
        "o_b": lambda: tiny[0].forward_batched(pt, xt),
    }
    note = "not run (--smoke / --no-compile)"
    if compile_:  # regional compilation: one graph of the layer, reused by all 16
        csteps, note = bc.try_compile(lambda: [torch.compile(s) for s in steps],
                                      lambda cs: [c(x[b]) for b, c in enumerate(cs)])
        if csteps is not None:
            calls["compiled"] = lambda: torch.stack([c(x[b]) for b, c in enumerate(csteps)])
    diff = _rel(calls["batched"](), calls["loop"]())
    inner = {k: _inner(f, block) for k, f in calls.items()}
    times = {k: [] for k in calls}
    ratios = []
    comp = ["compiled"] if "compiled" in calls else []
    for r in range(repeats):
        order = (["loop", *comp, "batched", "o", "o_b"] if r % 2 == 0
                 else ["batched", *comp, "loop", "o_b", "o"])
        for k in order:
            times[k].append(_per_call(calls[k], inner[k]))
        ratios.append(times["loop"][-1] / times["batched"][-1])
    variant_repeats = max(3, repeats // 2)
    kern = _variants(template, "linear_kernel", {k: k for k in LINEAR_KERNELS},
                     calls["batched"], inner["batched"], variant_repeats)
    chunk = _variants(template, "chunk_elements", CHUNKS, calls["batched"], inner["batched"],
                      variant_repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    t = med["loop"] / layers
    c = max(t - med["o"], 1e-3 * t)  # (noise can make t - o <= 0 at the tiniest sizes)
    n_groups = -(-layers // template.layer_group(batch, tokens))  # the batched call pays its fixed cost once per group
    cb = max(med["batched"] - n_groups * med["o_b"], 1e-3 * med["batched"])
    speedup = statistics.median(ratios)
    bound = layers * t / cb
    strongest, sp = bc.speedups({k: times[k] for k in ("loop", *comp, "batched")},
                                ["loop", *comp])
    return dict(d_model=d, tokens=tokens, batch=batch, heads=H, t_layer=t,
                t_batched=med["batched"], n_groups=n_groups, speedup=speedup,
                ratio_min=min(ratios),
                ratio_max=max(ratios), o=med["o"], o_b=med["o_b"], share=med["o"] / t,
                bound=bound, efficiency=speedup / bound, same_compute_bound=t / c,
                inflation=cb / (layers * c), max_rel_diff=diff,
                kernels=kern, chunks=chunk, times=times, compile=note,
                strongest=strongest, vs_strongest=sp["batched"],
                groups=_groups(template, CHUNKS, batch, tokens, layers))


def _tables(rows: list[dict], layers: int) -> str:
    us = 1e6
    main = markdown_table(
        ["d_model", "tokens", "batch", "heads", "per-layer call t (us)",
         f"batched / {layers} (us)", "speedup (median)", "speedup range", "o (us)", "o / t",
         "o_b (us)", "G", "bound", "speedup / bound", "t/(t-o)", "inflation", "max rel diff"],
        [[r["d_model"], r["tokens"], r["batch"], r["heads"], r["t_layer"] * us,
          r["t_batched"] / layers * us, r["speedup"], f"{r['ratio_min']:.3g}-{r['ratio_max']:.3g}",
          r["o"] * us, r["share"], r["o_b"] * us, r["n_groups"], r["bound"], r["efficiency"],
          r["same_compute_bound"], r["inflation"],
          f"{r['max_rel_diff']:.1e}"] for r in rows])
    kern_rows, kern = _variant_table(rows, "kernels", list(LINEAR_KERNELS))
    chunk_rows, chunk = _variant_table(rows, "chunks", list(CHUNKS))
    dom = [r for r in rows if r["share"] >= DOMINATED]
    rest = [r for r in rows if r["share"] < DOMINATED]
    timing = markdown_table(
        ["d_model", "tokens", "batch", "loop [ms]: median [IQR]", "compiled loop [ms]: median [IQR]",
         "batched [ms]: median [IQR]", "batched: min-max [ms]", "batched vs strongest (which)",
         "error (batched vs loop)"],
        [[r["d_model"], r["tokens"], r["batch"], bc.cell(r["times"]["loop"], 1e3),
          bc.cell(r["times"]["compiled"], 1e3) if "compiled" in r["times"] else "-",
          bc.cell(r["times"]["batched"], 1e3),
          f"{min(r['times']['batched']) * 1e3:.4g}-{max(r['times']['batched']) * 1e3:.4g}",
          f"{r['vs_strongest']:.2f}x ({'compiled loop' if r['strongest'] == 'compiled' else 'loop'})",
          f"{r['max_rel_diff']:.1e} (exact up to round-off)"] for r in rows])
    notes = sorted({r["compile"] for r in rows})
    verdict = bc.verdict("The batched call (what layer-parallel relaxation runs)",
                         [(f"{r['d_model']}/{r['tokens']}/{r['batch']}", r["vs_strongest"]) for r in rows],
                         "the faster of the per-layer loop and its torch.compile")
    lines = [f"Forward of {layers} layers, float32, 1 thread. speedup = median over repeats of "
             f"t_loop / t_batched; t = t_loop / {layers}; o = a per-layer call on a tiny input "
             f"(fixed per-call cost), o_b the same for a batched call, G its layer groups; bound "
             f"= {layers} t / (t_batched - G o_b); inflation = (t_batched - G o_b) / "
             f"({layers} (t - o)); max rel "
             f"diff = max|batched - loop| / max|loop|. See the module docstring of "
             f"experiments/benchmarks/bench_transformer.py for exactly what is timed.",
             ""]
    if dom:
        worst = min(dom, key=lambda r: r["speedup"])
        lines.append(f"- Overhead-dominated sizes (o / t >= {DOMINATED:.2f}): {len(dom)}; lowest "
                     f"speedup {worst['speedup']:.3g} at d_model {worst['d_model']}, tokens "
                     f"{worst['tokens']}, batch {worst['batch']} (target >= 2: "
                     f"{'met' if worst['speedup'] >= 2 else 'NOT met'}).")
    if rest:
        effs = [r["efficiency"] for r in rest]
        lines.append(f"- Other sizes: {len(rest)}; speedup / bound from {min(effs):.3g} to "
                     f"{max(effs):.3g} (median {statistics.median(effs):.3g}).")
    for label, rows_, attr in [("projection kernel", kern_rows, "linear_kernel"),
                               ("layer group budget", chunk_rows, "chunk_elements")]:
        counts = {}
        for r in rows_:
            counts[r[-1]] = counts.get(r[-1], 0) + 1
        lines.append(f"- Fastest {label} per size (sizes won): {counts}; default "
                     f"`TransformerStep.{attr} = {getattr(TransformerStep, attr)!r}`.")
    groups = "; ".join(f"{r['d_model']}/{r['tokens']}/{r['batch']}: "
                       + ", ".join(f"{k} -> {g}" for k, g in r["groups"].items()) for r in rows)
    return ("\n".join(lines) + "\n\n## Against the strongest serial baseline\n\n"
            + "Every call timed over the same interleaved repeats (loop, compiled loop, batched, "
            + "o, o_b; the order reversed every other repeat); median [IQR], raw per-repeat "
            + "seconds per call in `bench_transformer.raw.json`. Compiled loop: "
            + "`torch.compile` of each layer (regional compilation: one graph reused by the 16 "
            + "layers). vs strongest = median of the faster of loop / compiled loop / median "
            + "of the batched call (> 1: faster). One process times one rank's layers: data "
            + "parallelism does not apply here, and every option is exact (no MGRIT cycles). "
            + "torch.compile: " + "; ".join(notes) + ".\n\n" + verdict + "\n\n" + timing
            + "\n\n## Batched vs per-layer loop\n\n" + main
            + "\n\n## Batched call by projection kernel (ms)\n\n" + kern
            + "\n\n## Batched call by layer group budget chunk_elements (ms)\n\n" + chunk
            + f"\n\nLayers per group (d_model/tokens/batch: budget -> group): {groups}.\n")


def _variant_table(rows: list[dict], key: str, names: list[str]) -> tuple[list, str]:
    """Rows ``[d_model, tokens, batch, ms per variant..., fastest]`` and their markdown."""
    out = []
    for r in rows:
        best = min(r[key], key=r[key].get)
        out.append([r["d_model"], r["tokens"], r["batch"], *[r[key][k] * 1e3 for k in names],
                    best])
    return out, markdown_table(["d_model", "tokens", "batch", *names, "fastest"], out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="two tiny sizes, 2 repeats (seconds)")
    ap.add_argument("--causal", action="store_true", help="causal (decoder) layers")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per size (default 10)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers of the rank (default 16)")
    ap.add_argument("--out", default=None, help="results folder (default experiments/results)")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the compiled loop (--smoke: always skipped)")
    args = ap.parse_args(argv)
    if args.layers < 1 or (args.repeats is not None and args.repeats < 1):
        ap.error("--layers and --repeats must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    repeats = args.repeats or (2 if args.smoke else 10)
    meta = run_metadata(["experiments/benchmarks/bench_transformer.py", *(sys.argv[1:] if argv is None
                                                                 else argv)])
    block = 0.001 if args.smoke else 0.025
    rows = []
    try:
        with torch.no_grad():
            for d, tokens, batch in sizes:
                r = measure(d, tokens, batch, args.layers, repeats, block, args.causal,
                            not (args.smoke or args.no_compile))
                rows.append(r)
                print(f"d_model {d:4d} tokens {tokens:3d} batch {batch:3d}: speedup "
                      f"{r['speedup']:.2f} (bound {r['bound']:.2f}, t/(t-o) "
                      f"{r['same_compute_bound']:.2f}, o/t {r['share']:.2f}, inflation "
                      f"{r['inflation']:.2f}, diff {r['max_rel_diff']:.1e})", flush=True)
    finally:
        torch.set_num_threads(threads)
    meta.update(torch=torch.__version__, threads=1, layers=args.layers, repeats=repeats,
                causal=args.causal)
    out = Path(args.out) if args.out else OUT
    out.mkdir(parents=True, exist_ok=True)
    write_table(out / "bench_transformer.md", "Transformer layers: batched vs per-layer forward",
                meta, _tables(rows, args.layers))
    write_raw(out / "bench_transformer.raw.json",
              {f"{r['d_model']}/{r['tokens']}/{r['batch']} {k}": v for r in rows
               for k, v in r["times"].items()}, meta)
    return rows


if __name__ == "__main__":
    main()
