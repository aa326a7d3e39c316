"""Trace checks on k ranks (tests/perf/test_trace.py): a traced real run's tallies equal the
solver's own counters (``SolverStats``, gathered separately from the tracer) on every rank,
every send is matched one-to-one by its receive (same bytes), and the replay of the trace
equals :func:`mgrit.perf.model.simulate` -- an independent re-derivation of the operations
from ``N``, ``P`` and the options -- per rank, with unit costs (tau = 1, free messages) and
with uneven costs (call overhead, latency and bandwidth). One job checks MGRIT solves of
several option sets and a layer-parallel ResNet's forward and adjoint solves."""
import math

import torch
from mpi4py import MPI

from mgrit.grid import Partition
from mgrit.options import MGRITOptions
from mgrit.perf.model import CommCost, StepCost, simulate
from mgrit.perf.trace import COUNT_KEYS, UNIT, Tracer, replay
from mgrit.perf.trace.resnet import trace_resnet
from mgrit.solver import MGRIT
from tests.chains import BatchedTanhChain

COMM = MPI.COMM_WORLD
FREE = CommCost(0.0, math.inf)
COSTS = [(UNIT, FREE), (StepCost(1.0, 0.3, 0.7), CommCost(0.5, 1e3)),
         (StepCost(1.0, 0.3, 0.7), CommCost(0.5, 1e3, host=0.25, collective=2.0))]
SIM_KEYS = ("steps_single", "steps_batched_calls", "steps_batched_items", "messages",
            "bytes_sent", "allreduces")
#: (N, levels, cfactor, relax, cycle, iterations, batched, nested, skip) -- N >= 8 ranks
CASES = [
    (32, 2, 4, "F", "V", 2, True, False, False),
    (32, 2, 8, "FCF", "V", 2, True, False, False),
    (31, 3, 2, "F", "V", 2, False, False, True),
    (40, 3, [4, 2], ["F", "FCF"], "F", 2, True, False, False),
    (33, 4, 2, "FCFCF", "V", 1, True, True, False),
    (24, 1, 2, "F", "V", 1, True, False, False),
]


def _opts(levels, cfactor, relax, cycle, iters, batched, nested, skip, **kw):
    kw.setdefault("tol", 0.0)
    return MGRITOptions(max_levels=levels, cfactor=cfactor, relax=relax, cycle=cycle,
                        max_iter=iters, batched=batched, nested_iteration=nested,
                        skip_first_relaxation=skip, **kw)


def _stats(solver_stats) -> dict:
    d = solver_stats.as_dict()
    return {k: d[k] for k in COUNT_KEYS}


def _close(a, b, what):
    assert abs(a - b) <= 1e-12 * max(abs(b), 1.0), f"{what}: replay {a!r} != simulate {b!r}"


def _against_simulate(trace, label, N, opts, batched, nbytes, position, iterations=None,
                      initial_guess=False):
    """Replay of ``label``'s solves == simulate, per rank (``position[r]``: rank r's place in
    simulate's chain order), under each cost pair; returns the unit-cost critical path."""
    paths = []
    for tau, comm in COSTS:
        rep = replay(trace, tau, comm, label=label)
        sim = simulate(N, trace.nprocs, opts, iterations, batched, tau, comm, nbytes,
                       initial_guess)
        for r in range(trace.nprocs):
            q = position[r]
            _close(rep.finish[r], sim.time[q], f"{label} rank {r} finish ({tau}, {comm})")
            got = {k: rep.counts[r][k] for k in SIM_KEYS}
            assert got == sim.rank(q), f"{label} rank {r}: replay {got} != simulate {sim.rank(q)}"
        _close(rep.critical_path, sim.critical_path, f"{label} critical path")
        paths.append(rep.critical_path)
    return paths[0]


def _check_trace(trace, solver_stats, labels):
    """On root: tallies == the solver's counters (gathered, per rank and label); messages
    matched one to one with equal bytes; the solver's copy in the trace agrees too."""
    for r in range(trace.nprocs):
        for label in labels:
            want = solver_stats[r][label]
            assert trace.counts(r, label) == want, (r, label, trace.counts(r, label), want)
            assert trace.solver_counts(r, label) == want, (r, label)
    msgs = trace.messages()
    sends = sum(trace.counts(r)["messages"] for r in range(trace.nprocs))
    recvs = sum(1 for r in range(trace.nprocs) for e in trace.events(r) if e[0] == "recv")
    assert len(msgs) == sends == recvs, (len(msgs), sends, recvs)
    return sends


def check_solver_traces():
    """Every case of :data:`CASES`, plus a warm-started solve to a tolerance (its guess is
    F-relaxed and tested first; the cycles it took are the solver's decision)."""
    P, rank = COMM.Get_size(), COMM.Get_rank()
    tracer, mine, plans = Tracer(), {}, []
    u0 = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for i, case in enumerate(CASES):
        N, *rest = case
        opts = _opts(*rest)
        solver = MGRIT(BatchedTanhChain(N, width=3), N, (2, 3), options=opts, comm=COMM)
        tracer.attach(solver, f"case{i}")
        solver.solve(u0)
        mine[f"case{i}"] = _stats(solver.stats)
        plans.append((f"case{i}", N, opts, rest[5], None, False))
    N, opts = 32, _opts(2, 4, "F", "V", 20, True, False, False, tol=1e-9)
    solver = MGRIT(BatchedTanhChain(N, width=3), N, (2, 3), options=opts, comm=COMM)
    lo, hi = solver.hierarchy.levels[0].lo, solver.hierarchy.levels[0].hi
    guess = torch.zeros(hi - lo, 2, 3, dtype=torch.float64)
    tracer.attach(solver, "warm")
    res = solver.solve(u0, initial_guess=guess)
    mine["warm"] = _stats(solver.stats)
    plans.append(("warm", N, opts, True, res.iterations, True))
    trace = tracer.gather(COMM)
    stats = COMM.gather(mine)
    if rank != 0:
        return "ok"
    labels = [p[0] for p in plans]
    msgs = _check_trace(trace, stats, labels)
    paths = {}
    for label, N, opts, batched, iters, guess in plans:
        paths[label] = _against_simulate(trace, label, N, opts, batched, 2 * 3 * 8, range(P),
                                         iters, guess)
    return {"messages": msgs, "unit_critical_paths": paths}


def check_resnet_trace(n_layers=None, width=4, batch=4):
    """A layer-parallel ResNet's forward + backward (MGRIT forward, adjoint MGRIT): tallies
    per rank and solve == the forward and adjoint solvers' own counters; replay == simulate
    (the adjoint runs on the reversed partition: rank r is simulate's chain position of its
    block; ``n_layers`` divisible by P keeps the blocks even, as simulate assumes)."""
    P = COMM.Get_size()
    n_layers = n_layers or 12 * P  # even blocks of 12 = 3 coarse intervals of m = 4 per rank
    trace, model, _ = trace_resnet(COMM, n_layers, width, batch)
    mine = {"forward": _stats(model.forward_solver.stats),
            "adjoint": _stats(model.backward_solver.stats)}
    stats = COMM.gather(mine)
    if COMM.Get_rank() != 0:
        return "ok"
    assert n_layers % P == 0
    msgs = _check_trace(trace, stats, ("forward", "adjoint"))
    even = Partition.even(n_layers, P)
    pos = {even.block(q)[0]: q for q in range(P)}
    rev = Partition.even(n_layers, P).reversed()
    nbytes = batch * width * 8
    out = {"messages": msgs}
    for label, opts, part, batched in (
            ("forward", model.fwd_opts, even, model.forward_solver.propagator.batched),
            ("adjoint", model.bwd_opts, rev, model.backward_solver.propagator.batched)):
        position = [pos[part.block(r)[0]] for r in range(P)]
        out[label] = _against_simulate(trace, label, n_layers, opts, batched, nbytes, position)
    res = replay(trace, "recorded", FREE, overhead=True)
    out["wall"] = res.recorded
    return out


class _Counting(MPI.Intracomm):
    """COMM_WORLD with its small collectives counted: ``allgather_within`` (one pickled
    ``isend`` to each other rank) and the residual's object ``allreduce``."""
    counts = {"isend": 0, "allreduce": 0, "Allreduce": 0}

    def isend(self, *a, **k):
        self.counts["isend"] += 1
        return super().isend(*a, **k)

    def allreduce(self, *a, **k):
        self.counts["allreduce"] += 1
        return super().allreduce(*a, **k)

    def Allreduce(self, *a, **k):
        self.counts["Allreduce"] += 1
        return super().Allreduce(*a, **k)


def check_step_collectives(width=4, batch=4):
    """Issue 34 item 5: the small collectives of a real training step (forward, then
    backward), counted on the communicator, equal the cost model's count per direction: the
    solver's (simulate's ``allreduces``: its validation and residuals) plus
    :data:`mgrit.perf.steptime.OUTSIDE_AGREEMENTS` outside the solves."""
    from mgrit.nn import DenseStep, LayerParallelResNet
    from mgrit.perf.steptime import OUTSIDE_AGREEMENTS
    P = COMM.Get_size()
    N = 12 * P
    comm = _Counting(COMM)
    fwd = MGRITOptions(max_levels=2, cfactor=4, max_iter=2, tol=0.0)
    bwd = MGRITOptions(max_levels=2, cfactor=4, max_iter=1, tol=0.0)
    model = LayerParallelResNet.build(lambda k: DenseStep(width, "tanh").double(), N, (width,),
                                      comm=comm, seed=0, forward=fwd, backward=bwd)
    x = torch.randn(batch, width, dtype=torch.float64)
    got = []
    for _ in range(2):  # the second step: nothing of the first-call set-up
        for k in _Counting.counts:
            _Counting.counts[k] = 0
        y = model(x if model.is_first else None, batch_size=batch)
        f = dict(_Counting.counts)
        for k in _Counting.counts:
            _Counting.counts[k] = 0
        (y.square().sum() / batch if model.is_last else y.sum()).backward()
        got = [f, dict(_Counting.counts)]
    out = []
    for (d, opts, K), c in zip((("forward", fwd, 2), ("adjoint", bwd, 1)), got):
        real = c["isend"] // (P - 1) + c["allreduce"] + c["Allreduce"]
        model_count = simulate(N, P, opts, K).allreduces[0] + OUTSIDE_AGREEMENTS
        assert c["isend"] % (P - 1) == 0, (d, c)
        assert real == model_count, f"{d}: the real step ran {real} collectives {c}, the " \
                                    f"model counts {model_count}"
        out.append(real)
    return out
