"""The report half of ``experiments/benchmarks/bench_layerparallel.py``: tables a-f and the model's
predictions (mgrit.perf) of every measured configuration from the per-repeat calibrations."""
from __future__ import annotations

import dataclasses
import statistics

from mgrit import perf
from mgrit.options import MGRITOptions
from mgrit.perf import calibration as cal, strategies as st
from mgrit.perf.validation import KIRBY, error_table, kirby_table
from mgrit.reporting import writers as reporting
from experiments.benchmarks import baselines_common as bc

BATCH = 64
med = statistics.median
ONE = MGRITOptions(max_levels=1)


def _opts(m, iters, relax):
    return MGRITOptions(max_levels=2, cfactor=m, tol=0, max_iter=iters, relax=relax)


def ratio(a, b):
    """Median of per-repeat ratios a_r / b_r."""
    return med([x / y for x, y in zip(a, b)])


LABELS = {"lean": "lean loop", "compiled": "torch.compile", "lean_r0": "lean loop, 1 rank",
          "dp_lean": "data parallel, lean", "dp_seq": "data parallel, nn.Sequential",
          "chain_seq": "chain, nn.Sequential", "chain_lean": "chain, lean"}


def strongest(times: dict, keys):
    """Per repeat the fastest of ``keys``; returns (per-repeat minimum, label of the most
    frequent winner)."""
    keys = [k for k in keys if k in times]
    per = [min(times[k][i] for k in keys) for i in range(len(times[keys[0]]))]
    wins = [min(keys, key=lambda k: times[k][i]) for i in range(len(per))]
    w = max(set(wins), key=wins.count)
    return per, LABELS.get(w, w.replace("gpipe", "GPipe, lean,"))


def _costs(c, N):
    return (cal.costs_from_json(c["mgrit"]), cal.costs_from_json(c["exact"]),
            dataclasses.replace(st.netcosts_from_json(c["module"]), n_layers=N),
            dataclasses.replace(st.netcosts_from_json(c["lean"]), n_layers=N))


def _p2(c0, c1, N):
    a, b = _costs(c0, N), _costs(c1, N)
    return (cal.median_costs([a[0], b[0]], max), cal.median_costs([a[1], b[1]], max),
            st.reduce_netcosts([a[2], b[2]], max), st.reduce_netcosts([a[3], b[3]], max))


def _kirby_costs(r1, r2):
    """Median over repeats of the TrainCosts of the 2-level forward with Kirby's one-level
    adjoint: (1 process, 2 ranks: the slower rank per repeat)."""
    k = cal.costs_from_json
    one = cal.median_costs([k(c["kirby"]) for c in r1["cal"]])
    two = cal.median_costs([cal.median_costs([k(c0["kirby"]), k(c1["kirby"])], max)
                            for c0, c1 in zip(*r2["cal"])])
    return one, two


def predictions(r1, r2, N, relax):
    """Measured vs predicted, per repeat, for every configuration (error_table cases)."""
    m, b = r1["best_m"], BATCH
    fo, bo = _opts(m, 2, relax), _opts(m, 1, relax)
    cases = []

    def add(label, P, meas, preds):
        cases.append(dict(N=N, label=label, P=P, measured=meas, predicted=preds))
    p1 = [_costs(c, N) for c in r1["cal"]]
    free = perf.CommCost(0.0, 1e30)
    f, t = r1["fwd"], r1["train"]
    add("nn.Sequential forward", 1, f["seq"], [N * mod.layer_fwd(b) for _, _, mod, _ in p1])
    add("lean forward", 1, f["lean"], [N * ln.layer_fwd(b) for *_, ln in p1])
    for mm in r1["ms"]:
        add(f"MGRIT forward m={mm}", 1, f[f"mgrit m={mm}"],
            [perf.resnet_times(N, 1, tc, _opts(mm, 2, relax), bo, 2, 1, free, grad=False)[0]
             for tc, *_ in p1])
    add("nn.Sequential train", 1, t["seq"], [st.serial_step(mod, b) for _, _, mod, _ in p1])
    add("lean train", 1, t["lean"], [st.serial_step(ln, b) for *_, ln in p1])
    add(f"MGRIT train m={m}", 1, t["mgrit"],
        [perf.training_times(N, 1, tc, fo, bo, 2, 1, free)["mgrit"]["train"] for tc, *_ in p1])
    add("1-level exact train", 1, t["exact1"],
        [perf.training_times(N, 1, e, ONE, ONE, 1, 1, free)["mgrit"]["train"] for _, e, *_ in p1])
    p2 = [_p2(c0, c1, N) for c0, c1 in zip(*r2["cal"])]
    cc = perf.CommCost(*r2["comm"])
    T = r2["times"]
    add(f"MGRIT train m={m}", 2, T["mgrit"],
        [perf.training_times(N, 2, tc, fo, bo, 2, 1, cc)["mgrit"]["train"] for tc, *_ in p2])
    add(f"MGRIT forward m={m}", 2, T["mgrit_fwd"],
        [perf.resnet_times(N, 2, tc, fo, bo, 2, 1, cc, grad=False)[0] for tc, *_ in p2])
    add("1-level exact train", 2, T["exact1"],
        [perf.training_times(N, 2, e, ONE, ONE, 1, 1, cc)["mgrit"]["train"] for _, e, *_ in p2])
    add("lean train, rank 0 alone", 2, T["lean_r0"], [st.serial_step(ln, b) for *_, ln in p2])
    add("lean forward, rank 0 alone", 2, T["lean_fwd_r0"], [N * ln.layer_fwd(b) for *_, ln in p2])
    add("data parallel, lean", 2, T["dp_lean"], [st.data_parallel_step(ln, b, 2, cc) for *_, ln in p2])
    add("data parallel, nn.Sequential", 2, T["dp_seq"],
        [st.data_parallel_step(mod, b, 2, cc) for _, _, mod, _ in p2])
    add("chain forward, nn.Sequential", 2, T["chain_fwd"],
        [N * mod.layer_fwd(b) + cc.message(b * mod.state_bytes) for _, _, mod, _ in p2])
    add("chain train, nn.Sequential", 2, T["chain_seq"],
        [st.gpipe_step(mod, b, 2, 1, cc) for _, _, mod, _ in p2])
    add("chain train, lean", 2, T["chain_lean"], [st.gpipe_step(ln, b, 2, 1, cc) for *_, ln in p2])
    for M in r2["ms"]:
        add(f"GPipe M={M}, lean", 2, T[f"gpipe M={M}"], [st.gpipe_step(ln, b, 2, M, cc) for *_, ln in p2])
    return cases, p1, p2


def raw_samples(r1, r2, Ns) -> dict:
    """Every timed series of the run, per repeat (seconds): ``N=<N> 1-process forward|train
    <option>`` and ``N=<N> 2 ranks <option>`` (for ``report.write_raw``)."""
    out = {}
    for N in Ns:
        out.update({f"N={N} 1-process forward {k}": v for k, v in r1[N]["fwd"].items()})
        out.update({f"N={N} 1-process train {k}": v for k, v in r1[N]["train"].items()})
        out.update({f"N={N} 2 ranks {k}": v for k, v in r2[N]["times"].items()})
    return out


def report(r1, r2, Ns, meta) -> str:
    L = ["# Layer-parallel benchmarks (`experiments/benchmarks/bench_layerparallel.py`)", "",
         *reporting.meta_lines(meta["prov"]),
         f"- set-up: {meta['machine']}; 1 thread per process; run time {meta['minutes']:.1f} min",
         f"- network: DenseStep width 8, tanh, batch {BATCH}, float32, T = 1, loss mean(out^2), "
         f"SGD lr 1e-3; MGRIT 2 levels, relax {meta['relax']}, forward 2 / backward 1 cycles "
         f"(tol 0, warm start in training); 1-level exact path = forward and adjoint solves with "
         f"max_levels = 1; {meta['reps']} interleaved repeats (A B C A B C ...): median [IQR] "
         f"and min-max, raw per-repeat times in `bench_layerparallel.raw.json`; \"vs strongest "
         f"baseline\" = median of the strongest baseline / median of the option (> 1: faster); "
         f"T1/T3 = medians of per-repeat ratios; each timed run in steady state (an untimed run of the same "
         f"configuration just before it, as the previous step of a training loop)",
         f"- clock: 1-process parts {'CPU time of the process' if meta['clock'] == 'cpu' else 'wall clock'}; "
         f"2-rank part wall clock, max over ranks, barrier before and after each run", ""]
    rowsv = {"a": [], "b": [], "c": [], "cf": []}
    L += ["## a. Forward, 1 process (no autograd)", "",
          "Baselines: nn.Sequential, the lean loop and its torch.compile (data parallelism needs "
          "2 ranks: part c). Bound: the lean loop's kernels against batched MGRIT's kernels with "
          "zero solver overhead (`netcal.kernel_cost` + the replay's operation counts) -- what no "
          "solver tuning can beat on one core. Error: relative error of the output (2 cycles, "
          "cold start) against nn.Sequential, float32.", ""]
    for N in Ns:
        r, f = r1[N], r1[N]["fwd"]
        kern = perf.StepCost(*r["kernel"])
        lab = {"seq": "nn.Sequential", "lean": "lean loop", "compiled": "torch.compile (lean)"}
        errs = {f"mgrit m={m}": f"{r['err'][m]:.1e} (output)" for m in r["ms"]}
        rows, best, sp = bc.timing_table(f, ["seq", "lean", "compiled"], lab, errs,
                                         err_head="error", default_err="exact")
        L += [f"N = {N}:", "", *rows, ""]
        L.append("Bound of MGRIT vs the lean loop: " + ", ".join(
            f"m = {m}: {N * kern.single / perf.simulate(N, 1, _opts(m, 2, meta['relax']), tau=kern).critical_path:.2f}x"
            for m in r["ms"]) + ".")
        L.append("")
        rowsv["a"] += [(f"N = {N}, m = {m}", sp[f"mgrit m={m}"]) for m in r["ms"]]
    L += [bc.verdict("MGRIT's forward, 1 process", rowsv["a"]), "",
          "torch.compile: " + "; ".join(f"N = {N}: {r1[N]['compile']}" for N in Ns), ""]
    L += ["## b. Training step, 1 process (forward + backward + SGD)", "",
          "Baselines: nn.Sequential, the lean loop, torch.compile of the lean loop. Gradient "
          "error of MGRIT (inexact: fixed cycles): relative error of the steps' parameter "
          "gradient against serial autograd on the same batch and weights, float32 gradients, "
          "float64 norms; cold = from zero states (the first training step), warm = from the "
          "previous step's states (as in the timed steps).", ""]
    for N in Ns:
        r, t = r1[N], r1[N]["train"]
        lab = {"seq": "nn.Sequential", "lean": "lean loop", "compiled": "torch.compile (lean)",
               "mgrit": f"MGRIT m={r['best_m']}", "exact1": "1-level exact"}
        g = r.get("gerr", {})
        errs = {"mgrit": f"cold {g.get('cold', float('nan')):.1e} / warm {g.get('warm', float('nan')):.1e}"}
        rows, best, sp = bc.timing_table(t, ["seq", "lean", "compiled"], lab, errs)
        L += [f"N = {N}:", "", *rows, "",
              f"T1 (1-level exact / nn.Sequential, median of per-repeat ratios, <= 1.1): "
              f"{ratio(t['exact1'], t['seq']):.2f}", ""]
        rowsv["b"].append((f"N = {N}", sp["mgrit"]))
    L += [bc.verdict("MGRIT's training step, 1 process", rowsv["b"]), ""]
    base = ["lean_r0", "compiled_r0", "dp_lean", "dp_seq", "dp_compiled", "torch pipeline"]
    L += ["", "## c. Two ranks: training step and forward", "",
          "Baselines on the same 2 ranks: the lean loop and its torch.compile on rank 0 alone "
          "(the other rank idle), data parallelism (lean replicas + one Allreduce; nn.Sequential "
          "+ GradientBuckets; the compiled lean step on each rank's shard + one Allreduce). "
          "torch.distributed.pipelining over gloo (the fastest of GPipe / 1F1B / ZBV x M "
          "on pilot steps: see the torch.compile line). Also timed: the blocking chain "
          "(nn.Sequential; lean), GPipe (home-made, lean stages, M micro-batches). Gradient "
          "error as in b.", ""]
    for N in Ns:
        T, r = r2[N]["times"], r2[N]
        lab = {**LABELS, "compiled_r0": "torch.compile (lean), 1 rank",
               "dp_compiled": "data parallel, torch.compile (lean)", "mgrit": f"MGRIT m={r['m']}",
               "exact1": "1-level exact", **{k: k.replace("gpipe", "GPipe, lean,") for k in T if k.startswith("gpipe")}}
        train = {k: v for k, v in T.items() if k not in ("mgrit_fwd", "chain_fwd", "lean_fwd_r0", "compiled_fwd_r0")}
        g = r.get("gerr", {})
        errs = {"mgrit": f"cold {g.get('cold', float('nan')):.1e} / warm {g.get('warm', float('nan')):.1e}"}
        rows, best, sp = bc.timing_table(train, base, lab, errs)
        L += [f"N = {N}, training step:", "", *rows, "",
              f"T3 (MGRIT on 2 ranks vs the lean loop on 1, median of per-repeat ratios): "
              f"{ratio(T['lean_r0'], T['mgrit']):.2f}x; T1 (1-level exact / chain nn.Seq): "
              f"{ratio(T['exact1'], T['chain_seq']):.2f}"]
        notes = r.get("compile") or {}
        L += ["torch.compile: " + ("; ".join(f"{k}: {v}" for k, v in notes.items()) if notes
                                   else "not run (--quick / --no-compile)"), ""]
        rowsv["c"].append((f"N = {N}", sp["mgrit"]))
        fw = {k: T[k] for k in ("mgrit_fwd", "chain_fwd", "lean_fwd_r0", "compiled_fwd_r0") if k in T}
        flab = {"mgrit_fwd": f"MGRIT forward m={r['m']}", "chain_fwd": "chain forward, nn.Sequential",
                "lean_fwd_r0": "lean forward, 1 rank", "compiled_fwd_r0": "torch.compile forward (lean), 1 rank"}
        ferr = {"mgrit_fwd": f"{r1[N]['err'].get(r['m'], r1[N]['err'].get(str(r['m']), float('nan'))):.1e} (output, 1 process)"}
        rows, best, sp = bc.timing_table(fw, ["lean_fwd_r0", "compiled_fwd_r0"], flab, ferr,
                                         err_head="error", default_err="exact")
        L += [f"N = {N}, forward (no autograd; data parallelism not timed for the forward):", "", *rows, ""]
        rowsv["cf"].append((f"N = {N}", sp["mgrit_fwd"]))
    L += [bc.verdict("MGRIT's training step on 2 ranks", rowsv["c"]),
          bc.verdict("MGRIT's forward on 2 ranks", rowsv["cf"]), ""]
    L += model_part(r1, r2, Ns, meta)
    L += ["## f. Memory per rank (saved-for-backward tensors + MGRIT states + stacked parameters)", "",
          "| N | nn.Sequential 1 rank [KiB] | MGRIT 1 rank [KiB] | chain, per rank [KiB] | MGRIT 2 ranks, per rank [KiB] |",
          "|---|---|---|---|---|"]
    for N in Ns:
        m1, m2 = r1[N]["mem"], r2[N]["mem"]
        L.append(f"| {N} | {m1[0] / 1024:.0f} | {m1[1] / 1024:.0f} | "
                 f"{' / '.join(f'{x[0] / 1024:.0f}' for x in m2)} | {' / '.join(f'{x[1] / 1024:.0f}' for x in m2)} |")
    L += ["", "Phase instrumentation of the last forward solve, 1 process (wall clock):", ""]
    for N in Ns:
        s = r1[N]["stats"]
        L.append(f"- N = {N}, m = {r1[N]['best_m']}: " + ", ".join(f"{k} {v:.4f}s" for k, v in s["time"].items())
                 + f"; steps {s['step_applications']} (single {s['steps_single']}, batched "
                   f"{s['steps_batched_items']} in {s['steps_batched_calls']} calls)")
    return "\n".join(L) + "\n"


def model_part(r1, r2, Ns, meta) -> list:
    L = ["", "## d. Cost model (mgrit.perf) against every configuration above (T5)", "",
         "Each repeat's prediction comes from that repeat's calibration (P = 1: the 1-process "
         "part; P = 2: both ranks at once, the slower rank's costs), never from the measured "
         "runs: MGRIT's steps, adjoint, parameter-gradient sweep and solver bookkeeping "
         "(`calibration.chain_costs`), plus what those pieces miss of the real MGRIT path "
         "(autograd bridge, checks, allocations: `calibration.path_residual`, the real path on "
         "one process at n/4 and n/2 of the rank's n layers, never at n; forward rows: the "
         "evaluation forward's own residual), nn.Sequential per-layer slopes (depth 64 -> 256) at batch "
         "32 and 64, the lean loop per layer at batch 1..64 (`netcal`); messages from the 2-rank "
         "ping-pong. **P > 2 is not validated: this machine has 2 cores.**", ""]
    cases, p1s, p2s = [], {}, {}
    for N in Ns:
        c, p1s[N], p2s[N] = predictions(r1[N], r2[N], N, meta["relax"])
        cases += c
    rows, worst = error_table(cases)
    L += rows
    L += ["", f"Max |error| (median of per-repeat errors): P = 1 {worst.get(1, 0) * 100:.0f}%, "
          f"P = 2 {worst.get(2, 0) * 100:.0f}% (target 25%: "
          f"**{'MET' if max(worst.values()) <= 0.25 else 'MISSED'}**). compiled: not modeled.", ""]
    L += ["Operation counts of the P = 2 MGRIT forward (SolverStats per rank == the replay's):", ""]
    for N in Ns:
        sim = perf.simulate(N, 2, _opts(r1[N]["best_m"], 2, meta["relax"]))
        got = [{k: s[k] for k in ("steps_single", "steps_batched_calls", "steps_batched_items", "messages")}
               for s in r2[N]["stats"]]
        want = [{k: v for k, v in sim.rank(q).items() if k != "allreduces"} for q in range(2)]
        L.append(f"- N = {N}: {'equal' if got == want else 'DIFFER'} ({got})")
    cc = perf.CommCost(*r2[max(Ns)]["comm"])
    nb = BATCH * 8 * 4
    L += ["", f"Message chain: ping-pong fit latency {cc.latency * 1e6:.1f} us, bandwidth "
          f"{cc.bandwidth / 1e9:.2f} GB/s -> one {nb}-byte state message predicted "
          f"{cc.message(nb) * 1e6:.1f} us; a measured chain of 200 such messages, each waiting for "
          f"the previous: {r2[max(Ns)]['chain_msg'] * 1e6:.1f} us per message "
          f"({(cc.message(nb) - r2[max(Ns)]['chain_msg']) / r2[max(Ns)]['chain_msg'] * 100:+.0f}%).", ""]
    N = max(Ns)
    d = tuple(cal.median_costs([p[i] for p in p1s[N]]) for i in (0, 1)) + \
        tuple(st.reduce_netcosts([p[i] for p in p1s[N]], med) for i in (2, 3))
    s2 = tuple(cal.median_costs([p[i] for p in p2s[N]]) for i in (0, 1)) + \
        tuple(st.reduce_netcosts([p[i] for p in p2s[N]], med) for i in (2, 3))
    k1, k2 = _kirby_costs(r1[N], r2[N])
    L += ["## e. Kirby's setting from the calibrated model (T4; a model, not a measurement)", "",
          f"N = {KIRBY['N']}, P = {KIRBY['P']}, m = {KIRBY['m']}, 2 levels, **FCF**, "
          f"{KIRBY['K_f']} forward cycles; training: + adjoint MGRIT ({KIRBY['K_b']} FCF cycle), or "
          f"Kirby's serial adjoint (last column). Costs calibrated here at N = {N} (medians over "
          f"repeats): `dedicated` = 1-process costs (a rank with a core to itself, as Kirby's GPU "
          f"per rank), `shared` = the 2-rank costs (the slower rank, two ranks on this VM's "
          f"memory system). Messages: latency as listed, 10 GB/s. Chain and GPipe: per-layer "
          f"costs at the (micro-)batch size, GPipe's M the best of 1..64.", ""]
    L += kirby_table({"dedicated": (d[2], d[3], d[0], k1), "shared": (s2[2], s2[3], s2[0], k2)})
    L += ["", "Kirby et al. report 10.2x (forward, same number of GPUs, CUDA streams); the table "
          "is what this machine's costs predict, not tuned toward it.", ""]
    return L
