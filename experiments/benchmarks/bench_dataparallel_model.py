"""GPipe baseline and cost-model predictions for ``experiments/benchmarks/bench_dataparallel.py``.

* :func:`split` -- the 2-stage split of a model for GPipe: at half of the parameters (GPipe's
  memory balance). For the CNN this puts both convolutions (about 95% of its compute) on stage
  0: no split at module granularity balances its time, so GPipe cannot gain much there.
* :func:`gpipe_throughput` -- P = 2 training steps with :class:`mgrit.perf.baselines.GPipe`
  (autograd stages, ``M`` micro-batches), timed as the data-parallel steps.
* :func:`calibrate` (1-process launch) -- forward and forward+backward of each stage at every
  (micro-)batch size the P = 2 runs use, the optimizer step, per model; :func:`predict` -- the
  P_D = 2 data-parallel step (both stages at the shard size + the Allreduce of all gradients,
  ``mgrit.perf.strategies.allreduce_time`` with the ping-pong's message cost) and the GPipe step
  (``strategies.flow_shop`` of the two stages, forward then backward) from those costs.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

from mgrit import perf
from mgrit.perf.baselines import GPipe, ModuleStage, micro_batch_sizes
from mgrit.perf.strategies import allreduce_time, flow_shop

MS = (1, 4)  # GPipe micro-batches at P = 2 (M = 1: the blocking chain)


def split(model: torch.nn.Sequential) -> int:
    """Index of the first module of stage 1: where the cumulative parameter count crosses half."""
    counts = [sum(p.numel() for p in m.parameters()) for m in model]
    total, acc = sum(counts), 0
    for i, c in enumerate(counts):
        acc += c
        if acc >= total / 2:
            return i + 1
    return len(counts) // 2


def _stages(model):
    k = split(model)
    return torch.nn.Sequential(*list(model)[:k]), torch.nn.Sequential(*list(model)[k:])


def _batch(train, n, seed=0):
    idx = np.random.default_rng(seed).choice(len(train), n, replace=False)
    x, y = train.get_batch(idx)
    return torch.as_tensor(x).reshape(n, -1), torch.as_tensor(y)


def gpipe_throughput(name, make, global_batch, M, comm, train, steps) -> dict:
    """GPipe training (2 stages, ``M`` micro-batches) of ``make()``; median step (max over
    ranks) like the data-parallel runs."""
    rank = comm.Get_rank()
    model = make()
    stage = _stages(model)[rank]
    opt = torch.optim.SGD(stage.parameters(), lr=0.01, momentum=0.9)
    x, y = _batch(train, global_batch)
    in_shape = tuple(x.shape[1:]) if rank == 0 else tuple(_stages(model)[0](x[:1]).shape[1:])
    pipe = GPipe(ModuleStage(stage, in_shape, first=rank == 0), comm, M)
    ce = torch.nn.functional.cross_entropy
    loss = lambda o, j, r: ce(o, y[r]) * (r.stop - r.start) / global_batch  # noqa: E731
    ts = []
    for s in range(steps + 2):
        comm.Barrier()
        t0 = time.perf_counter()
        pipe.step(x if rank == 0 else None, global_batch, loss, validate=s == 0)
        opt.step()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if s >= 2:
            ts.append(dt)
    return {"model": name, "M": M, "step_s": float(np.median(ts)),
            "samples_per_s": global_batch / float(np.median(ts))}


def _med(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def calibrate(name, make, global_batch, train, reps=5) -> dict:
    """Per stage: forward / forward+backward seconds at the shard (``b/2``) and micro-batch
    sizes; the optimizer step of each stage and of the whole model; gradient bytes."""
    model = make()
    s0, s1 = _stages(model)
    x, y = _batch(train, global_batch)
    ce = torch.nn.functional.cross_entropy
    sizes = sorted({-(-global_batch // 2)} | {max(micro_batch_sizes(global_batch, M)) for M in MS})
    out = {"sizes": sizes, "s0_f": [], "s0_fb": [], "s1_f": [], "s1_fb": []}
    for b in sizes:
        xb, yb = x[:b], y[:b]
        with torch.no_grad():
            h = s0(xb)
            out["s0_f"].append(_med(lambda: s0(xb), reps))
            out["s1_f"].append(_med(lambda: ce(s1(h), yb), reps))
        g = torch.randn_like(h)
        out["s0_fb"].append(_med(lambda: s0(xb).backward(g), reps))
        out["s1_fb"].append(_med(lambda: ce(s1(h.detach().requires_grad_(True)), yb).backward(), reps))
        out["state_bytes"] = h[0].numel() * h.element_size()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opts = [torch.optim.SGD(m.parameters(), lr=0.0, momentum=0.9) for m in (s0, s1, model)]
    out["opt0"], out["opt1"], out["opt"] = (_med(o.step, reps) for o in opts)
    out["zero"] = _med(lambda: opts[2].zero_grad(set_to_none=True), reps)
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["model"] = name
    return out


def predict(c: dict, global_batch: int, comm: perf.CommCost) -> dict:
    """Predicted step seconds: ``dp`` (P_D = 2) and ``gpipe M=..`` from :func:`calibrate`."""
    at = lambda key, b: c[key][c["sizes"].index(b)]  # noqa: E731
    shard = -(-global_batch // 2)
    out = {"dp": at("s0_fb", shard) + at("s1_fb", shard) + c["opt"] + c["zero"]
           + allreduce_time(c["grad_bytes"], 2, comm)}
    for M in MS:
        mb = max(micro_batch_sizes(global_batch, M))
        beta = comm.message(mb * c["state_bytes"])
        f = [at("s0_f", mb), at("s1_f", mb)]
        bwd = [at("s1_fb", mb) - f[1], at("s0_fb", mb) - f[0]]
        out[f"gpipe M={M}"] = (flow_shop(f, M, beta) + flow_shop(bwd, M, beta)
                               + max(c["opt0"], c["opt1"]) + c["zero"])
    return out


def interleaved(name, make, global_batch, comm, train, repeats, compile_) -> dict:
    """Every option on the same 2 ranks, ``repeats`` interleaved rounds (A B C A B C ...; each
    timed step right after an untimed one of the same option, wall clock between barriers, the
    slowest rank's): ``serial`` and ``serial compiled`` (rank 0 alone, the other rank idle),
    ``data parallel`` and ``data parallel compiled`` (GradientBuckets over each rank's half of
    the batch), ``GPipe M=..`` (:data:`MS`), ``torch GPipe M=..`` / ``torch 1F1B M=..``
    (``torch.distributed.pipelining`` over gloo, the same 2-stage split; M dividing the batch). ``compile_``: also the compiled options
    (``torch.compile`` of the whole model; a compile error leaves the option out on every rank
    and its first line in ``notes``). Returns ``{"model", "times": {option: [s]}, "notes"}``."""
    from experiments.benchmarks import baselines_common as bc
    from mgrit.parallel.gradbuckets import GradientBuckets
    rank, P = comm.Get_rank(), comm.Get_size()
    x, y = _batch(train, global_batch)
    rows = torch.tensor_split(torch.arange(global_batch), P)[rank]
    ce = torch.nn.functional.cross_entropy
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)  # noqa: E731
    fns, notes = {}, {}

    def serial_of(model):  # model: None on the idle rank
        opt = sgd(model) if model is not None else None

        def step():
            if rank == 0:
                opt.zero_grad()
                ce(model(x), y).backward()
                opt.step()
        return step

    def dp_of(model, raw):
        opt, buckets = sgd(raw), GradientBuckets(raw.parameters(), comm)

        def step():
            buckets.zero_grad()
            ce(model(x[rows]), y[rows]).backward()
            buckets.average()
            opt.step()
        return step
    fns["serial"] = serial_of(make())
    rep = make()
    fns["data parallel"] = dp_of(rep, rep)
    if compile_:
        cs, note = None, None
        if rank == 0:
            m = make()
            cs, note = bc.try_compile(lambda: torch.compile(m), lambda f: ce(f(x), y).backward())
        notes["serial compiled"] = comm.bcast(note, root=0)
        if not notes["serial compiled"].startswith("does not"):
            fns["serial compiled"] = serial_of(cs if rank == 0 else None)
        raw = make()
        cd, dnote = bc.try_compile(lambda: torch.compile(raw),
                                   lambda f: ce(f(x[rows]), y[rows]).backward())  # no Allreduce
        got = comm.allgather((cd is not None, dnote))
        bad = [n for ok, n in got if not ok]
        notes["data parallel compiled"] = bad[0] if bad else dnote
        if not bad:
            fns["data parallel compiled"] = dp_of(cd, raw)
    model = make()
    stage = _stages(model)[rank]
    in_shape = tuple(x.shape[1:]) if rank == 0 else tuple(_stages(model)[0](x[:1]).shape[1:])
    opt_p = sgd(stage)
    loss = lambda o, j, r: ce(o, y[r]) * (r.stop - r.start) / global_batch  # noqa: E731
    for M in MS:
        pipe = GPipe(ModuleStage(stage, in_shape, first=rank == 0), comm, M)
        pipe.step(x if rank == 0 else None, global_batch, loss)  # validated once

        def gp(pipe=pipe):
            pipe.step(x if rank == 0 else None, global_batch, loss, validate=False)
            opt_p.step()
        fns[f"GPipe M={M}"] = gp
    # what a PyTorch user picks (issue 34 item 2): torch.distributed.pipelining over gloo
    import torch.distributed.pipelining as pp
    from experiments.benchmarks.torch_pipeline import rendezvous
    rendezvous(comm)
    for sched, M in [("GPipe", M) for M in MS] + [("1F1B", M) for M in MS if M >= 2]:
        if global_batch % M:
            continue
        tstage = _stages(make())[rank]
        cls = pp.ScheduleGPipe if sched == "GPipe" else pp.Schedule1F1B
        sch = cls(pp.PipelineStage(tstage, rank, P, torch.device("cpu")), n_microbatches=M,
                  loss_fn=ce, scale_grads=True)

        def tpp(sch=sch, opt=sgd(tstage)):
            opt.zero_grad()
            sch.step(x) if rank == 0 else sch.step(target=y)
            opt.step()
        fns[f"torch {sched} M={M}"] = tpp

    def timer(fn):
        def run():
            fn()
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            comm.Barrier()
            return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        return run
    for fn in fns.values():
        fn()  # warm-up
    return {"model": name, "times": bc.interleave({k: timer(f) for k, f in fns.items()}, repeats),
            "notes": notes}
