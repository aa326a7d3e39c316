"""Unit costs of an MGRIT training step, timed apart from the run (min of k calls), and the
report of :mod:`experiments.benchmarks.profile_step` (its measurement half stays there).

Unit costs per rank: the batched forward and adjoint kernels at every interval count ``n``
the step's trace holds (``ForwardChain`` / ``AdjointChain.step_batch_into`` on the strided
layers an F-relaxation sweep uses; at least two counts, for the fit ``call + item * n``),
single forward and adjoint steps, the adjoint's linearization of the local layers
(``act'(z)``, once per adjoint solve), the batched parameter-gradient kernel
(``stacked_gradients``), the optimizer at its minimum (one ``sub_`` per stacked tensor) and the
message cost (ping-pong of one state, P > 1; wall time). Kernels and per-tensor costs are
process CPU time, min of k calls.
"""
from __future__ import annotations

import statistics
import time

import torch

from mgrit.nn.chains.propagators import AdjointChain
from mgrit.perf.model import CommCost, StepCost, fit_step_cost, pingpong

__all__ = ["measure", "combine", "markdown"]


def _best(fn, reps: int) -> float:
    """Min over ``reps`` calls of ``fn``'s process CPU time (the measured side is CPU time too:
    on a loaded machine a wall clock counts the time the process was not scheduled)."""
    fn()
    best = float("inf")
    for _ in range(max(reps, 1)):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def _batched_costs(step_into, events, label, m, batch, width, reps) -> dict:
    """``{n: seconds}`` of one batched call over ``n`` intervals, at the ``(level, start)`` of
    the trace's first call of that size (plus ``n // 2`` when the trace has one size)."""
    seen = {}
    for lab, e in events:
        if lab == label and e[6] and e[5] not in seen:
            seen[e[5]] = (e[3], e[4])
    if len(seen) == 1:
        (n, where), = seen.items()
        if n >= 2:
            seen[n // 2] = where
    out = {}
    for n, (level, start) in seen.items():
        s = m ** level
        starts = range(start, start + n * m * s, m * s)
        stops = range(start + s, start + s + n * m * s, m * s)
        u = torch.randn(n, batch, width)
        buf = torch.empty_like(u)
        out[n] = _best(lambda: step_into(u, starts, stops, level, buf), reps)
    return out


def _single_cost(step, events, label, m, batch, width, reps) -> float | None:
    ev = next((e for lab, e in events if lab == label and not e[6]), None)
    if ev is None:
        return None
    level, start = ev[3], ev[4]
    u = torch.randn(batch, width)
    return _best(lambda: step(u, start, start + m ** level, level), reps)


def measure(lp, x, m, comm, reps, events, optimizer="sgd") -> dict:
    """This rank's unit costs (seconds; collective over ``comm`` for the ping-pong).
    ``events``: ``[(label, step event)]`` of one traced step; ``optimizer``: the step's SGD
    kind (with stacked leaves its step over the stacked tensors is the optimizer's unit)."""
    batch, width, n_local = x.shape[0], x.shape[1], len(lp.steps)
    chain = lp._chain
    tensors = chain.refresh()
    states = lp.last_forward.states
    adj = AdjointChain(chain, lp.n_layers, states, tensors, closed_single=True)
    u = {"forward": _batched_costs(chain.step_batch_into, events, "forward", m, batch, width, reps),
         "adjoint": _batched_costs(adj.step_batch_into, events, "adjoint", m, batch, width, reps),
         "forward_single": _single_cost(chain.step, events, "forward", m, batch, width, reps),
         "adjoint_single": _single_cost(adj.step, events, "adjoint", m, batch, width, reps)}
    stack = chain._stack
    if stack is not None and stack.closed_form_vjp:
        u["linearize"] = _best(lambda: stack.template.linearize_batched(tensors, states[:n_local]),
                               reps)
    else:
        u["linearize"] = 0.0  # inside the kernels of the general path
    lam = torch.randn(n_local, batch, width)
    u["pgrad"] = _best(lambda: adj.stacked_gradients(lam), reps)
    params = [tensors[k].clone() for k in (stack.names if stack is not None else [])]
    grads = [torch.randn_like(p) for p in params]

    def opt_min():
        for p, g in zip(params, grads):
            p.sub_(g, alpha=1e-3)
    u["optimizer_min"] = _best(opt_min, reps) if params else 0.0
    u.update(_per_tensor_costs(lp, reps))
    if stack is not None and stack.leaves is not None:  # one leaf per name: SGD on those
        kw = {"sgd": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.SGD(params, lr=1e-3, **kw[optimizer])
        u["optimizer_min"] = min(u["optimizer_min"], _best(opt.step, reps))
        u["stacked"] = True
    # the fastest of 3 ping-pongs (each a mean of round trips): a busy peer inflates one
    tries = [pingpong(comm, (8, batch * width * 4), repeats=max(reps, 10)) for _ in range(3)]
    cc = None if tries[0] is None else min(tries, key=lambda c: c.message(batch * width * 4))
    u["comm"] = None if cc is None else [cc.latency, cc.bandwidth]
    return u


def _per_tensor_costs(lp, reps) -> dict:
    """What a step pays per parameter tensor outside the bound, on copies of this rank's
    parameters (leaves): ``fanout`` -- ``torch.stack`` of every name's layer tensors with
    autograd and its backward (the node's stacked gradient handed to each layer's ``.grad``);
    ``sgd_<kind>`` -- one ``torch.optim.SGD.step`` over all of them, per tensor
    (``foreach=False``, PyTorch's CPU default), ``foreach=True`` and ``fused=True`` (``None``
    where this torch refuses it)."""
    stack = lp._chain._stack
    if stack is None:
        return {}
    rows = ({n: list(t.unbind(0)) for n, t in stack.leaves.snapshot(False).items()}
            if stack.leaves is not None else {n: stack._lists[n] for n in stack.names})
    leaves = {n: [t.detach().clone().requires_grad_(True) for t in rows[n]]
              for n in stack.names}

    def fan():
        for ls in leaves.values():
            for t in ls:
                t.grad = None
        outs = [torch.stack(ls) for ls in leaves.values()]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    out = {"fanout": _best(fan, reps)}
    flat = [t for ls in leaves.values() for t in ls]
    for kind in ("sgd", "foreach", "fused"):
        kw = {"sgd": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
        try:
            opt = torch.optim.SGD(flat, lr=0.0, **kw[kind])
            out[f"sgd_{kind}"] = _best(opt.step, reps)
        except (RuntimeError, ValueError):
            out[f"sgd_{kind}"] = None
    return out


def combine(per_rank: list) -> tuple:
    """``({label: StepCost}, CommCost or None, extra seconds)`` from every rank's unit costs:
    the mean over ranks of each kernel (per interval count), the slowest rank's extra work
    (linearization + parameter-gradient kernel + optimizer minimum)."""
    mean = statistics.fmean
    costs = {}
    for label in ("forward", "adjoint"):
        single = [u[f"{label}_single"] for u in per_rank if u[f"{label}_single"] is not None]
        sizes = {}
        for u in per_rank:
            for n, t in u[label].items():
                sizes.setdefault(int(n), []).append(t)
        ns = sorted(sizes)
        times = [mean(sizes[n]) for n in ns]
        s = mean(single) if single else (times[0] / ns[0] if ns else 0.0)
        costs[label] = (fit_step_cost(s, ns, times) if len(ns) >= 2 else
                        StepCost(s, 0.0, times[0] / ns[0]) if ns else StepCost(s, 0.0, s))
    cc = next((CommCost(*u["comm"]) for u in per_rank if u["comm"] is not None), None)
    extra = max(u["linearize"] + u["pgrad"] + u["optimizer_min"] for u in per_rank)
    return costs, cc, extra


def _ms(v) -> str:
    return "–" if v is None else f"{1e3 * v:.2f}"


def _per_tensor(b: dict, kind: str) -> str:
    u = max(b["units"], key=lambda v: (v.get("fanout") or 0) + (v.get(f"sgd_{kind}") or 0))
    if u.get("fanout") is None:
        return "–"
    alts = ", ".join(f"{k[4:]} {_ms(u.get(k))}" for k in ("sgd_sgd", "sgd_foreach", "sgd_fused"))
    return f"{_ms(u['fanout'])} + {_ms(u.get(f'sgd_{kind}'))} (SGD {alts})"


def _speedups(res: dict, cpu: float) -> str:
    base = res["ranks"][0]["baselines"]
    return " / ".join("–" if base.get(k, {}).get("cpu") is None else
                      f"{base[k]['cpu'] / cpu:.2f}" for k in ("lean", "compiled lean"))


def _with_per_tensor(b: dict, kind: str, cpu: float) -> str:
    worst = max((u.get("fanout") or 0.0) + (u.get(f"sgd_{kind}") or 0.0)
                - u.get("optimizer_min", 0.0) for u in b["units"])
    return f"{cpu / (b['bound_s'] + worst):.2f}" if worst > 0 else "–"


def markdown(res: dict) -> tuple:
    """``(title, body)``: the profile table, the bound table and the conditions (rank 0's
    report; the caller adds the provenance block)."""
    P = res["P"]
    gate = "reliable" if res["reliable"] else "**UNRELIABLE (loaded machine)**"
    lines = [f"N = {res['N']}, width {res['width']}, batch {res['batch']}, float32, 2 levels, "
             f"F-relaxation, 2 forward / 1 adjoint cycles, SGD ({res['optimizer']}), "
             f"{res['reps']} interleaved repeats (medians), torch {res['torch']}, "
             f"{res['threads']} thread(s) per rank.", "",
             f"1-minute load average before / after the repeats / after the unit costs: "
             + " / ".join(f"{v:.2f}" for v in res["load1"])
             + f" against {P} own process(es): {gate} (gate: load <= P + 0.5).", ""]
    ms = res["ms"]
    for row in res["ranks"]:
        r = row["rank"]
        lines += [f"## Rank {r}: milliseconds per step (wall / CPU)", "",
                  "| phase | " + " | ".join(f"m = {m}" for m in ms) + " |",
                  "|---|" + "---|" * len(ms)]
        for p in row["mgrit"][ms[0]]:
            cells = []
            for m in ms:
                d = row["mgrit"][m][p]
                cells.append(f"{_ms(d['wall'])} / {_ms(d['cpu'])}")
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        for k, d in row["baselines"].items():
            lines.append(f"| {k} step (this rank) | " + " | ".join(
                [f"{_ms(d['wall'])} / {_ms(d['cpu'])}"] * len(ms)) + " |")
        lines.append("")
    lines += ["## Bound: recorded operations at measured unit costs", "",
              "| m | ops forward (single / batched calls / items) | ops adjoint | messages | "
              "bound ms (fwd + adj + extra) | measured CPU ms (slowest rank) | measured / bound "
              "| bound reached | per-tensor costs ms (fan-out + this SGD) | measured / (bound + "
              "per-tensor) | speed-up over lean / compiled lean (rank 0's CPU / this) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in ms:
        b = res["bounds"].get(m) or res["bounds"].get(str(m))
        if b is None:
            continue
        cpu = max(row["mgrit"][m]["step"]["cpu"] for row in res["ranks"])

        def ops(label):
            c = b["counts"].get(label)
            if not c:
                return "–"
            return " + ".join(f"{x['steps_single']}/{x['steps_batched_calls']}/"
                              f"{x['steps_batched_items']}" for x in c)
        msgs = sum(x["messages"] for c in b["counts"].values() for x in c)
        mode, kind = res.get("modes", {}).get(str(m), ("layers", res["optimizer"]))
        if mode == "stacked":  # one leaf per name: no fan-out, the optimizer is in the bound
            per_tensor = with_per_tensor = "– (stacked leaves)"
        else:
            per_tensor, with_per_tensor = _per_tensor(b, kind), _with_per_tensor(b, kind, cpu)
        pl = b["per_label_s"]
        lines.append(f"| {m} | {ops('forward')} | {ops('adjoint')} | {msgs} | "
                     f"{_ms(b['bound_s'])} ({_ms(pl.get('forward'))} + {_ms(pl.get('adjoint'))} "
                     f"+ {_ms(b['extra_s'])}) | {_ms(cpu)} | {cpu / b['bound_s']:.2f} | "
                     f"{b['bound_s'] / cpu:.2f} | {per_tensor} | {with_per_tensor} | "
                     f"{_speedups(res, cpu)} |")
    lines += ["", "Operation counts per rank (rank 0 + rank 1 ...). The bound leaves out the "
              "solver's host work, Python, the autograd fan-out of the stacked gradient to the "
              "layers' parameters and waits beyond a message's latency; `extra` is the "
              "adjoint's linearization + the batched parameter-gradient kernel + one optimizer "
              "op per stacked tensor. Per-tensor costs: what the step pays per parameter tensor "
              "outside the bound (autograd's fan-out of the stacked gradient to every layer's "
              "`.grad`; the optimizer over every layer's tensors, per tensor / foreach / fused), "
              "timed on copies of the parameters; the last column adds them to the bound (in "
              "place of the optimizer minimum): the bound of a model whose layers are separate "
              "modules. Unit costs (process CPU seconds, min of k calls; messages: wall) per "
              "rank are in the JSON beside this table."]
    return f"Profile of the MGRIT training step, P = {P}", "\n".join(lines) + "\n"
