"""What should I run? The planner (mgrit.perf.planner) for a dense ResNet on MNIST inputs, and
its validation.

    python experiments/benchmarks/plan.py --layers 4096 --width 8 --batch 64 --ranks 64
    python experiments/benchmarks/plan.py --network mnist --ranks 2     # the main job's network
    python experiments/benchmarks/plan.py --validate [--quick]          # writes results/plan_validation.md

A recommendation calibrates the network's costs on this machine (1 process, 1 thread), probes
MGRIT's convergence on a real mnist5k batch and prints every option's predicted step time
(serial, data parallelism, GPipe, MGRIT, hybrid grids) with the recommendation and why.
Networks (``--network``): ``deep`` (opening 784 -> 8, 4096 dense tanh steps of width 8, batch
64), ``mnist`` (experiments/train.py's defaults: width 32, 32 steps, batch 50), ``wide``
(width 1024, 8 steps, batch 128); ``custom`` takes ``--layers/--width/--batch``. All: tanh,
T = 1, a Linear(width, 10) classifier, cross-entropy.

``--validate``: at P = 2 (this machine's cores) for the three networks, recommend, then run every
option for real in one 2-rank MPI job (interleaved repeats; wall clock, max over ranks): serial
(rank 0 alone), data parallelism (GradientBuckets), GPipe (the planner's M, and M = 1, the
blocking chain), MGRIT (the planner's configuration and iteration counts, warm start as in
training; each timed step right after an untimed one of the same option, as in a training
loop), and checks that the recommendation is the measured fastest within noise (its
per-repeat time ratio to the measured fastest has a median <= 1.05 or an interquartile range
that includes 1; the planner does not model torch.compile, so this check is over the options it
plans, and the table also names the fastest of all). Beside them, the compiled baselines
(torch.compile of the serial model on rank 0 alone, and of each data-parallel replica:
whole model up to 64 layers, each layer above), 10 interleaved repeats with median [IQR] and
min-max, the raw per-repeat times (``plan_validation.raw.json``), MGRIT's gradient error
(cold and warm) and every option's speed-up over the strongest baseline, with a verdict
sentence. ``--quick``: smaller networks, 2 repeats, 2 probes, no compile, the nominal message
cost (no ping-pong launch; a smoke test of about half a minute on 2 idle cores). Full mode
(``--validate``): 379 s (6 min) measured at 48a9d82, 2 idle cores (``results/manifest.json``);
the plan alone 114 s measured at 48a9d82, 2 idle cores.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
from data import load_dataset  # noqa: E402
from experiments.benchmarks import baselines_common as bc  # noqa: E402
from mgrit import perf  # noqa: E402
from mgrit.grid import Partition  # noqa: E402
from mgrit.parallel.gradbuckets import GradientBuckets  # noqa: E402
from mgrit.perf import planner, strategies  # noqa: E402
from mgrit.perf.baselines import GPipe, ModuleStage  # noqa: E402
from mgrit.perf.lean import LeanResNet  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402
from layerpar.jobconfig import JobConfig  # noqa: E402
from mgrit.models import build_model  # noqa: E402

#: name -> (layers, width, batch); quick variants for --quick.
NETWORKS = {"deep": (4096, 8, 64), "mnist": (32, 32, 50), "wide": (8, 1024, 128)}
QUICK = {"deep": (64, 8, 64), "mnist": (32, 32, 50), "wide": (4, 256, 64)}
med = statistics.median


def config(layers, width, batch, mg: dict | None = None) -> JobConfig:
    """The main job's configuration with these sizes (and MGRIT settings ``mg``)."""
    c = JobConfig(layers=layers, width=width, batch_size=batch)
    if mg:
        c = dataclasses.replace(c, levels=mg["levels"], cfactor=mg["cfactor"], relax=mg["relax"],
                                fwd_iters=mg["K_f"], bwd_iters=mg["K_b"], tol=0.0)
    return c


def batch(n, seed=0):
    train = load_dataset("mnist5k")[0]
    idx = np.random.default_rng(seed).choice(len(train), n, replace=False)
    x, y = train.get_batch(idx)
    return torch.as_tensor(x).reshape(n, -1).float(), torch.as_tensor(y).long()


def network(layers, width, batch_size):
    """(planner.Network, serial nn.Sequential) of the main job's model with these sizes."""
    seq = build_model("resnet", config(layers, width, batch_size), (784,), 10)
    return planner.Network.from_sequential(seq, (width,), torch.nn.functional.cross_entropy), seq


def recommend(layers, width, batch_size, P, comm, grad_tol, repeats=3, max_probes=6,
              margin=0.10, clock=time.process_time):
    """The planner's recommendation for the main job's network of these sizes; its costs
    timed in this process's CPU time (issue 34: a loaded machine perturbs it less than the
    wall clock; the lean-loop candidates included)."""
    torch.set_num_threads(1)
    net, _ = network(layers, width, batch_size)
    x, y = batch(batch_size)
    return planner.recommend(net, x, P, y, comm=comm, grad_tol=grad_tol, repeats=repeats,
                             max_probes=max_probes, margin=margin, clock=clock)


# -- the 2-rank validation job ------------------------------------------------------------------
def worker(spec_path, out_path):
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    spec = json.loads(Path(spec_path).read_text())
    out = {"comm": None, "nets": {}}
    c = perf.pingpong(world, (8, 4096, 1 << 16))
    out["comm"] = [c.latency, c.bandwidth]
    for name, s in spec["nets"].items():
        out["nets"][name] = run_options(world, rank, s, spec["repeats"])
    if rank == 0:
        Path(out_path).write_text(json.dumps(out))


def run_options(world, rank, s, repeats):
    """``{"times", "gerr", "compile"}`` of network spec ``s``: every option's per-repeat times
    (:func:`time_steps`), MGRIT's relative gradient error against exact backpropagation on the
    timed batch before the first step (``cold``) and after the timed steps (``warm``, the warm
    start of a training loop), and the compiled options' notes."""
    notes = {}
    fns = step_fns(world, rank, s, notes)
    mg, gerr = fns.get("MGRIT"), {}
    ce = torch.nn.functional.cross_entropy
    if mg is not None:
        gerr["cold"] = bc.net_grad_error(mg.net, *mg.batch, ce, world)  # the fresh network
    times = time_steps(world, fns, repeats)
    if mg is not None:
        gerr["warm"] = bc.net_grad_error(mg.net, *mg.batch, ce, world)  # after the timed steps
    return {"times": times, "gerr": gerr, "compile": notes}


def step_fns(world, rank, s, notes: dict | None = None) -> dict:
    """``{option: step()}`` of one network spec ``s`` on this rank: serial (rank 0 alone), data
    parallel, with ``s["compile"]`` their ``torch.compile``d versions (:func:`compiled_options`;
    the compile notes go into ``notes``), GPipe with ``M = 1`` and ``s["gpipe_M"]`` (or every M
    of ``s["gpipe_Ms"]``), and MGRIT with ``s["mgrit"]`` (a :func:`mgrit_spec` dict, or None:
    no MGRIT)."""
    L, W, B = s["layers"], s["width"], s["batch"]
    x, y = batch(B)
    ce = torch.nn.functional.cross_entropy
    serial = build_model("resnet", config(L, W, B), (784,), 10)
    replica = build_model("resnet", config(L, W, B), (784,), 10)
    o_s = torch.optim.SGD(serial.parameters(), 0.01, momentum=0.9)
    o_r = torch.optim.SGD(replica.parameters(), 0.01, momentum=0.9)
    buckets = GradientBuckets(replica.parameters(), world)
    rows = torch.tensor_split(torch.arange(B), 2)[rank]
    mods = list(build_model("resnet", config(L, W, B), (784,), 10))
    a, e = Partition.even(L, 2).block(rank)
    # mods = [opening, residual layer 0 .. L-1, closing]: rank 0 the opening + its layers
    stage = mods[:1 + min(e, L)] if rank == 0 else mods[1 + a:]
    fns = {}

    def serial_step():
        if rank == 0:
            o_s.zero_grad()
            ce(serial(x), y).backward()
            o_s.step()

    def dp_step():
        buckets.zero_grad()
        ce(replica(x[rows]), y[rows]).backward()
        buckets.average()
        o_r.step()
    fns["serial"] = serial_step
    fns["data parallel"] = dp_step
    fns["serial (lean)"] = lean_step_fn(world, rank, s, x, y, False)
    fns["data parallel (lean)"] = lean_step_fn(world, rank, s, x, y, True)
    if s.get("compile"):
        (notes if notes is not None else {}).update(
            compiled_options(world, rank, s, x, y, rows, fns))
    st_mod = torch.nn.Sequential(*stage)
    o_p = torch.optim.SGD(st_mod.parameters(), 0.01, momentum=0.9)
    loss = lambda o, j, r: ce(o, y[r]) * (r.stop - r.start) / B  # noqa: E731
    for M in sorted({1, *s.get("gpipe_Ms", [s.get("gpipe_M", 1)])}):
        pipe = GPipe(ModuleStage(st_mod, (784,) if rank == 0 else (W,), first=rank == 0), world, M)

        def gp(pipe=pipe):
            pipe.step(x if rank == 0 else None, B, loss, validate=False)
            o_p.step()
        fns[f"GPipe M={M}"] = gp
    if s.get("mgrit"):
        fns["MGRIT"] = mgrit_step_fn(world, s, s["mgrit"], x, y)
    return fns


def lean_step_fn(world, rank, s, x, y, replicas: bool):
    """One training step of network spec ``s`` with its residual layers on the lean loop
    (:class:`mgrit.perf.lean.LeanResNet`: stacked tensors, closed-form backward), the opening
    and closing layers and the loss in autograd, SGD with momentum 0.9 (the stacked tensors:
    one op each): on rank 0 alone (``replicas`` False: the planner's lean serial option) or
    data parallel on lean replicas (each rank its half of the batch, one Allreduce of the
    stacked gradients and one of the others')."""
    L, W, B = s["layers"], s["width"], s["batch"]
    mods = list(build_model("resnet", config(L, W, B), (784,), 10))
    head, tail = mods[0], mods[-1]
    lean = LeanResNet.from_sequential(torch.nn.Sequential(*mods[1:-1]))
    other = [*head.parameters(), *tail.parameters()]
    opt = torch.optim.SGD(other, 0.01, momentum=0.9)
    mom = torch.zeros_like(lean.grad_flat)
    n_w = lean.gWT.numel()
    mom_w, mom_b = mom[:n_w].view_as(lean.gWT), mom[n_w:].view_as(lean.gb)
    buckets = GradientBuckets(other, world) if replicas else None
    rows = torch.tensor_split(torch.arange(B), 2)[rank] if replicas else slice(None)
    xs, ys = x[rows], y[rows]
    ce = torch.nn.functional.cross_entropy

    def step():
        if not replicas and rank != 0:
            return
        (buckets.zero_grad() if replicas else opt.zero_grad())
        z = head(xs)
        out = lean.forward_store(z.detach()).detach().requires_grad_()
        ce(tail(out), ys).backward()
        z.backward(lean.backward(out.grad))
        if replicas:
            world.Allreduce(MPI.IN_PLACE, lean.grad_flat.numpy(), op=MPI.SUM)
            lean.grad_flat.div_(world.Get_size())
            buckets.average()
        opt.step()
        mom.mul_(0.9).add_(lean.grad_flat)
        lean.WT.sub_(mom_w, alpha=0.01)
        lean.b.sub_(mom_b, alpha=0.01)
    return step


def mgrit_step_fn(world, s, mg: dict, x, y):
    """One layer-parallel MGRIT training step (SGD, momentum 0.9) of network spec ``s`` with
    the :func:`mgrit_spec` settings ``mg`` on the batch ``x, y``; a closure over its network."""
    L, W, B = s["layers"], s["width"], s["batch"]
    net = build_model("resnet", config(L, W, B, mg), (784,), 10, comm=world)
    o_m = torch.optim.SGD(net.parameters(), 0.01, momentum=0.9)

    def step():
        o_m.zero_grad()
        net.loss(net(x), y).backward()
        o_m.step()
    step.net, step.batch = net, (x, y)  # for the gradient error (run_options)
    return step


def time_steps(world, fns: dict, repeats: int) -> dict:
    """Per-repeat wall clock (max over ranks) of every step of ``fns``: two warm-up calls each,
    then ``repeats`` interleaved rounds (A B C A B C ...), each timed step right after an
    untimed one of the same option (MGRIT: the warm start of a training loop)."""
    for fn in fns.values():
        fn()
        fn()  # warm-up (MGRIT: the warm start's first states)

    def timer(fn):
        def run():
            fn()  # steady state: an untimed step of the same option just before
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            world.Barrier()
            return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        return run
    return bc.interleave({k: timer(fn) for k, fn in fns.items()}, repeats)


def compiled_options(world, rank, s, x, y, rows, fns) -> dict:
    """Add the compiled baselines to ``fns``: ``serial compiled`` (rank 0 alone) and ``data
    parallel compiled`` (each rank its shard + GradientBuckets). ``torch.compile`` of the whole
    model up to 64 layers; deeper: of each child module (regional compilation: the residual
    step's graph is compiled once and reused by every layer; compiling 4096 unrolled layers
    takes minutes). Returns ``{option: note}`` (the compile time, or the first line of its
    error: then the option is left out, on every rank)."""
    L, W, B = s["layers"], s["width"], s["batch"]
    ce = torch.nn.functional.cross_entropy

    def compiled(model):
        if L <= 64:
            return torch.compile(model)
        for m in model:
            m.compile()
        return model
    how = "whole model" if L <= 64 else "each layer (regional)"
    notes, fn, note = {}, None, None
    serial = build_model("resnet", config(L, W, B), (784,), 10)
    o_s = torch.optim.SGD(serial.parameters(), 0.01, momentum=0.9)
    if rank == 0:
        fn, note = bc.try_compile(lambda: compiled(serial), lambda f: ce(f(x), y).backward())
    notes["serial compiled"] = world.bcast(note, root=0)
    if not notes["serial compiled"].startswith("does not"):
        def serial_c():
            if rank == 0:
                o_s.zero_grad()
                ce(fn(x), y).backward()
                o_s.step()
        fns["serial compiled"] = serial_c
    replica = build_model("resnet", config(L, W, B), (784,), 10)
    o_r = torch.optim.SGD(replica.parameters(), 0.01, momentum=0.9)
    buckets = GradientBuckets(replica.parameters(), world)
    dfn, dnote = bc.try_compile(lambda: compiled(replica),
                                lambda f: ce(f(x[rows]), y[rows]).backward())  # no Allreduce yet
    got = world.allgather((dfn is not None, dnote))
    bad = [n for ok, n in got if not ok]
    notes["data parallel compiled"] = bad[0] if bad else dnote
    if not bad:
        def dp_c():
            buckets.zero_grad()
            ce(dfn(x[rows]), y[rows]).backward()
            buckets.average()
            o_r.step()
        fns["data parallel compiled"] = dp_c
    return {k: f"{v} ({how})" for k, v in notes.items()}


def launch(spec: dict, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sp, op = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        sp.write_text(json.dumps({"nets": spec, "repeats": repeats}))
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        mpiexec = os.environ.get("LAYERPAR_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
        subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", __file__, "--worker",
                        str(sp), "--out", str(op)], env=env, check=True, timeout=7200)
        return json.loads(op.read_text())


def mgrit_spec(option) -> dict:
    """The MGRIT settings of a planner option (``settings["config"]`` as ``"m=8, L=3, F"``) as
    :func:`config` takes them: ``cfactor``, ``levels``, ``relax``, ``K_f``, ``K_b``."""
    m, lv, rx = (v.split("=")[-1].strip() for v in option.settings["config"].split(","))
    return dict(cfactor=int(m), levels=int(lv), relax=rx, K_f=option.settings["K_f"],
                K_b=option.settings["K_b"])


def predicted(rec, kind, M=None):
    """The planner's prediction of an option it listed (GPipe with another M: recomputed)."""
    if kind == "GPipe" and M is not None:
        return strategies.gpipe_step(rec.costs, rec.batch, 2, M, rec.comm)
    o = [o for o in rec.options if o.kind == kind and (o.P_L, o.P_D) in ((1, 1), (1, 2), (2, 1))
         and not o.settings.get("kernel")]  # the autograd options (lean ones: their own rows)
    return min(o, key=lambda o: o.time).time if o else None


def validate(quick: bool, grad_tol: float, out: Path, margin: float = 0.10) -> str:
    nets = QUICK if quick else NETWORKS
    reps = 2 if quick else 10
    t0 = time.time()
    prov = reporting.run_metadata()  # command, commit, machine, cores, date, load before
    # the ping-pong of this machine's 2 ranks (--quick: the nominal cost, as plan_unseen's
    # smoke; the measuring launch below still runs the ping-pong)
    comm = perf.CommCost() if quick else perf.CommCost(*launch({}, 1)["comm"])
    recs, spec = {}, {}
    for name, (L, W, B) in nets.items():
        rec = recommend(L, W, B, 2, comm, grad_tol, repeats=1 if quick else 3,
                        max_probes=2 if quick else 6, margin=margin)
        recs[name] = rec
        mg = next((o for o in rec.options if o.kind == "MGRIT"), None)
        gp = next(o for o in rec.options if o.kind == "GPipe")
        cfg = None if mg is None else mgrit_spec(mg)
        spec[name] = dict(layers=L, width=W, batch=B, gpipe_M=gp.settings["M"], mgrit=cfg,
                          compile=not quick)
    meas = launch(spec, reps)
    L = ["# Planner validation at P = 2 (`experiments/benchmarks/plan.py --validate" + (" --quick" if quick else "") + "`)", "",
         *reporting.meta_lines(prov),  # + the load after the runs, the flag when loaded
         f"- timing: {reps} interleaved repeats per option (A B C A B C ...; wall clock, max over "
         f"the 2 ranks): median [IQR] and min-max; raw per-repeat times in "
         f"`{bc.raw_path(out).name}`; total {(time.time() - t0) / 60:.1f} min",
         "- baselines: serial (rank 0 alone) and data parallelism (GradientBuckets), eager and "
         "torch.compile'd (full mode only; `--quick` runs no compile); \"vs strongest\" = "
         "median of the fastest baseline / median of the option (> 1: faster)",
         "- gradient error (MGRIT, inexact: fixed cycles): relative error of all parameters' "
         "gradient against serial autograd of the same weights on the same batch (float32 "
         "gradients, float64 norms); cold = the fresh network's first step, warm = after the "
         "timed steps (warm start, as in training)",
         f"- planner: calibrated in 1 process (dedicated-core costs), message cost "
         + ("nominal (--quick)" if quick else "from this machine's ping-pong")
         + f" ({comm.latency * 1e6:.1f} us, {comm.bandwidth / 1e9:.2f} GB/s), "
         f"MGRIT convergence probed on a real mnist5k batch (cold start), gradient error target "
         f"{grad_tol:g}; recommendation: the simplest option predicted within {margin:.0%} of "
         f"the fastest (`--margin`)",
         "- within noise: the recommended option's per-repeat time ratio to the measured fastest "
         "has a median <= 1.05, or its interquartile range includes 1", ""]
    verdicts, samples, lp_rows = [], {}, []
    for name, rec in recs.items():
        res = meas["nets"][name]
        T, gerr, notes = res["times"], res["gerr"], res["compile"]
        samples.update({f"{name} {k}": v for k, v in T.items()})
        Ld, W, B = nets[name]
        planned = {k: v for k, v in T.items() if "compiled" not in k}  # what the planner knows
        fastest = min(planned, key=lambda k: med(T[k]))
        fastest_all = min(T, key=lambda k: med(T[k]))
        best, sp = bc.speedups(T, ["serial", "serial compiled", "data parallel",
                                   "data parallel compiled"])
        if "MGRIT" in T:
            lp_rows.append((name, sp["MGRIT"]))
        label = {"serial": "serial", "data parallel": "data parallel", "MGRIT": "MGRIT"}
        rk = rec.best.kind if rec.best.kind != "GPipe" else f"GPipe M={rec.best.settings['M']}"
        r = [a / b for a, b in zip(T[rk], T[fastest])] if rk in T else [float("inf")]
        q = np.percentile(r, [25, 75])
        ok = med(r) <= 1.05 or q[0] <= 1.0 <= q[1]
        verdicts.append(ok)
        r_all = [a / b for a, b in zip(T[rk], T[fastest_all])] if rk in T else [float("inf")]
        L += [f"## {name}: N = {Ld}, width {W}, batch {B}", "",
              f"Recommended: **{rec.best.label}**; measured fastest of the planner's options: "
              f"**{fastest}** -> {'**PASS**' if ok else '**FAIL**'} (recommended / fastest: "
              f"median {med(r):.2f}, IQR {q[0]:.2f}-{q[1]:.2f}). Fastest of all measured "
              f"options, compiled included (the planner does not model torch.compile): "
              f"**{fastest_all}** (recommended / it: median {med(r_all):.2f}).", "",
              "| option | measured [ms]: median [IQR] | min-max | vs strongest baseline "
              f"({best}) | gradient error | predicted [ms] | prediction error |",
              "|---|---|---|---|---|---|---|"]
        for k, v in T.items():
            kind, M = (k.split(" M=")[0], int(k.split("=")[1])) if k.startswith("GPipe") else (k, None)
            p = predicted(rec, label.get(kind, kind), M)
            err = f"{(p - med(v)) / med(v) * 100:+.0f}%" if p else "-"
            ge = (f"cold {gerr['cold']:.1e} / warm {gerr['warm']:.1e}" if k == "MGRIT"
                  else "exact")
            L.append(f"| {k} | {bc.cell(v, 1e3)} | {min(v) * 1e3:.4g}-{max(v) * 1e3:.4g} | "
                     f"{sp[k]:.2f}x | {ge} | {'-' if p is None else f'{p * 1e3:.4g}'} | {err} |")
        L += ["", "torch.compile: " + ("; ".join(f"{k}: {v}" for k, v in notes.items())
                                      if notes else "not run (--quick)"), ""]
        L += ["", "Planner output:", "", rec.report(), ""]
    L.insert(2, f"**Recommendation = measured fastest within noise: {sum(verdicts)} of {len(verdicts)} networks.**")
    L.insert(3, "")
    L.insert(4, (bc.verdict("Layer-parallel MGRIT (where configured) at P = 2", lp_rows)
                 if lp_rows else "Layer-parallel MGRIT: not configured for any network (the "
                 "planner found no MGRIT setting within the gradient error target).")
             + " (serial, data parallel, eager and compiled: the baselines.)")
    L.insert(5, "")
    text = "\n".join(L) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    reporting.write_raw(bc.raw_path(out), samples, prov)
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--network", choices=[*NETWORKS, "custom"], default="custom")
    ap.add_argument("--layers", type=int, default=4096, help="N (custom network)")
    ap.add_argument("--width", type=int, default=8, help="state width (custom network)")
    ap.add_argument("--batch", type=int, default=64, help="global batch (custom network)")
    ap.add_argument("--ranks", type=int, default=2, help="P, workers to plan for")
    ap.add_argument("--grad-tol", type=float, default=0.05,
                    help="relative parameter-gradient error MGRIT may leave")
    ap.add_argument("--latency", type=float, default=10e-6, help="message latency [s]")
    ap.add_argument("--bandwidth", type=float, default=10e9, help="bandwidth [bytes/s]")
    ap.add_argument("--margin", type=float, default=0.10,
                    help="recommend the simplest option (serial < data parallel < GPipe < MGRIT) "
                         "predicted within this fraction of the fastest (about the cost model's "
                         "error; 0: the fastest prediction)")
    ap.add_argument("--validate", action="store_true", help="P = 2 validation (runs mpiexec)")
    ap.add_argument("--quick", action="store_true", help="with --validate: small networks")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "experiments/results/benchmarks/plan_validation.md"))
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.out)
    if not 0 <= a.margin <= 1:
        ap.error(f"--margin={a.margin} is not allowed: use a fraction in [0, 1]")
    if a.validate:
        print(validate(a.quick, a.grad_tol, Path(a.out), a.margin))
        return
    for name in ("layers", "width", "batch", "ranks"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)} is not allowed: use an int >= 1")
    if not (a.latency >= 0 and a.bandwidth > 0 and a.grad_tol > 0):
        ap.error("use --latency >= 0, --bandwidth > 0, --grad-tol > 0")
    L, W, B = NETWORKS[a.network] if a.network != "custom" else (a.layers, a.width, a.batch)
    rec = recommend(L, W, B, a.ranks, perf.CommCost(a.latency, a.bandwidth), a.grad_tol,
                    margin=a.margin)
    print(f"Network: opening 784 -> {W}, {L} dense tanh steps of width {W}, classifier; batch {B}\n")
    print(rec.report())


if __name__ == "__main__":
    main()
