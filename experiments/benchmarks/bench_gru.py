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
from mgrit.nn.gru import ParallelGRU  # noqa: E402
from mgrit.nn.gru.chains import GRUChain  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.training.report import (add_study_flags, markdown_table, run_metadata,  # noqa: E402
                                   write_table)

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
    ap.add_argument("--reps", type=int, default=5, help="timed repeats, median (default 5)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--no-two-ranks", action="store_true", help="skip the 2-rank runs")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON path, 2-rank part
    a = ap.parse_args(argv)
    if a.smoke:
        a.lengths = a.lengths or [32, 48]
        a.batch, a.input, a.hidden, a.cfactor, a.reps = 2, 2, 4, 4, 1
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


def run_mgrit(a, model, x, comm=None):
    """Time the forward on this rank's communicator; returns (time, W_r, mean batch, h_N)."""
    with torch.no_grad():
        t = median_time(lambda: model(x), a.reps, comm)
        h = model(x)
    st = model.last_forward.stats
    mean_b = st.steps_batched_items / max(1, st.steps_batched_calls)
    tau_s, tau_b = step_costs(model, x, [mean_b], a.reps)
    W, _ = step_work(st, tau_s, tau_b)
    return t, W, tau_s, h


def worker(a):
    """The 2-rank part (under mpiexec): one JSON list of per-length results on rank 0."""
    comm = MPI.COMM_WORLD
    torch.set_default_dtype(getattr(torch, a.dtype))
    torch.set_num_threads(1)
    out = []
    for n in a.lengths:
        model, x = build(a, comm), inputs(a, n)
        t, W, tau_s, h = run_mgrit(a, model, x, comm)
        Ws = comm.gather(W, root=0)
        tau0 = comm.bcast(tau_s, root=0)
        h_last = comm.bcast(h if model.is_last else None, root=comm.Get_size() - 1)
        if comm.Get_rank() == 0:
            ref = model.to_gru()(x)[1][0].detach()
            err = float((h_last - ref).norm() / ref.norm())
            out.append(dict(n=n, time=t, W=Ws, tau_s=tau0, err=err,
                            bound=n * tau0 / max(Ws)))
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
    two = {} if a.no_two_ranks else two_ranks(a, argv)
    rows = []
    for n in a.lengths:
        model, x = build(a), inputs(a, n)
        gru = model.to_gru()
        cell = nn.GRUCell(a.input, a.hidden)
        cell.load_state_dict({k: v for k, v in model.state_dict().items()})
        with torch.no_grad():
            def cell_loop():
                h = torch.zeros(a.batch, a.hidden)
                for t in range(n):
                    h = cell(x[:, t], h)
                return h
            t_cell = median_time(cell_loop, a.reps)
            t_gru = median_time(lambda: gru(x), a.reps)
            ref = gru(x)[1][0]
        t1, W1, tau_s, h1 = run_mgrit(a, model, x)
        err1 = float((h1 - ref).norm() / ref.norm())
        r2 = two.get(n)
        rows.append([n, 1e3 * t_cell, 1e3 * t_gru, 1e3 * n * tau_s, 1e3 * t1,
                     t_gru / t1, n * tau_s / W1,
                     1e3 * r2["time"] if r2 else "-", t_gru / r2["time"] if r2 else "-",
                     r2["bound"] if r2 else "-", err1, r2["err"] if r2 else "-"])
        two_txt = f", 2 ranks {r2['time'] * 1e3:.2f} ms" if r2 else ""
        print(f"N={n}: cell {t_cell * 1e3:.2f} ms, nn.GRU {t_gru * 1e3:.2f} ms, "
              f"MGRIT 1 rank {t1 * 1e3:.2f} ms{two_txt}")
    header = ["N", "GRUCell loop (ms)", "nn.GRU (ms)", "chain loop N*tau_s (ms)",
              "MGRIT 1 rank (ms)", "speedup vs nn.GRU, 1 rank", "bound vs chain loop, 1 rank",
              "MGRIT 2 ranks (ms)", "speedup vs nn.GRU, 2 ranks", "bound vs chain loop, 2 ranks",
              "rel. err h_N, 1 rank", "rel. err h_N, 2 ranks"]
    setup = (f"batch {a.batch}, input {a.input}, hidden {a.hidden}, {a.dtype}, one thread per "
             f"rank; MGRIT forward: {a.levels} levels, cfactor {a.cfactor}, {a.relax}, "
             f"{a.iters} cycles (tol 0), coarse 'power', no warm start; median of {a.reps}.")
    body = "\n\n".join([
        setup,
        "Bound: `N tau_s / max_r W_r` with `W_r = S_r tau_s + C_r tau_b(I_r / C_r)` from the "
        "solver's step counts on each rank and the step costs measured here (see the script's "
        "docstring): the best MGRIT can do over the serial loop of the same step, before "
        "messages and bookkeeping. Speedups are against nn.GRU (the strongest serial baseline).",
        markdown_table(header, rows)])
    out = Path(a.out) if a.out else OUT
    out.mkdir(parents=True, exist_ok=True)
    write_table(out / "bench_gru.md", "GRU forward: serial vs MGRIT parallel in time",
                run_metadata(["experiments/benchmarks/bench_gru.py", *argv], world_size=1), body)
    print(f"wrote {out / 'bench_gru.md'}")
    return rows


if __name__ == "__main__":
    main()
