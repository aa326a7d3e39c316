"""Profile of one MGRIT training step, phase by phase and rank by rank, with its bound
(issue 34, item 1).

Network: dense tanh ResNet (DenseStep), N = 1024, width 8, batch 64, float32, T = 1, loss
mean(out^2); MGRIT 2 levels, F-relaxation, 2 forward / 1 adjoint cycles (inexact, warm
start), coarsening factor m in {16, 32, 64}; the lean serial loop (mgrit.perf.LeanResNet) and,
with ``--compile``, its torch.compile timed in the same repeats (interleaved: each repeat runs
every configuration once, one untimed step before each timed one).

Phases (per rank, milliseconds; wall time and process CPU time, ``time.process_time``):

* ``forward``: the forward solve (``forward.kernels``: the step calls the trace recorded,
  ``forward.waits``: receives and collectives waited for, wall only; ``forward.host``: the
  rest, the solver's Python); ``forward.outside``: the model's forward minus the solve (the
  fingerprint, the stacked snapshot, the autograd node);
* ``adjoint``: the adjoint solve (same split);
* ``pgrad``: the parameter-gradient sweep (``AdjointChain.stacked_gradients`` /
  ``parameter_gradients``);
* ``backward.outside``: ``.backward()`` minus adjoint and sweep (the agreement, the fan-out of
  the stacked gradient to the layers' ``.grad`` by autograd);
* ``optimizer``: ``zero_grad`` + ``step``; ``python``: the step minus all of the above.

The timed steps run traced (:class:`mgrit.perf.trace.Tracer`: two clock reads and a list
append per propagator call, about 1 us each, inside the measured step).

Bound (:mod:`mgrit.perf.trace.bound`): the step's recorded operations priced at unit costs
timed apart in the same run (min of ``--unit-reps`` calls): batched forward and adjoint
kernels at every interval count the trace holds, single steps, the adjoint's linearization,
the batched parameter-gradient kernel, one optimizer op per stacked tensor, the message
latency (ping-pong, P > 1). Printed as ``measured / bound`` (CPU time of the slowest rank).

Load gate (:func:`experiments.measure.load_gate`): the 1-minute load average before and after;
a run whose load exceeds the job's own processes (P) by more than 0.5 is marked unreliable in
the table and the JSON.

Parameter modes (``--modes``, timed interleaved in the same repeats): ``layers`` (one leaf per
layer and name; the backward's stacked gradient is handed to every layer's ``.grad`` by
autograd) and ``stacked`` (``stacked_parameters=True``: one leaf per name), each with its SGD
(``MODE:sgd|foreach|fused``).

Usage (one process, or ``mpiexec -n 2 python -m mpi4py`` for two ranks)::

    python experiments/benchmarks/profile_step.py [--quick] [--compile] [--out DIR]
    python experiments/benchmarks/profile_step.py --compile --modes layers:sgd stacked:foreach

writes ``DIR/profile_step_p{P}.md`` and ``.json`` (default DIR
``experiments/results/benchmarks``); ``--quick``: N = 64, m in {4, 8}, 2 repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from experiments.benchmarks import profile_units as units  # noqa: E402
from experiments.measure import load1, load_gate  # noqa: E402
from mgrit.nn import DenseStep, LayerParallelResNet  # noqa: E402
from mgrit.nn.chains.propagators import AdjointChain  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.perf.lean import COMPILE_ERRORS, LeanResNet, compiled_train_step  # noqa: E402
from mgrit.perf.trace import Tracer  # noqa: E402
from mgrit.perf.trace.bound import step_bound  # noqa: E402
from mgrit.reporting import writers as report  # noqa: E402

PHASES = ("forward", "forward.kernels", "forward.waits", "forward.host", "forward.outside",
          "adjoint", "adjoint.kernels", "adjoint.waits", "adjoint.host", "pgrad",
          "backward.outside", "optimizer", "python", "step")
LR = 1e-3


class Clock:
    """Accumulates ``(wall, cpu)`` seconds per phase name."""

    def __init__(self):
        self.t = {}
        self._open = set()  # phases being timed: a nested call of the same phase counts once

    @contextmanager
    def phase(self, name):
        if name in self._open:
            yield
            return
        self._open.add(name)
        w, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._open.discard(name)
            a, b = self.t.get(name, (0.0, 0.0))
            self.t[name] = (a + time.perf_counter() - w, b + time.process_time() - c)

    def wrap(self, name, fn):
        def timed(*a, **k):
            with self.phase(name):
                return fn(*a, **k)
        return timed


def make_lp(N, width, m, comm, stacked=False):
    def o(it):
        return MGRITOptions(max_levels=2, cfactor=m, tol=0, max_iter=it, relax="F")
    return LayerParallelResNet.build(lambda k: DenseStep(width, "tanh"), N, (width,), comm=comm,
                                     forward=o(2), backward=o(1), stacked_parameters=stacked)


def parse_mode(text, default_opt):
    """``MODE[:OPTIMIZER]`` (``layers`` or ``stacked``; ``sgd``, ``foreach``, ``fused``)."""
    mode, _, opt = text.partition(":")
    opt = opt or default_opt
    if mode not in ("layers", "stacked") or opt not in ("sgd", "foreach", "fused"):
        raise SystemExit(f"--modes {text!r}: use layers|stacked[:sgd|foreach|fused]")
    return mode, opt


def label(m, mode, opt, modes) -> str:
    """The configuration's column name: ``m`` alone when only one mode runs."""
    return str(m) if len(modes) == 1 else f"{m} {mode}/{opt}"


def make_optimizer(params, kind):
    kw = {"foreach": True} if kind == "foreach" else {"fused": True} if kind == "fused" else \
        {"foreach": False}
    return torch.optim.SGD(params, lr=LR, **kw)


class Profiled:
    """One MGRIT configuration with its phases instrumented (wrappers on this model's solvers
    and on ``AdjointChain``'s sweep; the library is not changed)."""

    def __init__(self, lp, x, batch, optimizer):
        self.lp, self.x, self.batch = lp, x, batch
        self.opt = make_optimizer(lp.parameters(), optimizer)
        self.optimizer = optimizer
        self.clock = Clock()
        self.tracer = Tracer()
        self.tracer.attach(lp._fsolver, "forward")
        self.tracer.attach(lp._bsolver, "adjoint")
        lp._fsolver.solve = self.clock.wrap("forward", lp._fsolver.solve)
        lp._bsolver.solve = self.clock.wrap("adjoint", lp._bsolver.solve)

    def step(self):
        lp, c = self.lp, self.clock
        with c.phase("optimizer"):
            self.opt.zero_grad(set_to_none=True)
        with c.phase("forward.total"):
            out = lp(self.x if lp.is_first else None, batch_size=self.batch)
        loss = (out ** 2).mean() if lp.is_last else out.sum()
        with c.phase("backward.total"):
            loss.backward()
        with c.phase("optimizer"):
            self.opt.step()

    def timed_step(self) -> dict:
        """One step; ``{phase: (wall, cpu)}`` seconds (trace splits: wall only)."""
        self.clock.t.clear()
        self.tracer.solves.clear()
        w, c = time.perf_counter(), time.process_time()
        with _sweep_timed(self.clock):
            self.step()
        t = dict(self.clock.t)
        t["step"] = (time.perf_counter() - w, time.process_time() - c)
        for label in ("forward", "adjoint"):
            kern = waits = 0.0
            for s in self.tracer.solves:
                if s["label"] != label:
                    continue
                for e in s["events"]:
                    if e[0] == "step":
                        kern += e[2] - e[1]
                    elif e[0] in ("recv", "coll"):
                        waits += e[2] - e[1]
            total = t.get(label, (0.0, 0.0))[0]
            t[f"{label}.kernels"] = (kern, None)
            t[f"{label}.waits"] = (waits, None)
            t[f"{label}.host"] = (total - kern - waits, None)
        ft, bt = t.pop("forward.total"), t.pop("backward.total")
        (fw, fc), (bw, bc) = ft, bt
        sw = lambda k, i: t.get(k, (0.0, 0.0))[i]  # noqa: E731
        t["forward.outside"] = (fw - sw("forward", 0), fc - sw("forward", 1))
        t["backward.outside"] = (bw - sw("adjoint", 0) - sw("pgrad", 0),
                                 bc - sw("adjoint", 1) - sw("pgrad", 1))
        t["python"] = tuple(t["step"][i] - ft[i] - bt[i] - sw("optimizer", i) for i in (0, 1))
        return t


@contextmanager
def _sweep_timed(clock):
    saved = AdjointChain.stacked_gradients, AdjointChain.parameter_gradients
    AdjointChain.stacked_gradients = clock.wrap("pgrad", saved[0])
    AdjointChain.parameter_gradients = clock.wrap("pgrad", saved[1])
    try:
        yield
    finally:
        AdjointChain.stacked_gradients, AdjointChain.parameter_gradients = saved


def lean_timer(lean, x):
    def run():
        lean.train_step(x, LR)
    return run


def time_fn(fn):
    fn()  # untimed: refills the caches the previous configuration evicted
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def median(xs):
    xs = [v for v in xs if v is not None]
    return statistics.median(xs) if xs else None


def run(args, comm) -> dict:
    P, rank = comm.Get_size(), comm.Get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.width)
    modes = [parse_mode(t, args.optimizer) for t in args.modes]
    cfactor, configs = {}, {}
    for m in args.ms:
        for mode, opt in modes:
            key = label(m, mode, opt, modes)
            cfactor[key] = m
            configs[key] = Profiled(make_lp(args.N, args.width, m, comm, mode == "stacked"), x,
                                    args.batch, opt)
    first = next(iter(configs.values()))
    lean = LeanResNet.from_sequential(first.lp.to_serial())
    compiled, cnote = None, "not run (--compile not given)"
    if args.compile:
        try:
            compiled = compiled_train_step(LeanResNet.from_sequential(first.lp.to_serial()), 16)
            compiled(x, 0.0)
            cnote = "inductor, blocks of 16 layers"
        except COMPILE_ERRORS as e:
            cnote = f"does not compile here: {type(e).__name__}"
    loads = [load1()]
    samples = {m: [] for m in configs}
    base = {"lean": []}
    if compiled is not None:
        base["compiled lean"] = []
    for _ in range(args.reps):
        for m, pc in configs.items():
            comm.Barrier()
            pc.step()  # untimed
            comm.Barrier()
            samples[m].append(pc.timed_step())
        base["lean"].append(time_fn(lean_timer(lean, x)))
        if compiled is not None:
            base["compiled lean"].append(time_fn(lambda: compiled(x, LR)))
    loads.append(load1())
    # unit costs and the bound, per configuration (the last timed step's trace)
    bounds = {}
    for m, pc in configs.items():
        trace = pc.tracer.gather(comm, root=0)
        u = units.measure(pc.lp, x, cfactor[m], comm, args.unit_reps, trace_events(pc.tracer),
                          pc.optimizer)
        allu = comm.gather(u, root=0)
        if rank == 0:
            costs, comm_cost, extra = units.combine(allu)
            b = step_bound(trace, costs, comm_cost, extra)
            bounds[m] = {"units": allu, "bound_s": b.total, "per_label_s": b.per_label,
                         "extra_s": b.extra, "counts": b.counts}
    loads.append(load1())
    rows = comm.gather({"rank": rank, "mgrit": {m: summarize(s) for m, s in samples.items()},
                        "baselines": {k: {"wall": median([a for a, _ in v]),
                                          "cpu": median([b for _, b in v])}
                                      for k, v in base.items()}}, root=0)
    if rank != 0:
        return {}
    return {"P": P, "N": args.N, "width": args.width, "batch": args.batch, "ms": list(configs),
            "reps": args.reps, "optimizer": ", ".join(f"{m}:{o}" for m, o in modes),
            "modes": {k: list(parse_mode(t, args.optimizer)) for k, t in
                      zip(configs, [t for _ in args.ms for t in args.modes])},
            "compiled": cnote,
            "load1": loads, "reliable": load_gate(loads, P)["reliable"], "ranks": rows, "bounds": bounds,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def trace_events(tracer):
    return [(s["label"], e) for s in tracer.solves for e in s["events"] if e[0] == "step"]


def summarize(samples) -> dict:
    return {p: {"wall": median([s[p][0] for s in samples if p in s]),
                "cpu": median([s[p][1] for s in samples if p in s])} for p in PHASES}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--N", type=int, default=1024)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ms", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--reps", type=int, default=7, help="interleaved repeats (7)")
    ap.add_argument("--unit-reps", type=int, default=20, help="calls per unit cost, min taken (20)")
    ap.add_argument("--optimizer", choices=("sgd", "foreach", "fused"), default="sgd",
                    help="torch.optim.SGD: per tensor (default), foreach=True or fused=True")
    ap.add_argument("--modes", nargs="+", default=["layers"],
                    help="parameter modes timed interleaved, MODE[:OPTIMIZER]: layers (one leaf "
                         "per layer and name) or stacked (stacked_parameters=True); the "
                         "optimizer defaults to --optimizer (e.g. --modes layers:sgd "
                         "stacked:foreach: the old and the new step, paired)")
    ap.add_argument("--compile", action="store_true", help="also time the compiled lean step")
    ap.add_argument("--quick", action="store_true", help="N = 64, m in {4, 8}, 2 repeats")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "benchmarks"))
    args = ap.parse_args(argv)
    if args.quick:
        args.N, args.ms, args.reps, args.unit_reps = 64, [4, 8], 2, 3
    comm = MPI.COMM_WORLD
    bad = [m for m in args.ms if m < 2 or args.N % m]
    if bad or args.reps < 1:
        raise SystemExit(f"--ms {bad} / --reps {args.reps}: use factors >= 2 dividing N and "
                         f"repeats >= 1")
    meta = report.run_metadata(world_size=comm.Get_size())  # provenance, as every table's
    res = run(args, comm)
    if comm.Get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"profile_step_p{res['P']}"
        meta = report.finish_metadata(meta)
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, **res}, indent=1,
                                                        default=str))
        title, body = units.markdown(res)
        report.write_table(stem.with_suffix(".md"), title, meta, body)
        print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
