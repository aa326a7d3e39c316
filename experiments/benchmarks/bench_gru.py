"""Forward time of a GRU against sequence length: serial baselines vs MGRIT parallel in time.

Moon & Cyr (ICLR 2022) report that parallel-in-time GRU training pays off as sequences grow.
This measures the forward pass (no autograd) of one GRU layer over ``N`` = 128 ... 4,096 steps:

* serial ``nn.GRUCell`` loop (input projection per step, as a user's unrolled loop);
* serial ``nn.GRU`` (input projections in one matmul, fused C++ loop): the strongest serial
  baseline;
* :class:`mgrit.nn.gru.ParallelGRU` on 1 rank (batched relaxation: the ``k``-th steps of all
  CF-intervals are one matmul over ``(B * batch, hidden)``) and on 2 ranks (an
  ``mpiexec -n 2`` subprocess), in inexact mode (fixed cycles, ``tol = 0``), with the relative
  error of ``h_N`` against ``nn.GRU`` so the reader sees what the cycles buy.

**Bound** (as /work/shared/notes/performance.md argues for ResNets): on each rank the solver
records its step work: ``S`` single steps, ``C`` batched calls advancing ``I`` states in all.
With the single-step cost ``tau_s`` and the batched-step cost ``tau_b(B)`` measured here on the
same states (``B = I / C``, the mean states per call), rank ``r``'s step time is
``W_r = S_r tau_s + C_r tau_b(B_r)``; no schedule finishes before ``max_r W_r``, so MGRIT's
speedup over the serial loop of the same step (``N tau_s``) is at most
``N tau_s / max_r W_r``. Messages, solver bookkeeping and waiting in the pipelined coarse solve
come on top: the measured speedup stays below the bound; the bound says whether tuning can help.

Every option's repeats are interleaved (A B C A B C ...; ``--reps``, default 10) and reported as
median [IQR] and min-max with the raw per-repeat times in ``bench_gru.raw.json``, beside the
compiled baselines (``torch.compile(nn.GRU)``: 1 process, rank 0 alone, and data parallelism:
each rank the eager or compiled ``nn.GRU`` on half the batch), every option's speed-up over the
strongest baseline, MGRIT's relative error of ``h_N`` and of the parameter gradient of
``mean(h_N^2)`` (1 rank, the same options), and one verdict sentence per rank count.
``main`` returns per length ``[N, GRUCell ms, nn.GRU ms, N tau_s ms, MGRIT 1 rank ms, nn.GRU /
MGRIT 1 rank, bound 1 rank, MGRIT 2 ranks ms, nn.GRU / MGRIT 2 ranks, bound 2 ranks, err h_N 1
rank, err h_N 2 ranks, gradient err]``. Full mode (6 lengths, 10 repeats, compile):
84 s measured at 48a9d82, 2 idle cores (``results/manifest.json``).

Writes ``<out>/bench_gru.md`` (default ``experiments/results``). ``--smoke``: tiny sizes, two
short lengths, seconds (run by tests/nn/test_gru.py). Do not trust timings on a loaded machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "benchmarks"  # default results base folder
from experiments.benchmarks import baselines_common as bc  # noqa: E402
from mgrit.nn.gru import ParallelGRU  # noqa: E402
from mgrit.nn.gru.chains import GRUChain  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.reporting.writers import (add_study_flags, markdown_table, run_metadata,  # noqa: E402
                                   write_raw, write_table)

FULL_LENGTHS = [128, 256, 512, 1024, 2048, 4096]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_study_flags(ap, full_help="the same as the default (lengths 128 ... 4,096)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths")
    ap.add_argument("--batch", type=int, default=16, help="sequences per batch (default 16)")
    ap.add_argument("--input", type=int, default=16, help="input features (default 16)")
    ap.add_argument("--hidden", type=int, default=32, help="hidden size (default 32)")
    ap.add_argument("--cfactor", type=int, default=16, help="coarsening factor (default 16)")
    ap.add_argument("--levels", type=int, default=2, help="MGRIT levels (default 2)")
    ap.add_argument("--relax", default="FCF", help="relaxation (default FCF)")
    ap.add_argument("--iters", type=int, default=2, help="MGRIT cycles, tol = 0 (default 2)")
    ap.add_argument("--reps", type=int, default=10,
                    help="interleaved timed repeats, median [IQR] (default 10)")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the torch.compile baselines (--smoke: always skipped)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--no-two-ranks", action="store_true", help="skip the 2-rank runs")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON path, 2-rank part
    a = ap.parse_args(argv)
    if a.smoke:
        a.lengths = a.lengths or [32, 48]
        a.batch, a.input, a.hidden, a.cfactor, a.reps = 2, 2, 4, 4, 1
        a.no_compile = True
    a.lengths = a.lengths or FULL_LENGTHS
    return a


def median_time(fn, reps, comm=None):
    """Median over ``reps`` of the wall time of ``fn()`` (after one warm-up); with ``comm``,
    each repeat starts at a barrier and counts until the slowest rank is done."""
    fn()
    ts = []
    for _ in range(reps):
        if comm is not None:
            comm.Barrier()
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        ts.append(comm.allreduce(t, op=MPI.MAX) if comm is not None else t)
    return statistics.median(ts)


def steady(fn, comm=None):
    """A timer for :func:`bc.interleave`: one untimed call of ``fn``, then the seconds of one
    timed call (with ``comm``: between barriers, the slowest rank's)."""
    def run():
        fn()
        if comm is not None:
            comm.Barrier()
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        return comm.allreduce(t, op=MPI.MAX) if comm is not None else t
    return run


def compiled_gru(gru, x, enabled):
    """``(torch.compile(gru) or None, note)``; the first call (compilation) on ``x``."""
    if not enabled:
        return None, "not run (--smoke / --no-compile)"
    with torch.no_grad():
        return bc.try_compile(lambda: torch.compile(gru), lambda f: f(x))


def grad_error(a, model, x) -> float:
    """Relative error of the parameter gradient of ``mean(h_N^2)`` through ``model`` (1 rank,
    the MGRIT options of the table, cold start) against autograd of its ``nn.GRU`` twin."""
    gru = model.to_gru()
    (gru(x)[1][0] ** 2).mean().backward()
    exact = [gru.weight_ih_l0.grad, gru.weight_hh_l0.grad, gru.bias_ih_l0.grad, gru.bias_hh_l0.grad]
    params = [model.weight_ih, model.weight_hh, model.bias_ih, model.bias_hh]
    for p in params:
        p.grad = None
    (model(x) ** 2).mean().backward()
    err = bc.grad_error([p.grad for p in params], exact)
    for p in params:
        p.grad = None
    return err


def build(a, comm=None):
    o = MGRITOptions(max_levels=a.levels, cfactor=a.cfactor, relax=a.relax, tol=0.0,
                     max_iter=a.iters)
    torch.manual_seed(0)
    return ParallelGRU(a.input, a.hidden, comm=comm, forward=o, backward=o, warm_start=False)


def inputs(a, n):
    g = torch.Generator().manual_seed(n)
    return torch.randn(a.batch, n, a.input, generator=g)


def step_costs(model, x, sizes, reps):
    """``tau_s`` (one ``GRUChain.step``) and ``tau_b(B)`` for each ``B`` in ``sizes`` on this
    rank's slice of ``x`` (seconds)."""
    n = x.shape[1]
    a, e = model.time_slice(n)
    with torch.no_grad():
        gi = torch.nn.functional.linear(x[:, a:e].transpose(0, 1), model.weight_ih, model.bias_ih)
        chain = GRUChain(gi, model.weight_hh.detach(), model.bias_hh.detach(), a, model.coarse)
        h = torch.zeros(x.shape[0], model.hidden_size)
        k = min(64, e - a)
        tau_s = median_time(lambda: [chain.step(h, a + j, a + j + 1, 0) for j in range(k)],
                            reps) / k
        tau_b = {}
        for B in sizes:
            B = max(1, min(int(round(B)), e - a))
            U = torch.zeros(B, x.shape[0], model.hidden_size)
            tau_b[B] = median_time(
                lambda: chain.step_batch(U, range(a, a + B), range(a + 1, a + B + 1), 0), reps)
    return tau_s, tau_b


def step_work(stats, tau_s, tau_b):
    """``W = S tau_s + C tau_b(I / C)`` of one rank's solve (see the module doc)."""
    S, C, I = stats.steps_single, stats.steps_batched_calls, stats.steps_batched_items
    if C == 0:
        return S * tau_s, 0.0
    B = max(1, int(round(I / C)))
    near = min(tau_b, key=lambda b: abs(b - B))
    return S * tau_s + C * tau_b[near], I / C


def worker(a):
    """The 2-rank part (under mpiexec): one JSON list of per-length results on rank 0."""
    comm = MPI.COMM_WORLD
    torch.set_default_dtype(getattr(torch, a.dtype))
    torch.set_num_threads(1)
    out, rank = [], comm.Get_rank()
    comp = {}
    for n in a.lengths:
        model, x = build(a, comm), inputs(a, n)
        gru = model.to_gru()
        shard = x[torch.tensor_split(torch.arange(a.batch), comm.Get_size())[rank]]
        if not comp and not a.no_compile:  # compiled once per process (shapes: recompiled)
            f0, n0 = compiled_gru(model.to_gru(), x, rank == 0)
            n0 = comm.bcast(n0, root=0)
            fd, nd = compiled_gru(model.to_gru(), shard, True)
            got = comm.allgather((fd is not None, nd))
            bad = [m for ok, m in got if not ok]
            comp = {"f0": f0 if not n0.startswith("does not") else None, "n0": n0,
                    "fd": None if bad else fd, "nd": bad[0] if bad else nd}
        with torch.no_grad():
            opts = {"MGRIT 2 ranks": lambda: model(x),
                    "nn.GRU, rank 0 alone": lambda: gru(x) if rank == 0 else None,
                    "data parallel nn.GRU": lambda: gru(shard)}
            if comp.get("f0") is not None or (comp and not comp["n0"].startswith("does not")):
                c0 = comp.get("f0")
                opts["nn.GRU compiled, rank 0 alone"] = lambda: c0(x) if rank == 0 else None
            if comp.get("fd") is not None:
                cd = comp["fd"]
                opts["data parallel nn.GRU compiled"] = lambda: cd(shard)
            times = bc.interleave({k: steady(f, comm) for k, f in opts.items()}, a.reps)
            h = model(x)
        st = model.last_forward.stats
        tau_s, tau_b = step_costs(model, x, [st.steps_batched_items / max(1, st.steps_batched_calls)], 3)
        W, _ = step_work(st, tau_s, tau_b)
        Ws = comm.gather(W, root=0)
        tau0 = comm.bcast(tau_s, root=0)
        h_last = comm.bcast(h if model.is_last else None, root=comm.Get_size() - 1)
        if rank == 0:
            ref = gru(x)[1][0].detach()
            err = float((h_last - ref).norm() / ref.norm())
            out.append(dict(n=n, times=times, W=Ws, tau_s=tau0, err=err, bound=n * tau0 / max(Ws),
                            compile={"rank 0": comp.get("n0", "not run (--smoke / --no-compile)"),
                                     "data parallel": comp.get("nd", "not run (--smoke / --no-compile)")}))
    if comm.Get_rank() == 0:
        Path(a.worker).write_text(json.dumps(out))


def two_ranks(a, argv):
    """Run :func:`worker` on 2 ranks; returns its results by length (empty without mpiexec)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        print("no mpiexec next to the interpreter: skipping the 2-rank runs")
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "two.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        cmd = [str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", str(Path(__file__)),
               *argv, "--worker", str(path)]
        subprocess.run(cmd, env=env, check=True, timeout=3600)
        return {r["n"]: r for r in json.loads(path.read_text())}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    if a.worker:
        return worker(a)
    torch.set_default_dtype(getattr(torch, a.dtype))
    torch.set_num_threads(1)
    meta = run_metadata(["experiments/benchmarks/bench_gru.py", *argv], world_size=1)
    two = {} if a.no_two_ranks else two_ranks(a, argv)
    rows, ret, samples, sections, v1, v2 = [], [], {}, [], [], []
    comp, note = None, None
    for n in a.lengths:
        model, x = build(a), inputs(a, n)
        gru = model.to_gru()
        if note is None:  # compiled once (another length: a fast recompile)
            comp, note = compiled_gru(model.to_gru(), x, not a.no_compile)
        cell = nn.GRUCell(a.input, a.hidden)
        cell.load_state_dict({k: v for k, v in model.state_dict().items()})
        gerr = grad_error(a, model, x)
        with torch.no_grad():
            def cell_loop():
                h = torch.zeros(a.batch, a.hidden)
                for t in range(n):
                    h = cell(x[:, t], h)
                return h
            opts = {"GRUCell loop": cell_loop, "nn.GRU": lambda: gru(x),
                    **({"nn.GRU compiled": lambda: comp(x)} if comp is not None else {}),
                    "MGRIT 1 rank": lambda: model(x)}
            T = bc.interleave({k: steady(f) for k, f in opts.items()}, a.reps)
            ref = gru(x)[1][0]
            h1 = model(x)
        st = model.last_forward.stats
        tau_s, tau_b = step_costs(model, x, [st.steps_batched_items / max(1, st.steps_batched_calls)], 3)
        W1, _ = step_work(st, tau_s, tau_b)
        err1 = float((h1 - ref).norm() / ref.norm())
        r2 = two.get(n)
        series = dict(T)
        if r2:
            series.update(r2["times"])
        samples.update({f"N={n} {k}": v for k, v in series.items()})
        base = ["GRUCell loop", "nn.GRU", "nn.GRU compiled", "nn.GRU, rank 0 alone",
                "nn.GRU compiled, rank 0 alone", "data parallel nn.GRU",
                "data parallel nn.GRU compiled"]
        errs = {"MGRIT 1 rank": f"{err1:.1e} (h_N); gradient {gerr:.1e}",
                "MGRIT 2 ranks": f"{r2['err']:.1e} (h_N); gradient {gerr:.1e} (1 rank, same options)"
                if r2 else "-"}
        lines, best, sp = bc.timing_table(series, base, errors=errs, err_head="error",
                                          default_err="exact")
        sections += [f"### N = {n}", "", *lines, "",
                     f"Bound vs the chain loop: 1 rank {n * tau_s / W1:.2f}x"
                     + (f", 2 ranks {r2['bound']:.2f}x" if r2 else "") + ".", ""]
        v1.append((f"N = {n}", sp["MGRIT 1 rank"]))
        if r2:
            v2.append((f"N = {n}", sp["MGRIT 2 ranks"]))
        rows.append([n, *(1e3 * statistics.median(series[k]) if k in series else "-" for k in
                          ["GRUCell loop", "nn.GRU", "nn.GRU compiled", "MGRIT 1 rank", "MGRIT 2 ranks"]),
                     sp["MGRIT 1 rank"], sp.get("MGRIT 2 ranks", "-"), err1, gerr])
        md = {k: statistics.median(v) for k, v in series.items()}
        ret.append([n, 1e3 * md["GRUCell loop"], 1e3 * md["nn.GRU"], 1e3 * n * tau_s,
                    1e3 * md["MGRIT 1 rank"], md["nn.GRU"] / md["MGRIT 1 rank"], n * tau_s / W1,
                    1e3 * md["MGRIT 2 ranks"] if r2 else "-",
                    md["nn.GRU"] / md["MGRIT 2 ranks"] if r2 else "-", r2["bound"] if r2 else "-",
                    err1, r2["err"] if r2 else "-", gerr])
        print(f"N={n}: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.2f} ms" for k, v in series.items()))
    header = ["N", "GRUCell loop (ms)", "nn.GRU (ms)", "nn.GRU compiled (ms)", "MGRIT 1 rank (ms)",
              "MGRIT 2 ranks (ms)", "MGRIT 1 rank vs strongest", "MGRIT 2 ranks vs strongest",
              "rel. err h_N", "rel. err gradient"]
    setup = (f"batch {a.batch}, input {a.input}, hidden {a.hidden}, {a.dtype}, one thread per "
             f"rank; MGRIT forward: {a.levels} levels, cfactor {a.cfactor}, {a.relax}, "
             f"{a.iters} cycles (tol 0, inexact), coarse 'power', no warm start. {a.reps} "
             f"interleaved repeats (A B C A B C ...; each timed call right after an untimed one "
             f"of the same option): median [IQR] and min-max, raw per-repeat times in "
             f"`bench_gru.raw.json`. Baselines: the GRUCell loop, nn.GRU and its torch.compile "
             f"(1 process), and on the 2 ranks of the MGRIT run: nn.GRU eager/compiled on rank 0 "
             f"alone and data parallelism (each rank nn.GRU eager/compiled on half the batch; a "
             f"forward: no gradient to average). \"vs strongest\" = median of the fastest "
             f"baseline (1 and 2 ranks together) / median of the option (> 1: faster). Errors: "
             f"relative error of h_N against nn.GRU, and of the parameter gradient of "
             f"mean(h_N^2) (MGRIT forward and adjoint with the same options, cold start) "
             f"against nn.GRU's autograd, {a.dtype}. torch.compile: {note}"
             + (f"; 2 ranks: {next(iter(two.values()))['compile']}" if two else "") + ".")
    body = "\n\n".join([
        setup,
        bc.verdict("MGRIT on 1 rank", v1) + (" " + bc.verdict("MGRIT on 2 ranks", v2) if v2 else ""),
        "Bound: `N tau_s / max_r W_r` with `W_r = S_r tau_s + C_r tau_b(I_r / C_r)` from the "
        "solver's step counts on each rank and the step costs measured here (see the script's "
        "docstring): the best MGRIT can do over the serial loop of the same step, before "
        "messages and bookkeeping.",
        "## Summary (medians)", markdown_table(header, rows), "## Per length", "\n".join(sections)])
    out = Path(a.out) if a.out else OUT
    out.mkdir(parents=True, exist_ok=True)
    write_table(out / "bench_gru.md", "GRU forward: serial vs MGRIT parallel in time", meta, body)
    write_raw(out / "bench_gru.raw.json", samples, meta)
    print(f"wrote {out / 'bench_gru.md'}")
    return ret


if __name__ == "__main__":
    main()
