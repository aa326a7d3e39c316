"""Benchmarks of layer-parallel training (MGRIT) against serial and layer-wise model parallelism.

a. forward solve, deep-narrow ResNet (width 8, batch 64, tanh), 1 process: batched MGRIT
   (2 levels, m = 16..64, 2 iterations, F-relaxation) vs serial forward (no autograd);
b. full training step (forward + backward + SGD step) vs serial autograd;
c. P = 2 ranks: MGRIT vs layer-wise model parallelism (blocking chain) on the same 2 ranks;
d. cost model (mgrit.perf) calibrated here (experiments/layerparallel_calibration.py, once per
   repeat, interleaved with the measured runs; P = 2 costs on both ranks at once): errors vs
   a-c, operation counts, prediction at P = 64 (Kirby);
e. memory per rank (saved activations + states + stacked parameters) vs serial training.

Ratios are measured side by side (interleaved repeats in one run; medians). Writes
experiments/results/bench_layerparallel.md. Usage: python experiments/bench_layerparallel.py
[--quick]. The 2-rank part runs as `mpiexec -n 2 python -m mpi4py THIS --worker` subprocess.
"""
from __future__ import annotations

import argparse
import datetime
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
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))  # the shared reporting helper
from mgrit import perf  # noqa: E402
from mgrit.nn import DenseStep, LayerParallelResNet, serial_resnet  # noqa: E402
from mgrit.options import MGRITOptions  # noqa: E402
from mgrit.perf.calibration import (calibrate as _calibrate, costs_to_json,  # noqa: E402
                                      median_costs, model_section)

WIDTH, BATCH = 8, 64


def med(xs):
    return statistics.median(xs)


CLOCK = time.perf_counter  # 1-process parts: --clock cpu selects time.process_time


def timed(fn):
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def opts(m, iters, relax="F", levels=2):
    return MGRITOptions(max_levels=levels, cfactor=m, tol=0, max_iter=iters, relax=relax)


def make_lp(N, m, comm=None, relax="F", kf=2, kb=1):
    return LayerParallelResNet.build(lambda k: DenseStep(WIDTH, "tanh"), N, (WIDTH,), comm=comm,
                                     forward=opts(m, kf, relax), backward=opts(m, kb, relax))


def loss_fn(out):
    return (out ** 2).mean()


def serial_train_step(net, x, opt):
    opt.zero_grad(set_to_none=True)
    loss_fn(net(x)).backward()
    opt.step()


def calibrate(serial_layers, lp, x, m, per_layer_opt, refresh):
    """The model's costs of this rank's layers (layerparallel_calibration.calibrate) with this
    bench's network, loss and clock, incl. the solver's bookkeeping per operation; on several
    ranks the serial costs are timed one rank at a time (as the blocking chain runs)."""
    comm = lp.comm
    r, P = comm.Get_rank(), comm.Get_size()
    token = torch.zeros(1).numpy()

    def one_at_a_time(fn):  # a token passed along the ranks: the others wait in Recv, as in
        if r > 0:           # the blocking chain
            comm.Recv(token, r - 1, 99)
        fn()
        if P > 1:
            comm.Send(token, (r + 1) % P, 99)
            if r == 0:
                comm.Recv(token, P - 1, 99)
        comm.Barrier()
    return _calibrate(serial_layers, lp, x, m, per_layer_opt, refresh, loss_fn, CLOCK,
                      solver_options=lp.fwd_opts, one_at_a_time=one_at_a_time)


def lp_train_step(lp, x, opt, batch=BATCH):
    opt.zero_grad(set_to_none=True)
    out = lp(x if lp.is_first else None, batch_size=batch)
    (loss_fn(out) if lp.is_last else out.sum()).backward()
    opt.step()


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
    b = 0
    for s in (lp._fsolver, lp._bsolver):
        for st in getattr(s, "_st", []):
            b += sum(t.numel() * t.element_size() for t in (st.u, st.g, st.v) if t is not None)
    if lp._chain._stack is not None:
        b += sum(t.numel() * t.element_size() for t in lp._chain._stack.tensors.values())
        if lp._chain._stack.closed_form_vjp:  # the adjoint's act'(z) cache, one row per layer
            b += lp._states[:len(lp.steps)].numel() * lp._states.element_size()
    return b


# -- one process ------------------------------------------------------------------------------
def single_process(N, ms, reps, relax):
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    net = serial_resnet(lambda k: DenseStep(WIDTH, "tanh"), N)
    lps = {m: make_lp(N, m, relax=relax) for m in ms}
    with torch.no_grad():
        ref = net(x)
    # a: forward solve, interleaved
    fa = {"serial": [], **{f"mgrit m={m}": [] for m in ms}}
    err = {}
    for _ in range(reps):
        with torch.no_grad():
            fa["serial"].append(timed(lambda: net(x)))
            for m, lp in lps.items():
                lp.warm_start, lp._warm = False, None
                fa[f"mgrit m={m}"].append(timed(lambda: lp(x)))
                err[m] = float((lp(x) - ref).norm() / ref.norm())
    best_m = min(ms, key=lambda m: med(fa[f"mgrit m={m}"]))
    stats_a = {m: lp.last_forward.stats.as_dict() for m, lp in lps.items()}
    # b: training step (warm start on, as in inexact training); each repeat also times the
    # phases, the forward solves the model predicts, and calibrates the model (d)
    lp = lps[best_m]
    o_s, o_l = torch.optim.SGD(net.parameters(), 1e-3), torch.optim.SGD(lp.parameters(), 1e-3)
    tb = {k: [] for k in ("serial", "mgrit", "mgrit_fwd", "mgrit_bwd", "refresh", "opt",
                          "serial_fwd", "mgrit_fwd_cold")}
    cal = []
    lp.warm_start, lp._warm = True, None
    lp_train_step(lp, x, o_l)
    for _ in range(reps):
        tb["serial"].append(timed(lambda: serial_train_step(net, x, o_s)))
        tb["mgrit"].append(timed(lambda: lp_train_step(lp, x, o_l)))
        o_l.zero_grad(set_to_none=True)
        t0 = CLOCK()
        out = lp(x)
        t1 = CLOCK()
        loss_fn(out).backward()
        t2 = CLOCK()
        o_l.step()
        tb["mgrit_fwd"].append(t1 - t0)
        tb["mgrit_bwd"].append(t2 - t1)
        tb["opt"].append(CLOCK() - t2)
        tb["refresh"].append(timed(lp._chain.refresh))
        with torch.no_grad():
            tb["serial_fwd"].append(timed(lambda: net(x)))
            warm, lp._warm, lp.warm_start = lp._warm, None, False
            tb["mgrit_fwd_cold"].append(timed(lambda: lp(x)))
            lp._warm, lp.warm_start = warm, True
        cal.append(calibrate(net, lp, x, best_m, tb["opt"][-1] / N, tb["refresh"][-1] / N))
    # e: memory
    mem_serial = saved_bytes(lambda: loss_fn(net(x)).backward())
    lp_train_step(lp, x, o_l)  # hooks cannot wrap torch.func's vjp: the forward is hooked, states counted
    mem_lp = saved_bytes(lambda: lp(x)) + lp_state_bytes(lp)
    return dict(N=N, ms=ms, best_m=best_m, fa={k: med(v) for k, v in fa.items()},
                fa_ratio={m: med([a / b for a, b in zip(fa["serial"], fa[f"mgrit m={m}"])]) for m in ms},
                err=err, stats_a=stats_a, tb={k: med(v) for k, v in tb.items()},
                tb_ratio=med([a / b for a, b in zip(tb["serial"], tb["mgrit"])]),
                mem_serial=mem_serial, mem_lp=mem_lp, costs=median_costs(cal),
                tb_raw=tb, cal_raw=cal)


# -- two ranks (worker) -----------------------------------------------------------------------
def worker(N, m, reps, relax, out_path):
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH)
    lp = make_lp(N, m, comm=comm, relax=relax)
    # layer-wise model parallelism: the same layers, a blocking chain
    seq = torch.nn.Sequential(*[l for l in lp.to_serial()][lp.first:lp.first + len(lp.steps)])
    buf = torch.empty(BATCH, WIDTH)

    def chain_forward(grad):
        if rank == 0:
            y = seq(x)
            comm.Send(y.detach().numpy(), 1, 11)
            return y
        comm.Recv(buf.numpy(), 0, 11)
        xin = buf.clone().requires_grad_(grad)
        return xin, seq(xin)

    def chain_train(opt):
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            y = chain_forward(True)
            g = torch.empty_like(y)
            comm.Recv(g.numpy(), 1, 12)
            y.backward(g)
        else:
            xin, y = chain_forward(True)
            loss_fn(y).backward()
            comm.Send(xin.grad.numpy(), 0, 12)
        opt.step()

    o_c, o_l = torch.optim.SGD(seq.parameters(), 1e-3), torch.optim.SGD(lp.parameters(), 1e-3)
    comm_cost = perf.pingpong(comm, (8, BATCH * WIDTH * 4, 1 << 16))
    comm_cpu = perf.pingpong(comm, (8, BATCH * WIDTH * 4, 1 << 16), clock=time.process_time)
    res = {"chain_fwd": [], "mgrit_fwd": [], "chain_train": [], "mgrit_train": []}
    cal = []
    cpu = {k: [] for k in res}

    def sync_time(name, fn):
        comm.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        t, c = time.perf_counter() - t0, time.process_time() - c0
        cpu[name].append(comm.allreduce(c, op=MPI.MAX))
        return comm.allreduce(t, op=MPI.MAX)

    lp_train_step(lp, x, o_l)
    for _ in range(reps):
        with torch.no_grad():
            res["chain_fwd"].append(sync_time("chain_fwd", lambda: chain_forward(False)))
            lp.warm_start, lp._warm = False, None
            res["mgrit_fwd"].append(sync_time("mgrit_fwd", lambda: lp(x if rank == 0 else None, batch_size=BATCH)))
        fstats = lp.last_forward.stats.as_dict()
        lp.warm_start = True
        res["chain_train"].append(sync_time("chain_train", lambda: chain_train(o_c)))
        res["mgrit_train"].append(sync_time("mgrit_train", lambda: lp_train_step(lp, x, o_l)))
        # model calibration on both ranks at once (both cores busy, as in the measured runs)
        comm.Barrier()
        t_opt, t_ref = timed(o_l.step), timed(lp._chain.refresh)
        cal.append(calibrate(seq, lp, x, m, t_opt / len(lp.steps), t_ref / len(lp.steps)))
    mem = saved_bytes(lambda: chain_train(o_c))
    lp_train_step(lp, x, o_l)
    mem_lp = saved_bytes(lambda: lp(x if rank == 0 else None, batch_size=BATCH)) + lp_state_bytes(lp)
    stats = comm.gather(fstats, root=0)
    costs = comm.gather(costs_to_json(median_costs(cal)), root=0)
    costs_raw = comm.gather([costs_to_json(c) for c in cal], root=0)
    mems = comm.gather((mem, mem_lp), root=0)
    if rank == 0:
        out = {k: med(v) for k, v in res.items()}
        out["raw"], out["costs_raw"] = res, costs_raw
        out["fwd_ratio"] = med([a / b for a, b in zip(res["chain_fwd"], res["mgrit_fwd"])])
        out["train_ratio"] = med([a / b for a, b in zip(res["chain_train"], res["mgrit_train"])])
        out.update(stats=stats, mem=mems, costs=costs, comm=[comm_cost.latency, comm_cost.bandwidth],
                   comm_cpu=[comm_cpu.latency, comm_cpu.bandwidth])
        out["cpu"] = {k: med(v) for k, v in cpu.items()}
        out["cpu_fwd_ratio"] = med([a / b for a, b in zip(cpu["chain_fwd"], cpu["mgrit_fwd"])])
        out["cpu_train_ratio"] = med([a / b for a, b in zip(cpu["chain_train"], cpu["mgrit_train"])])
        Path(out_path).write_text(json.dumps(out))


def run_two_ranks(N, m, reps, relax):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p2.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        mpiexec = Path(sys.executable).parent / "mpiexec"
        cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", "2", sys.executable, "-m",
               "mpi4py", __file__, "--worker", "--layers", str(N), "--m", str(m),
               "--repeats", str(reps), "--relax", relax, "--out", str(path)]
        subprocess.run(cmd, env=env, check=True, timeout=1800)
        return json.loads(path.read_text())


# -- report -----------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (N = 256, 1024)")
    ap.add_argument("--layers", type=int, nargs="+", default=None)
    ap.add_argument("--m", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--relax", default="F")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="1-process timings: CPU time of the process (default; robust on a shared "
                         "machine) or wall clock. The 2-rank part always uses wall clock.")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "experiments/results/bench_layerparallel.md"))
    a = ap.parse_args()
    if a.worker:
        return worker(a.layers[0], a.m[0], a.repeats, a.relax, a.out)
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    Ns = a.layers or ([256, 1024] if a.quick else [1024, 4096])
    load0 = os.getloadavg()
    r1 = {N: single_process(N, [m for m in a.m if N // m >= 2], a.repeats, a.relax) for N in Ns}
    r2 = {N: run_two_ranks(N, r1[N]["best_m"], a.repeats, a.relax) for N in Ns}
    load1 = os.getloadavg()
    L = []
    cmd = " ".join([Path(sys.executable).name, *sys.argv])
    from mgrit.training import report as reporting
    commit = reporting.run_metadata()["commit"]  # "+dirty" when code differs from the commit
    L += ["# Layer-parallel benchmarks (`experiments/bench_layerparallel.py`)", "",
          f"- command: `{cmd}`", f"- git commit: {commit}",
          f"- machine: {platform.node()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores (shared), torch {torch.__version__}, 1 thread per process",
          f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
          f"- load average before/after: {load0[0]:.2f} / {load1[0]:.2f}",
          f"- network: DenseStep width {WIDTH}, tanh, batch {BATCH}, float32, T = 1; MGRIT 2 levels, "
          f"relax {a.relax}, forward 2 / backward 1 iterations (tol 0); medians of {a.repeats} "
          f"interleaved repeats; ratio = median of per-repeat ratios",
          f"- clock: 1-process parts (a, b, calibration) {'CPU time of the process (time.process_time)' if a.clock == 'cpu' else 'wall clock'}; "
          f"2-rank part (c) wall clock, max over ranks, after a barrier", ""]
    big = max(Ns)
    L += ["## a. Forward solve, 1 process (serial forward / MGRIT, no autograd)", "",
          "| N | m | serial [s] | MGRIT [s] | speedup | rel. error vs serial (2 it) |",
          "|---|---|---|---|---|---|"]
    for N, r in r1.items():
        for m in r["ms"]:
            L.append(f"| {N} | {m} | {r['fa']['serial']:.4f} | {r['fa'][f'mgrit m={m}']:.4f} | "
                     f"{r['fa_ratio'][m]:.2f}x | {r['err'][m]:.2e} |")
    ra = max(r1[big]["fa_ratio"].values())
    L += ["", f"Target >= 3x at N = {big}: **{'MET' if ra >= 3 else 'MISSED'}** (best {ra:.2f}x).", ""]
    L += ["## b. Training step, 1 process (forward + backward + SGD)", "",
          "| N | m | serial [s] | MGRIT [s] | speedup | MGRIT fwd / bwd / opt / refresh [s] |",
          "|---|---|---|---|---|---|"]
    for N, r in r1.items():
        t = r["tb"]
        L.append(f"| {N} | {r['best_m']} | {t['serial']:.4f} | {t['mgrit']:.4f} | {r['tb_ratio']:.2f}x | "
                 f"{t['mgrit_fwd']:.4f} / {t['mgrit_bwd']:.4f} / {t['opt']:.4f} / {t['refresh']:.4f} |")
    L += ["", f"Target >= 2x: **{'MET' if r1[big]['tb_ratio'] >= 2 else 'MISSED'}** "
          f"({r1[big]['tb_ratio']:.2f}x at N = {big}).", ""]
    L += ["## c. P = 2 ranks: MGRIT vs layer-wise model parallelism (blocking chain)", "",
          "Clock `wall`: wall clock, max over ranks. Clock `cpu`: CPU time of each rank's process, max "
          "over ranks (MPICH busy-polls while waiting, so waiting counts; insensitive to the other "
          "engineers' load on the 2 shared cores).", "",
          "| N | m | clock | chain fwd [s] | MGRIT fwd [s] | fwd speedup | chain train [s] | MGRIT train [s] | train speedup |",
          "|---|---|---|---|---|---|---|---|---|"]
    for N, r in r2.items():
        for ck, t, fr, tr in [("wall", r, r["fwd_ratio"], r["train_ratio"]),
                              ("cpu", r["cpu"], r["cpu_fwd_ratio"], r["cpu_train_ratio"])]:
            L.append(f"| {N} | {r1[N]['best_m']} | {ck} | {t['chain_fwd']:.4f} | {t['mgrit_fwd']:.4f} | {fr:.2f}x | "
                     f"{t['chain_train']:.4f} | {t['mgrit_train']:.4f} | {tr:.2f}x |")
    rc = max(r2[big]["fwd_ratio"], r2[big]["cpu_fwd_ratio"])
    L += ["", f"Target >= 3x at N = {big}: **{'MET' if rc >= 3 else 'MISSED'}** (forward {rc:.2f}x, "
          f"training step {r2[big]['train_ratio']:.2f}x). Measured message cost: latency "
          f"{r2[big]['comm'][0] * 1e6:.1f} us, bandwidth {r2[big]['comm'][1] / 1e9:.2f} GB/s (wall); "
          f"{r2[big]['comm_cpu'][0] * 1e6:.1f} us, {r2[big]['comm_cpu'][1] / 1e9:.2f} GB/s (cpu).", ""]
    L += model_section(r1, r2, Ns, a.relax, opts)  # d
    L += ["## e. Memory per rank (saved-for-backward tensors + MGRIT states + stacked parameters)", "",
          "| N | serial [KiB] | MGRIT P=1 [KiB] | chain P=2 ranks [KiB] | MGRIT P=2 ranks [KiB] |", "|---|---|---|---|---|"]
    for N in Ns:
        m2 = r2[N]["mem"]
        L.append(f"| {N} | {r1[N]['mem_serial'] / 1024:.0f} | {r1[N]['mem_lp'] / 1024:.0f} | "
                 f"{' / '.join(f'{x[0] / 1024:.0f}' for x in m2)} | {' / '.join(f'{x[1] / 1024:.0f}' for x in m2)} |")
    L += ["", "## Phase instrumentation (SolverStats of the last forward solve, P = 1; wall clock, "
          "load-inflated)", ""]
    for N in Ns:
        for m, s in r1[N]["stats_a"].items():
            L.append(f"- N = {N}, m = {m}: " + ", ".join(f"{k} {v:.4f}s" for k, v in s["time"].items())
                     + f"; steps {s['step_applications']} (single {s['steps_single']}, batched "
                       f"{s['steps_batched_items']} in {s['steps_batched_calls']} calls)")
    text = "\n".join(L) + "\n"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
