"""Benchmark: the cost of the fast paths' per-call contract check (:mod:`mgrit.nn.chains.contract`).

Every forward of a :class:`~mgrit.nn.resnet.LayerParallelResNet` compares the fingerprint of its
step modules (``Fingerprint.same`` and ``Fingerprint.hooked``, plus the autocast state) with
the one its fast paths were built from, and every MGRIT backward compares it again. This
script times it three ways, on one process (``torch.set_num_threads(1)``), for dense tanh steps
of width 8, batch 64, float32, N = 256 and 4096 layers, MGRIT with 2 levels, cfactor 4,
inexact training settings (2 forward / 1 adjoint cycles, ``tol = 0``):

* ``check``: the check alone (``same()`` + ``hooked()`` + autocast), the median of R repeats
  of a block of calls;
* ``forward``: one ``torch.no_grad()`` forward, with the check on (as shipped) and off (the
  instance's ``_check_contract``/``_serial_reason`` replaced by no-ops);
* ``train step``: ``zero_grad``, forward, backward, ``SGD.step``, on and off.

On and off alternate within every repeat (the order flips between repeats), so that the load of
a shared machine hits both alike; the tables give the median over R repeats, the spread
(interquartile range) of each, and the difference of the medians next to the check's own time.

Writes ``experiments/results/benchmarks/fingerprint_overhead.md`` and, beside it, every
per-repeat time in seconds with its median, quartiles and min/max
(``fingerprint_overhead.raw.json``, :func:`mgrit.reporting.writers.write_raw`; series
``N=<n>/<what>``); ``--out DIR``.
Usage: ``OMP_NUM_THREADS=1 python experiments/benchmarks/bench_fingerprint.py [--repeats R] [--smoke]``.
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
from mgrit.nn import DenseStep, LayerParallelResNet  # noqa: E402
from mgrit.nn.chains.contract import autocast_enabled  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.reporting.writers import markdown_table, run_metadata, write_raw, write_table  # noqa: E402

WIDTH, BATCH = 8, 64


def _model(n: int) -> LayerParallelResNet:
    fwd = MGRITOptions(max_levels=2, cfactor=4, tol=0, max_iter=2)
    bwd = MGRITOptions(max_levels=2, cfactor=4, tol=0, max_iter=1)
    return LayerParallelResNet.build(lambda k: DenseStep(WIDTH, "tanh"), n, (WIDTH,),
                                     forward=fwd, backward=bwd)


def _switch(model, on: bool) -> None:
    """The shipped check (``on``) or no-ops in its place (instance attributes)."""
    for name in ("_check_contract", "_serial_reason"):
        if on:
            model.__dict__.pop(name, None)
        else:
            model.__dict__[name] = lambda: None


def bench(n: int, repeats: int) -> dict:
    """Per-repeat seconds of ``check`` (one call), ``forward on|off`` and ``train on|off`` at
    N = ``n`` layers: ``{series: [repeats floats]}`` in the order measured."""
    torch.manual_seed(0)
    model = _model(n)
    fp = model._fingerprint
    x = torch.randn(BATCH, WIDTH)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def forward():
        with torch.no_grad():
            model(x)

    def train():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    def check():
        fp.same()
        fp.hooked()
        autocast_enabled(model.device)

    for f in (forward, train, train):  # warm-up (first calls allocate and import)
        f()
    inner = max(1, int(0.02 / max(1e-7, _once(check))))
    out = {"check": [], "forward on": [], "forward off": [], "train on": [], "train off": []}
    for r in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            check()
        out["check"].append((time.perf_counter() - t0) / inner)
        for what, f in (("forward", forward), ("train", train)):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                _switch(model, on)
                out[f"{what} {'on' if on else 'off'}"].append(_once(f))
        _switch(model, True)
    return out


def _once(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=21, help="interleaved repeats (default 21)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 4096], help="layer counts N")
    ap.add_argument("--smoke", action="store_true", help="N = 64, 3 repeats (a quick run)")
    ap.add_argument("--out", default=str(OUT), help="results folder")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.repeats = [64], 3
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} is not allowed: use an int >= 1")
    torch.set_num_threads(1)
    meta = run_metadata(sys.argv if argv is None else ["bench_fingerprint.py", *argv])
    samples = {f"N={n}/{k}": v for n in args.sizes for k, v in bench(n, args.repeats).items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "fingerprint_overhead_smoke" if args.smoke else "fingerprint_overhead"
    stats = write_raw(out / f"{name}.raw.json", samples, meta, unit="s")
    rows = []
    for n in args.sizes:
        r = {k.split("/", 1)[1]: v for k, v in stats.items() if k.startswith(f"N={n}/")}
        chk = r["check"]["median"] * 1e3
        for what in ("forward", "train"):
            on, off = r[f"{what} on"], r[f"{what} off"]
            diff = (on["median"] - off["median"]) * 1e3
            rows.append([n, "forward (no_grad)" if what == "forward" else "train step",
                         on["median"] * 1e3, on["iqr"] * 1e3, off["median"] * 1e3,
                         off["iqr"] * 1e3, diff, chk * (2 if what == "train" else 1),
                         100 * chk * (2 if what == "train" else 1) / (off["median"] * 1e3)])
    header = ["N", "what", "on: median ms", "on: IQR ms", "off: median ms", "off: IQR ms",
              "on - off ms", "checks alone ms", "checks / step %"]
    body = (f"Dense tanh steps, width {WIDTH}, batch {BATCH}, float32, one process, one thread; "
            f"MGRIT 2 levels, cfactor 4, 2 forward / 1 adjoint cycles; {args.repeats} "
            f"interleaved repeats. 'checks alone': the fingerprint check timed by itself "
            f"(once per forward; a train step checks twice: forward and backward).\n\n"
            + markdown_table(header, rows) + f"\n\nRaw per-repeat seconds: `{name}.raw.json`.\n")
    write_table(out / f"{name}.md", "Cost of the fast paths' per-call contract check", meta, body)
    print((out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
