"""Benchmarks of layer-parallel training (MGRIT) against the strongest baselines, and the
validation of the cost model (mgrit.perf) on the same runs.

Network: dense tanh ResNet (DenseStep, width 8, batch 64, float32, T = 1), loss mean(out^2),
SGD. Baselines, side by side in one run (interleaved repeats; ratios = medians of per-repeat
ratios; every table names its strongest baseline):

1. ``nn.Sequential`` serial autograd (what a user writes first);
2. the lean serial loop (mgrit.perf.lean: addmm / tanh_ / add_ per layer, preallocated buffers,
   closed-form backward) and torch.compile of it (reported when it does not compile);
3. data parallelism on the same ranks (lean replicas + one Allreduce; nn.Sequential replicas +
   GradientBuckets);
4. GPipe with M micro-batches (mgrit.perf.baselines, lean stages), P = 2;
5. layer-wise model parallelism, the blocking chain (nn.Sequential and lean stages) -- Kirby's
   baseline, never the headline.

Parts: a/b one process (forward; training step; incl. the 1-level exact path, T1, and the
single-process bound of batched MGRIT from pure kernels, T2); c two ranks (training step and
forward, T3: MGRIT on 2 ranks vs the lean loop on 1); d the model's predictions of every
configuration of a-c from per-repeat calibrations (T5) and a ping-pong message chain; e Kirby's
setting from the calibrated model (T4); f memory.

Every timing table (issue 24, item 3; ``experiments/benchmarks/baselines_common.py``): one row
per option with median [IQR] and min-max over the interleaved repeats, its speed-up over the
strongest baseline (1 process: nn.Sequential, the lean loop, torch.compile of it; 2 ranks: the
lean loop and its torch.compile on rank 0 alone, data parallelism with lean / nn.Sequential /
compiled lean replicas), the gradient error of MGRIT (fixed cycles: inexact) beside its time
(relative error of the steps' parameter gradient against serial autograd on the same batch,
cold and warm start, float32 gradients), one verdict sentence per table; the raw per-repeat
times in ``bench_layerparallel.raw.json`` beside the table.

Usage: ``python experiments/benchmarks/bench_layerparallel.py [--quick]`` writes
experiments/results/benchmarks/bench_layerparallel.md (``--quick``/``--smoke``: N = 64, one
repeat, no compile: a smoke test of well under a minute on 2 idle cores; full: N = 256, 1024, 10
interleaved repeats, compiled baselines: 272 s (5 min) measured at 48a9d82, 2 idle cores
(``results/manifest.json``)). The 2-rank part runs as ``mpiexec -n 2 python -m mpi4py
experiments/benchmarks/bench_layerparallel_ranks.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
from experiments.benchmarks import baselines_common as bc  # noqa: E402
from experiments.benchmarks.bench_layerparallel_report import report, raw_samples  # noqa: E402 (the report half of this script)
from mgrit.nn import DenseStep, LayerParallelResNet, serial_resnet  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.perf import calibration as cal, netcal, strategies as st  # noqa: E402
from mgrit.perf.lean import COMPILE_ERRORS, LeanResNet, compiled_forward, compiled_train_step  # noqa: E402
from mgrit.reporting import writers as reporting  # noqa: E402

WIDTH, BATCH, LR = 8, 64, 1e-3
LEAN_SIZES = (1, 2, 4, 8, 16, 32, 64)  # batch sizes of the lean curves (GPipe micro-batches)
MOD_SIZES = (32, 64)                   # nn.Sequential curves: full batch and the P_D = 2 shard
med = statistics.median


def opts(m, iters, relax="F", levels=2):
    return MGRITOptions(max_levels=levels, cfactor=m, tol=0, max_iter=iters, relax=relax)


ONE = MGRITOptions(max_levels=1)


def make_lp(N, m=None, comm=None, relax="F", kf=2, kb=1):
    """2-level MGRIT (``m``) or, with ``m=None``, the 1-level exact path."""
    fo, bo = (ONE, ONE) if m is None else (opts(m, kf, relax), opts(m, kb, relax))
    return LayerParallelResNet.build(lambda k: DenseStep(WIDTH, "tanh"), N, (WIDTH,), comm=comm,
                                     forward=fo, backward=bo)


def make_serial(N):
    return serial_resnet(lambda k: DenseStep(WIDTH, "tanh"), N)


def loss_fn(out):
    return (out ** 2).mean()


def serial_train_step(net, x, opt):
    opt.zero_grad(set_to_none=True)
    loss_fn(net(x)).backward()
    opt.step()


def lp_train_step(lp, x, opt, batch=BATCH):
    opt.zero_grad(set_to_none=True)
    out = lp(x if lp.is_first else None, batch_size=batch)
    (loss_fn(out) if lp.is_last else out.sum()).backward()
    opt.step()


def lp_forward_cold(lp, x, batch=BATCH):
    with torch.no_grad():
        lp.warm_start = False  # a cold start: the warm state is neither read nor replaced
        lp(x if lp.is_first else None, batch_size=batch)
        lp.warm_start = True


def mgrit_grad_error(lp, x, cold: bool, comm=None) -> float:
    """Relative error ``||g - g_exact|| / ||g_exact||`` (float32 gradients, float64 norms,
    over all ranks) of the steps' parameter gradient of one MGRIT forward + backward of ``lp``
    on ``x`` against serial autograd of ``lp.to_serial()`` (the same weights, the same batch).
    ``cold``: the forward starts from zero states (the first step of training); otherwise from
    ``lp``'s warm state (the previous training step's states, as in the timed steps). No
    optimizer step; ``lp``'s gradients are cleared afterwards. Collective with ``comm``."""
    lo, n = lp.first, len(lp.steps)
    serial = lp.to_serial()  # copies of the current weights, on every rank (collective)
    loss_fn(serial(x)).backward()
    exact = [p.grad for l in list(serial)[lo:lo + n] for p in l.F.parameters()]
    mine = [p for s in lp.steps for p in s.parameters()]
    for p in lp.parameters():
        p.grad = None
    lp.warm_start = not cold
    try:
        out = lp(x if lp.is_first else None, batch_size=x.shape[0])
        (loss_fn(out) if lp.is_last else out.sum()).backward()
    finally:
        lp.warm_start = True
    err = bc.grad_error([p.grad for p in mine], exact, comm)
    for p in lp.parameters():
        p.grad = None
    return err


def compile_fns(lean, block, enabled):
    """``(forward, train_step, note)``: torch.compile of the lean loop, or ``(None, None, why)``
    (disabled, or the compile failure: only torch.compile's own errors are caught)."""
    if not enabled:
        return None, None, "not run (--quick / --no-compile)"
    try:
        f, s = compiled_forward(lean, block), compiled_train_step(lean, block)
        x = torch.randn(BATCH, WIDTH)
        t0 = time.perf_counter()
        f(x)
        s(x, 0.0)
        return f, s, f"compiled in {time.perf_counter() - t0:.0f} s (inductor, blocks of {block} layers)"
    except COMPILE_ERRORS as e:
        return None, None, f"does not compile here: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def calibrate_repeat(lp, lp1, serial_layers, x, m, clock, lean, cal_reps, opt_time):
    """One repeat's calibration (JSON): MGRIT's TrainCosts (2 levels; the exact path; the
    2-level forward with Kirby's one-level adjoint), the
    nn.Sequential and lean NetCosts of this rank's layers (lean: its first <= 256 layers)."""
    n = len(lp.steps)
    tc = cal.chain_costs(lp, x, m, clock, cal_reps, 10, lp.fwd_opts, opt_time / n)
    tc1 = cal.chain_costs(lp1, x, m, clock, cal_reps, 10, ONE, opt_time / n)
    # Kirby's variant: lp's multilevel forward, then a one-level (serial) adjoint
    tk = cal.chain_costs(lp, x, m, clock, cal_reps, 10, lp.fwd_opts, opt_time / n, backward=ONE)
    mod = netcal.module_costs(None, [l.F for l in serial_layers], serial_layers[0].h, None,
                              lambda o, t: loss_fn(o), x, None, MOD_SIZES, cal_reps, clock,
                              depth=256, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    ln = netcal.lean_costs(lean.slice(0, min(lean.n_layers, 256)), LEAN_SIZES, cal_reps, clock)
    return {"mgrit": cal.costs_to_json(tc), "exact": cal.costs_to_json(tc1),
            "kirby": cal.costs_to_json(tk),
            "module": st.netcosts_to_json(mod), "lean": st.netcosts_to_json(ln)}


def steady(timed, fn):
    """Seconds of ``fn()`` in steady state: one untimed call first, then the timed one. A
    training loop calls the same step back to back; the benchmark interleaves configurations
    between repeats (fair under drifting load), and the untimed call refills the caches that the
    previous configuration evicted, as the previous step of a training loop would have."""
    fn()
    return timed(fn)


# -- one process ------------------------------------------------------------------------------
def single_process(N, ms, reps, relax, compiled, clock, cal_reps):
    timed = cal.timer(clock)
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    net = make_serial(N)
    lean, lean_t = LeanResNet.from_sequential(net), LeanResNet.from_sequential(net)
    lps = {m: make_lp(N, m, relax=relax) for m in ms}
    exact = make_lp(N)
    cf, ct, cnote = compile_fns(LeanResNet.from_sequential(net), 16, compiled and N % 16 == 0)
    with torch.no_grad():
        ref = net(x)
    fa = {"seq": lambda: net(x), "lean": lambda: lean.forward(x),
          **({"compiled": lambda: cf(x)} if cf else {}),
          **{f"mgrit m={m}": (lambda lp=lp: lp_forward_cold(lp, x)) for m, lp in lps.items()}}
    fwd = {k: [] for k in fa}
    with torch.no_grad():
        for _ in range(reps):
            for k, fn in fa.items():
                fwd[k].append(steady(timed, fn))
    err = {}
    with torch.no_grad():
        for m, lp in lps.items():
            lp_forward_cold(lp, x)
            err[m] = float((lp(x) - ref).norm() / ref.norm())
    best_m = min(ms, key=lambda m: med(fwd[f"mgrit m={m}"]))
    lp = lps[best_m]
    stats_a = lp.last_forward.stats.as_dict()
    o_s, o_l, o_e = (torch.optim.SGD(p, LR) for p in (net.parameters(), lp.parameters(), exact.parameters()))
    gerr = {"cold": mgrit_grad_error(lp, x, cold=True)}
    lp.warm_start = True
    lp.set_warm_state(None)
    ta = {"seq": lambda: serial_train_step(net, x, o_s), "lean": lambda: lean_t.train_step(x, LR),
          **({"compiled": lambda: ct(x, LR)} if ct else {}),
          "mgrit": lambda: lp_train_step(lp, x, o_l), "exact1": lambda: lp_train_step(exact, x, o_e)}
    for fn in ta.values():
        fn()  # warm-up (and the warm start's first states)
    train = {k: [] for k in ta}
    cals = []
    for _ in range(reps):
        for k, fn in ta.items():
            train[k].append(steady(timed, fn))
        t_opt = timed(o_l.step)
        cals.append(calibrate_repeat(lp, exact, net, x, best_m, clock, lean, cal_reps, t_opt))
    gerr["warm"] = mgrit_grad_error(lp, x, cold=False)
    kern = netcal.kernel_cost(WIDTH, BATCH, repeats=max(cal_reps, 3), clock=clock)
    return dict(N=N, ms=ms, best_m=best_m, fwd=fwd, train=train, err=err, gerr=gerr, stats=stats_a, cal=cals,
                compile=cnote, kernel=[kern.single, kern.call, kern.item],
                mem=memory_one(net, lp, x, o_l))


# -- memory -------------------------------------------------------------------------------------
def saved_bytes(fn):
    """Bytes of distinct tensors saved for backward while ``fn`` runs."""
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def lp_state_bytes(lp):
    """MGRIT states of both solvers + stacked parameters (the solvers' and the chain's private
    buffers: 0 if renamed)."""
    b = 0
    for s in (lp.forward_solver, lp.backward_solver):
        for stt in getattr(s, "_st", []) or []:
            b += sum(t.numel() * t.element_size() for t in (stt.u, stt.g, stt.v) if t is not None)
    stack = getattr(lp.chain, "_stack", None)
    if stack is not None:
        b += sum(t.numel() * t.element_size() for t in stack.tensors.values())
    return b


def memory_one(net, lp, x, opt):
    mem_serial = saved_bytes(lambda: loss_fn(net(x)).backward())
    lp_train_step(lp, x, opt)
    return [mem_serial, saved_bytes(lambda: lp(x)) + lp_state_bytes(lp)]


# -- two ranks -----------------------------------------------------------------------------------
def run_two_ranks(N, m, reps, relax, cal_reps, compiled):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p2.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        mpiexec = os.environ.get("LAYERPAR_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
        cmd = [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py",
               str(ROOT / "experiments" / "benchmarks" / "bench_layerparallel_ranks.py"), "--layers", str(N),
               "--m", str(m), "--repeats", str(reps), "--relax", relax, "--cal-repeats",
               str(cal_reps), "--out", str(path), *(["--compile"] if compiled else [])]
        subprocess.run(cmd, env=env, check=True, timeout=3600)
        return json.loads(path.read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: N = 64, 1 repeat, no compile")
    ap.add_argument("--smoke", action="store_true", help="the same as --quick")
    ap.add_argument("--layers", type=int, nargs="+", default=None)
    ap.add_argument("--m", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--repeats", type=int, default=None, help="default 10 (quick: 1)")
    ap.add_argument("--relax", default="F")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="1-process parts: CPU time of the process (default; robust on a shared "
                         "machine) or wall clock. The 2-rank part always uses wall clock.")
    ap.add_argument("--out", default=str(ROOT / "experiments/results/benchmarks/bench_layerparallel.md"))
    a = ap.parse_args()
    a.quick = a.quick or a.smoke
    reps = a.repeats or (1 if a.quick else 10)
    cal_reps = 1 if a.quick else 3
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    Ns = a.layers or ([64] if a.quick else [256, 1024])
    ms = [16] if a.quick and a.layers is None else a.m
    prov = reporting.run_metadata()  # command, commit, machine, cores, date, load before
    t0 = time.time()
    r1 = {N: single_process(N, [m for m in ms if N // m >= 2], reps, a.relax,
                            not (a.quick or a.no_compile), clock, cal_reps) for N in Ns}
    compiled = not (a.quick or a.no_compile)
    r2 = {N: run_two_ranks(N, r1[N]["best_m"], reps, a.relax, cal_reps, compiled and N % 16 == 0)
          for N in Ns}
    meta = dict(prov=reporting.finish_metadata(prov),  # the load after the runs
                minutes=(time.time() - t0) / 60, reps=reps, relax=a.relax, clock=a.clock,
                machine=f"{platform.node()}, {platform.processor() or platform.machine()}, "
                        f"{os.cpu_count()} cores, torch {torch.__version__}")
    text = report(r1, r2, Ns, meta)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    reporting.write_raw(bc.raw_path(a.out), raw_samples(r1, r2, Ns), meta["prov"])
    print(text)


if __name__ == "__main__":
    main()
