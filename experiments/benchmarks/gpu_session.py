"""One GPU lease in one command: correctness of the CUDA path and the concurrency MGRIT buys on
one GPU (issue 38). Run through ``gpu_session.sh`` (it installs carried MPI wheels first).

Usage::

    python experiments/benchmarks/gpu_session.py --out DIR [--device cuda] [--bench-budget-s 170]
    python experiments/benchmarks/gpu_session.py --out DIR --device cpu   # tiny code-path run

Sections, in this order (1, 3, 2, 4, 5, 6) (each recorded, an error in one does not stop the others; ``DIR/gpu_session.json`` is
rewritten after each, so a run cut short still leaves what it measured):

1. ``env``: device, driver, torch/CUDA versions, MPI library, commit (``$LAYERPAR_COMMIT`` or
   git), the command;
2. ``jobs``: the main job (``experiments/train.py``, MNIST subset, 1 epoch) on ``--device`` vs
   the same job on the CPU: float64 exact (``--tol 1e-12``) at P = 1, P_L = 2 x P_D = 2
   (4 ranks sharing the GPU) and tied layers at P_L = 2 (every parameter within 1e-10);
   float32 inexact (default cycles) at P = 1 within 1e-4 (float32 round-off accumulated over
   32 layers and 8 steps, with margin); plus ``gpu_check.py`` (2 ranks);
3. ``checks``: in-process float64 checks (``gpu_correctness.py``: converged solve, BatchNorm,
   Dropout/DropPath, tied);
4. ``bench``: batched MGRIT vs serial eager / lean / CUDA-graph / compiled lean
   (``gpu_concurrency.py``): N = 1024, 4096; widths 8, 32, 128; batch 64; float32;
5. ``staging``: host-staging time of one state message and of the gradient buckets, and a
   timed 2-rank P_L = 2 training step with its message count (share of staging in a step);
6. ``mgrit_graph``: whether the MGRIT forward can be captured in a CUDA graph.

On ``--device cuda`` without CUDA it fails (exit 2) instead of skipping. Exit 1 when a
correctness check fails, else 0. Writes ``gpu_session.json`` and ``gpu_session.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mgrit.reporting import writers  # noqa: E402

TOL64 = 1e-10
#: float32 runs: eps32 (1.2e-7) x 32 layers x 8 SGD steps ~ 3e-5 of accumulated round-off, with margin
TOL32 = 1e-4
JOB = ["experiments/train.py", "--layers", "32", "--width", "8", "--limit-train", "512",
       "--limit-test", "256", "--epochs", "1", "--batch-size", "64", "--seed", "0", "--no-progress"]
EXACT = ["--tol", "1e-12", "--dtype", "float64"]


def log(msg):
    print(msg, flush=True)


def _sh(cmd, timeout=30):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {e}"


def mpiexec_path():
    return os.environ.get("LAYERPAR_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")


def provenance(dev):
    """The results' provenance (:func:`mgrit.reporting.writers.run_metadata`), the commit from
    ``$LAYERPAR_COMMIT`` where the tree is a copy without git, the device in ``machine``."""
    meta = writers.run_metadata()
    meta["commit"] = os.environ.get("LAYERPAR_COMMIT") or meta["commit"]
    if dev.type == "cuda":
        meta["machine"] += f", {torch.cuda.get_device_name(dev)}"
    return meta


def env_section(dev):
    commit = os.environ.get("LAYERPAR_COMMIT") or _sh(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    e = {"commit": commit, "command": " ".join(shlex.quote(a) for a in sys.argv),
         "python": sys.version.split()[0], "executable": sys.executable,
         "torch": torch.__version__, "torch_cuda": torch.version.cuda,
         "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
         "host": platform.node(), "cpus": os.cpu_count(), "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
         "loadavg": open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else None,
         "mpiexec": mpiexec_path(),
         "mpi_library": _sh([sys.executable, "-c", "from mpi4py import MPI; import mpi4py; "
                             "print(mpi4py.__version__, MPI.Get_library_version().splitlines()[0])"])}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        e.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                 sms=p.multi_processor_count,
                 nvidia_smi=_sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                                 "clocks.max.sm,power.limit,temperature.gpu,utilization.gpu", "--format=csv"]))
    else:
        e["device"] = "cpu (code-path run: numbers mean nothing for a GPU)"
    return e


def _job(name, ranks, device, extra, base, threads):
    out = base / f"{name}-{device}"
    cmd = [sys.executable] + JOB + extra + ["--device", device, "--out", str(out), "--threads", str(threads),
                                           "--overwrite"]
    if ranks > 1:
        cmd = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "mpi4py"] + cmd[1:]
    return out, cmd


def _model(out):
    ck = torch.load(out / "model.pt", map_location="cpu", weights_only=False)
    return ck["model"], json.loads((out / "summary.json").read_text())["final"]


def _diff(a, b):
    """Largest ``max|a - b| / max|b|`` over the state dicts' float tensors."""
    worst = 0.0
    for k, v in b.items():
        if torch.is_tensor(v) and v.is_floating_point():
            w = a[k].double()
            worst = max(worst, float((w - v.double()).abs().max() / v.double().abs().max().clamp_min(1e-300)))
    return worst


def _run_wave(specs, env, timeout):
    procs = [(name, out, cmd, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True))
             for name, out, cmd in specs]
    res = {}
    for name, out, cmd, p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text = (p.communicate()[0] or "") + f"\nTIMEOUT after {timeout} s"
        res[name] = {"rc": p.returncode, "out": out, "cmd": " ".join(shlex.quote(c) for c in cmd),
                     "tail": text[-1500:]}
    return res


def jobs_section(dev, base, mpi_ok):
    """The main job on ``dev`` against the CPU; returns the comparisons and each run's line."""
    d = dev.type
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p1 = [("p1_f64_exact", 1, EXACT), ("p1_f32_inexact", 1, ["--dtype", "float32"])]
    wave1 = [(f"{n}-{dv}", *_job(n, r, dv, x, base, 2)) for n, r, x in p1 for dv in ("cpu", d)]
    mp = [("pl2xpd2_f64_exact", 4, EXACT + ["--dp", "2"]), ("tied_pl2_f64_exact", 2, EXACT + ["--tied"])]
    wave2 = [(f"{n}-{dv}", *_job(n, r, dv, x, base, 1)) for n, r, x in mp for dv in ("cpu", d)] if mpi_ok else []
    runs = {}
    t0 = time.time()
    runs.update(_run_wave(wave1, env, 240))
    if mpi_ok:
        check = [sys.executable, "experiments/benchmarks/gpu_check.py"] + (["--dry-run"] if d == "cpu" else [])
        runs.update(_run_wave(wave2 + [("gpu_check", None, check)], env, 240))
    log(f"[jobs] {len(runs)} runs in {time.time() - t0:.0f} s")
    cmp = {}
    for name, _, _ in p1 + (mp if mpi_ok else []):
        a, b = runs.get(f"{name}-{d}"), runs.get(f"{name}-cpu")
        try:
            (ma, fa), (mb, fb) = _model(a["out"]), _model(b["out"])
            cmp[name] = {"param_rel_diff": _diff(ma, mb), "loss_dev": fa["loss"], "loss_cpu": fb["loss"],
                         "test_acc_dev": fa["test_acc"], "test_acc_cpu": fb["test_acc"]}
        except Exception as e:  # noqa: BLE001 -- a failed run is a failed comparison
            cmp[name] = {"error": f"{type(e).__name__}: {e}", "tail_dev": a and a["tail"][-600:],
                         "tail_cpu": b and b["tail"][-600:]}
    for name, c in cmp.items():
        if "error" not in c:
            c["tol"] = TOL64 if "f64" in name else None
    if "p1_f32_inexact" in cmp and "error" not in cmp["p1_f32_inexact"]:
        cmp["p1_f32_inexact"]["tol"] = TOL32
    for c in cmp.values():
        c["pass"] = "error" not in c and c.get("tol") is not None and c["param_rel_diff"] <= c["tol"]
    gc = runs.get("gpu_check")
    if gc:
        cmp["gpu_check_2rank"] = {"pass": gc["rc"] == 0, "output": gc["tail"][-1200:]}
    lines = {k: {"rc": v["rc"], "cmd": v["cmd"]} for k, v in runs.items()}
    return {"comparisons": cmp, "runs": lines,
            "failed_tails": {k: v["tail"] for k, v in runs.items() if v["rc"] != 0}}


def mpi_step_worker(n, width, m, batch):
    """2 ranks: a timed P_L = 2 training step (float32) and its messages per step (rank 0 prints)."""
    from mpi4py import MPI

    from mgrit.nn import LayerParallelResNet, make_step
    from mgrit.options import MGRITOptions
    from mgrit.parallel.procgrid import device_for_rank
    comm = MPI.COMM_WORLD
    dev = device_for_rank(comm)
    fwd = MGRITOptions(max_levels=2, cfactor=m, relax="F", tol=0, max_iter=2)
    bwd = MGRITOptions(max_levels=2, cfactor=m, relax="F", tol=0, max_iter=1)
    lp = LayerParallelResNet.build(lambda k: make_step("dense", width, "tanh"), n, (width,), comm=comm,
                                   forward=fwd, backward=bwd, warm_start=False, seed=0).to(dev)
    x = torch.randn(batch, width, device=dev)
    opt = torch.optim.SGD(lp.parameters(), lr=1e-3, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        out = lp(x if lp.is_first else None, batch_size=batch)
        (out.square().mean() if lp.is_last else out.sum()).backward()
        opt.step()
    ts = []
    for i in range(8):
        comm.Barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ts.append(time.perf_counter() - t0)
    msgs = lp.last_forward.stats.messages + lp.last_backward.stats.messages
    nbytes = lp.last_forward.stats.bytes_sent + lp.last_backward.stats.bytes_sent
    worst = comm.allreduce(max(ts[3:]), op=MPI.MAX)
    allm = comm.gather(msgs, root=0)
    if comm.Get_rank() == 0:
        print("MPISTEP " + json.dumps({"N": n, "width": width, "m": m, "batch": batch, "device": str(dev),
                                       "step_s_median": sorted(ts[3:])[len(ts[3:]) // 2], "step_s_max": worst,
                                       "messages_per_step_by_rank": allm, "bytes_sent_rank0": nbytes}), flush=True)
    return 0


def staging_section(dev, quick, bench_rows, mpi_ok):
    from experiments.benchmarks.gpu_concurrency import run_staging
    widths = (8,) if quick else (8, 32, 128)
    Ns = (64,) if quick else (1024, 4096)
    sizes = {f"message_w{w}": 64 * w for w in widths}
    sizes.update({f"grad_bucket_N{n}_w{w}": n * w * w + n * w for n in Ns for w in widths})
    out = {"copies": run_staging(dev, sizes)}
    shares = {}
    for row in bench_rows:  # data parallelism: one bucket D2H + H2D per step, pageable
        c = out["copies"].get(f"grad_bucket_N{row['N']}_w{row['width']}")
        if not c:
            continue
        stage = c["d2h_pageable"]["median_s"] + c["h2d_pageable"]["median_s"]
        for v in ("lean_graph", "lean_eager", "mgrit", "serial_eager"):
            t = row["variants"].get(v, {}).get("train")
            if t:
                shares[f"N{row['N']}_w{row['width']}_{v}"] = {"staging_s": stage, "step_s": t["median_s"],
                                                             "share": stage / (stage + t["median_s"])}
    out["bucket_share_of_dp_step"] = shares
    if mpi_ok:
        n, w, m = (64, 8, 8) if quick else (1024, 32, 32)
        cmd = [mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()),
               "--mpi-step-worker", str(n), str(w), str(m), "64"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("MPISTEP ")]
        if not line:
            out["mpi_step_error"] = (r.stdout + r.stderr)[-1500:]
        else:
            s = json.loads(line[0][8:])
            c = out["copies"][f"message_w{w}"]
            per = c["d2h_pageable"]["median_s"] + c["h2d_pageable"]["median_s"]
            s["staging_per_message_s"] = per
            s["staging_share_estimate"] = max(s["messages_per_step_by_rank"]) * per / s["step_s_median"]
            out["mpi_step_pl2"] = s
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="folder for gpu_session.json / .md and the job runs")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--bench-budget-s", type=float, default=170.0, help="seconds the benchmark may "
                    "take: it starts no configuration (and no compilation) after that (default 170)")
    ap.add_argument("--sections", default="checks,bench,staging,mgrit_graph,jobs",
                    help="comma-separated sections to run (env and the report always run)")
    ap.add_argument("--mpi-step-worker", nargs=4, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mpi_step_worker:
        return mpi_step_worker(*args.mpi_step_worker)
    if not args.out:
        ap.error("--out is required")
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    cuda_missing = dev.type == "cuda" and not torch.cuda.is_available()
    meta = provenance(torch.device("cpu") if cuda_missing else dev)
    res = {"meta": dict(meta), "sections": {}, "errors": {}}
    path = out / "gpu_session.json"

    def save():
        res["wall_s"] = time.time() - t_start
        res["meta"] = writers.finish_metadata(meta)  # loadavg_after: now
        path.write_text(json.dumps(res, indent=1, default=str))

    if cuda_missing:
        res["errors"]["cuda"] = f"--device cuda but torch.cuda.is_available() is False (torch {torch.__version__})"
        save()
        print("FAIL: " + res["errors"]["cuda"], file=sys.stderr)
        return 2
    quick = dev.type == "cpu"
    mpi_ok = Path(mpiexec_path()).exists()

    wanted = set(args.sections.split(",")) | {"env", "markdown"}

    def section(name, fn):
        if name not in wanted:
            return
        t0 = time.time()
        try:
            res["sections"][name] = fn()
        except Exception:  # noqa: BLE001 -- recorded, the next section still runs
            res["errors"][name] = traceback.format_exc()[-3000:]
            log(f"[{name}] ERROR\n{res['errors'][name]}")
        res.setdefault("section_s", {})[name] = time.time() - t0
        save()

    section("env", lambda: env_section(dev))
    log(f"[env] {json.dumps(res['sections'].get('env'), default=str)}")
    if not mpi_ok:
        res["errors"]["mpi"] = f"no mpiexec at {mpiexec_path()}: the multi-rank parts did not run"
    from experiments.benchmarks.gpu_correctness import run_checks
    section("checks", lambda: run_checks(dev, log))
    section("jobs", lambda: jobs_section(dev, Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_session_runs", mpi_ok))
    from experiments.benchmarks.gpu_concurrency import run_concurrency, try_mgrit_graph
    if quick:
        configs, cw = [(64, 8, 8)], ()
    else:
        configs, cw = [(n, w, 32 if n == 1024 else 64) for n in (1024, 4096) for w in (8, 32, 128)], (8,)
    deadline = time.time() + args.bench_budget_s
    bench = {}
    section("bench", lambda: bench.update(zip(("rows", "skipped"), run_concurrency(
        dev, configs, 16 if quick else 64, cw, deadline, log))) or bench)
    section("staging", lambda: staging_section(dev, quick, bench.get("rows", []), mpi_ok))
    if dev.type == "cuda":
        section("mgrit_graph", lambda: try_mgrit_graph(1024, 8, 64, 32, dev))
    from experiments.benchmarks.gpu_report import write_markdown
    section("markdown", lambda: str(write_markdown(res, out / "gpu_session.md")))
    ok = all(c.get("pass") for c in res["sections"].get("jobs", {}).get("comparisons", {}).values()) and \
        all(c.get("pass") for c in res["sections"].get("checks", {}).values()) and "jobs" in res["sections"]
    res["correctness_pass"] = ok
    save()
    log(f"{'PASS' if ok else 'FAIL'}: correctness; wrote {path} in {time.time() - t_start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
