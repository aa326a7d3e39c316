"""The 2-rank part of ``experiments/benchmarks/bench_layerparallel.py`` (run by it as
``mpiexec -n 2 python -m mpi4py experiments/benchmarks/bench_layerparallel_ranks.py --layers N --m M ...``).

Per repeat, interleaved, wall clock (max over ranks after a barrier): the training step of
MGRIT (2 levels, warm start), the 1-level exact path, the lean loop on rank 0 alone (rank 1
waits in a barrier: T3's reference), lean data parallelism, nn.Sequential data parallelism
(GradientBuckets), the blocking chain (nn.Sequential and lean stages), GPipe (lean stages,
M = 2, 4, 8), and ``torch pipeline``: ``torch.distributed.pipelining`` over gloo (GPipe, 1F1B,
ZBV with M = 2, 4, 8; the fastest median of 2 pilot steps enters the repeats, every
candidate's time is in the JSON: issue 34 item 2); the forward of MGRIT (cold), the nn.Sequential chain and the lean loop on rank 0;
then the model's calibration on both ranks at once. Also: the ping-pong fit and a measured
chain of messages against it, operation counts, memory. Writes JSON to ``--out`` (rank 0).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))

from experiments.benchmarks import baselines_common as bc  # noqa: E402
from experiments.benchmarks import torch_pipeline as tp  # noqa: E402
from experiments.benchmarks.bench_layerparallel import (  # noqa: E402
    BATCH, LR, WIDTH, calibrate_repeat, loss_fn, lp_forward_cold, lp_state_bytes, lp_train_step,
    make_lp, make_serial, mgrit_grad_error, saved_bytes)
from mgrit import perf  # noqa: E402
from mgrit.parallel.gradbuckets import GradientBuckets  # noqa: E402
from mgrit.perf.baselines import GPipe, LeanDataParallel, LeanStage, ModuleStage  # noqa: E402
from mgrit.perf.lean import LeanResNet, compiled_forward, compiled_train_step  # noqa: E402

MS = (2, 4, 8)


def message_chain(comm, nbytes, hops=200):
    """Seconds of ``hops`` messages of ``nbytes`` sent one after the other between ranks 0 and 1
    (each waits for the previous): the chain term of the blocking chain / GPipe fill."""
    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)
    r = comm.Get_rank()
    comm.Barrier()
    t0 = time.perf_counter()
    for h in range(hops):
        if h % 2 == r:
            comm.Send(buf, 1 - r, 5)
        else:
            comm.Recv(buf, 1 - r, 5)
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / hops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--m", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cal-repeats", type=int, default=3)
    ap.add_argument("--relax", default="F")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compile", action="store_true",
                    help="also the compiled baselines: torch.compile of the lean loop on rank 0 "
                         "alone, and compiled lean data parallelism (N divisible by 16)")
    a = ap.parse_args()
    N, m = a.layers, a.m
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, first, last = comm.Get_rank(), comm.Get_rank() == 0, comm.Get_rank() == 1
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    full = make_serial(N)  # every rank: the data-parallel replicas and rank 0's lean loop
    lp = make_lp(N, m, comm=comm, relax=a.relax)
    exact = make_lp(N, comm=comm)
    lo, n = lp.first, len(lp.steps)
    seq = torch.nn.Sequential(*list(lp.to_serial())[lo:lo + n])
    lean_full, lean_dp = LeanResNet.from_sequential(full), LeanResNet.from_sequential(full)
    lean_stage = LeanStage(LeanResNet.from_sequential(seq))
    dp_net = make_serial(N)
    buckets = GradientBuckets(dp_net.parameters(), comm)
    shard = x[torch.tensor_split(torch.arange(BATCH), 2)[rank]]
    mean_sq = lambda o, j, rows: (o ** 2).sum() / (BATCH * WIDTH)  # noqa: E731
    chain_mod = GPipe(ModuleStage(seq, (WIDTH,), first=first), comm, 1)
    chain_lean = GPipe(lean_stage, comm, 1)
    pipes = {M: GPipe(lean_stage, comm, M) for M in MS}
    dp_lean = LeanDataParallel(lean_dp, comm)
    o_c, o_l, o_e, o_d = (torch.optim.SGD(p, LR) for p in
                          (seq.parameters(), lp.parameters(), exact.parameters(), dp_net.parameters()))
    buf = torch.empty(BATCH, WIDTH)

    def chain_forward():
        with torch.no_grad():
            if first:
                comm.Send(seq(x).numpy(), 1, 11)
            else:
                comm.Recv(buf.numpy(), 0, 11)
                seq(buf)

    def pipe_step(pipe, opt=None):
        pipe.step(x if first else None, BATCH, mean_sq, validate=False)
        if opt is None:
            lean_stage.step(LR)
        else:
            opt.step()

    def dp_seq():
        buckets.zero_grad()
        loss_fn(dp_net(shard)).backward()
        buckets.average()
        o_d.step()

    def alone(fn):  # rank 0 runs fn, rank 1 waits in the barrier that ends the timing
        if first:
            fn()

    def sync_time(fn):  # steady state (bench_layerparallel.steady): an untimed call first
        fn()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        comm.Barrier()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    comp, comp_fwd, notes = {}, {}, {}
    if a.compile:
        fn = ffn = note = fnote = None
        if first:  # serial compiled on rank 0 alone; rank 1 waits for its note
            lean_c, lean_f = LeanResNet.from_sequential(full), LeanResNet.from_sequential(full)
            fn, note = bc.try_compile(lambda: compiled_train_step(lean_c, 16),
                                      lambda f: f(x, 0.0))
            ffn, fnote = bc.try_compile(lambda: compiled_forward(lean_f, 16), lambda f: f(x))
        notes["compiled_r0"], notes["compiled_fwd_r0"] = comm.bcast((note, fnote), root=0)
        if first and fn is not None or not first and not notes["compiled_r0"].startswith("does not"):
            comp["compiled_r0"] = lambda f=fn: alone(lambda: f(x, LR))
        if first and ffn is not None or not first and not notes["compiled_fwd_r0"].startswith("does not"):
            comp_fwd["compiled_fwd_r0"] = lambda f=ffn: alone(lambda: f(x))
        dfn, notes["dp_compiled"] = bc.compile_lean_dp(LeanResNet.from_sequential(full), comm, shard, 16)
        if dfn is not None:
            comp["dp_compiled"] = lambda f=dfn: f(shard, LR)
    tpipes = {}
    for cand in [(s_, M) for s_ in ("GPipe", "1F1B", "ZBV") for M in MS]:
        pipe = tp.TorchPipeline(LeanResNet.from_sequential(full), comm, cand[0], cand[1], BATCH,
                                "sgd", LR, momentum=0.0)
        pipe.step(x)
        tpipes[cand] = (pipe, float(np.median([sync_time(lambda p=pipe: p.step(x))
                                               for _ in range(2)])))
    tbest = min(tpipes, key=lambda c: tpipes[c][1])
    comp["torch pipeline"] = lambda p=tpipes[tbest][0]: p.step(x)
    notes["torch pipeline"] = (f"{tbest[0]} M={tbest[1]} (fastest of " + ", ".join(
        f"{c[0]} M={c[1]}: {t * 1e3:.3g} ms" for c, (_, t) in tpipes.items()) + ")")
    gerr = {"cold": mgrit_grad_error(lp, x, cold=True, comm=comm)}
    train = {"mgrit": lambda: lp_train_step(lp, x, o_l), "exact1": lambda: lp_train_step(exact, x, o_e),
             "lean_r0": lambda: alone(lambda: lean_full.train_step(x, LR)),
             **comp, "dp_lean": lambda: dp_lean.train_step(shard, BATCH * WIDTH, LR), "dp_seq": dp_seq,
             "chain_seq": lambda: pipe_step(chain_mod, o_c), "chain_lean": lambda: pipe_step(chain_lean),
             **{f"gpipe M={M}": (lambda p=p: pipe_step(p)) for M, p in pipes.items()}}
    fwd = {"mgrit_fwd": lambda: lp_forward_cold(lp, x), "chain_fwd": chain_forward,
           "lean_fwd_r0": lambda: alone(lambda: lean_full.forward(x)), **comp_fwd}
    for p in [chain_mod, chain_lean, *pipes.values()]:
        p.step(x if first else None, BATCH, mean_sq)  # validated once
    for fn in [*train.values(), *fwd.values()]:
        fn()  # warm-up

    res = {k: [] for k in [*train, *fwd]}
    cals = []
    ping = perf.pingpong(comm, (8, BATCH * WIDTH * 4, 1 << 16))
    chain_msg = message_chain(comm, BATCH * WIDTH * 4)
    for _ in range(a.repeats):
        for k, fn in train.items():
            res[k].append(sync_time(fn))
        for k, fn in fwd.items():
            res[k].append(sync_time(fn))
        fstats = lp.last_forward.stats.as_dict()
        comm.Barrier()  # calibration on both ranks at once, as MGRIT, GPipe and DP run
        clk = time.perf_counter
        t0 = clk()
        o_l.step()
        t_opt = clk() - t0
        cals.append(calibrate_repeat(lp, exact, seq, x, m, clk, lean_stage.net, a.cal_repeats,
                                     t_opt))
    gerr["warm"] = mgrit_grad_error(lp, x, cold=False, comm=comm)
    mem = [saved_bytes(lambda: pipe_step(chain_mod, o_c))]
    lp_train_step(lp, x, o_l)
    mem.append(saved_bytes(lambda: lp(x if first else None, batch_size=BATCH)) + lp_state_bytes(lp))
    out = dict(times=res, stats=comm.gather(fstats, root=0), cal=comm.gather(cals, root=0),
               mem=comm.gather(mem, root=0), comm=[ping.latency, ping.bandwidth],
               chain_msg=chain_msg, ms=list(MS), N=N, m=m, gerr=gerr, compile=notes)
    if rank == 0:
        Path(a.out).write_text(json.dumps(out))
    comm.Barrier()


if __name__ == "__main__":
    main()
