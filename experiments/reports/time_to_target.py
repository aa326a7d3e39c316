"""Bookkeeping and report of the time-to-accuracy study
(``experiments/studies/time_to_accuracy.py``): the target fixed in advance from a pilot run,
the first time a recorded curve reaches it, the per-method summary over seeds, the verdict
sentence, and the files (``table.md``, ``summary.md``, ``headline.json``, ``results.json``,
``<network>_curves.png``). Functions of recorded numbers only (no MPI, no torch):
``tests/experiments/test_time_to_target.py`` checks the bookkeeping against hand-computed
values.

A *curve* is what a run records at every evaluation: the optimizer steps done, the training
clock (seconds of training wall time so far, evaluation excluded), and the validation loss and
accuracy after those steps; its first point is the untrained network (step 0, clock 0).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from experiments import measure
from experiments.reports.study_parts import write_headline
from mgrit.reporting import writers as reporting

__all__ = ["target_from_pilot", "first_crossing", "summarize_method", "summarize", "verdict",
           "write"]


def target_from_pilot(pilot_val_acc: Sequence[float], fraction: float) -> float:
    """The target validation accuracy: ``fraction`` times the pilot run's *last* recorded
    validation accuracy (its accuracy after its stated number of epochs).

    Raises:
        ValueError: an empty curve, or ``fraction`` outside (0, 1].
    """
    if len(pilot_val_acc) == 0:
        raise ValueError("target_from_pilot: the pilot curve has no evaluation")
    if not (isinstance(fraction, (int, float)) and 0.0 < fraction <= 1.0):
        raise ValueError(f"fraction={fraction!r} is not allowed: use a number in (0, 1]")
    return float(fraction) * float(pilot_val_acc[-1])


def first_crossing(clock: Sequence[float], val_acc: Sequence[float], target: float,
                   steps: Sequence[int] | None = None) -> dict | None:
    """The first evaluation of a curve at which the validation accuracy reached ``target``
    (``>=``): ``{"index", "time", "step"}`` (``time``: the training clock at that evaluation,
    seconds; ``step``: ``steps[index]``, or None without ``steps``). None when the curve never
    reaches it. The time is that of the evaluation, not an interpolation between evaluations:
    with evaluations every ``k`` steps it overstates the true crossing by less than ``k`` steps'
    time, alike for every method.

    Raises:
        ValueError: ``clock`` and ``val_acc`` (and ``steps``) of different lengths, or a
            clock that decreases.
    """
    if len(clock) != len(val_acc) or (steps is not None and len(steps) != len(clock)):
        raise ValueError(f"first_crossing: {len(clock)} clock values, {len(val_acc)} "
                         f"accuracies{'' if steps is None else f', {len(steps)} steps'}: "
                         "one of each per evaluation")
    if any(b < a for a, b in zip(clock, clock[1:])):
        raise ValueError("first_crossing: the training clock decreases along the curve")
    for i, acc in enumerate(val_acc):
        if acc >= target:
            return {"index": i, "time": float(clock[i]),
                    "step": None if steps is None else int(steps[i])}
    return None


def summarize_method(runs: Sequence[Mapping], target: float, interval) -> dict:
    """Summary of one method over its seeds. ``runs``: one mapping per seed with the curve
    (``clock``, ``val_acc``, ``steps``) and ``test_acc`` (the final test accuracy);
    ``interval``: :func:`mgrit.reporting.writers.interval` (mean and Student-t 95% interval).

    Returns ``{"seeds", "reached", "times", "steps_to_target", "time" (interval of the times of
    the seeds that reached the target, or None), "test" (interval of every seed's test
    accuracy)}``; ``times[i]`` is None for a seed that did not reach the target."""
    hits = [first_crossing(r["clock"], r["val_acc"], target, r["steps"]) for r in runs]
    times = [None if h is None else h["time"] for h in hits]
    reached = [t for t in times if t is not None]
    return {"seeds": len(runs), "reached": len(reached), "times": times,
            "steps_to_target": [None if h is None else h["step"] for h in hits],
            "time": interval(reached) if reached else None,
            "test": interval([r["test_acc"] for r in runs])}


# -- the report -----------------------------------------------------------------------------------
def _ci(iv, fmt="{:.2f}"):
    if iv is None:
        return "-"
    if iv["n"] < 2:
        return fmt.format(iv["mean"])
    return f"{fmt.format(iv['mean'])} ({fmt.format(iv['lo'])}-{fmt.format(iv['hi'])})"


def _steps_x_step(runs, sm, key):
    """Per seed: steps to target x the median per-step time of its blocks after the first
    (``key``: ``block_wall`` or ``block_cpu``; the first block carries compilation); None for a
    seed without the target or without block times (older results)."""
    out = []
    for r, st in zip(runs, sm["steps_to_target"]):
        b = r.get(key, [])
        b = b[1:] if len(b) > 1 else b
        out.append(None if st is None or not b else
                   measure.time_to_target(st, b)["seconds"])
    return out


def summarize(res):
    """Per method: :func:`summarize_method` plus the median seconds per step, time to target
    as steps x median time per step (wall and CPU, :func:`experiments.measure.time_to_target`)
    and the load gate (reliable only when every run's gate is)."""
    out = {}
    for k, runs in res["runs"].items():
        sm = summarize_method(runs, res["target"], reporting.interval)
        for key, name in (("block_wall", "sxt_wall"), ("block_cpu", "sxt_cpu")):
            sm[name] = _steps_x_step(runs, sm, key)
            ok = [t for t in sm[name] if t is not None]
            sm[name + "_iv"] = reporting.interval(ok) if ok else None
        sm["reliable"] = all(r.get("gate", {}).get("reliable", False) for r in runs)
        sm["s_per_step"] = float(np.median([(r["clock"][-1] - r["first_step_s"])
                                            / max(r["steps"][-1] - 1, 1) for r in runs]))
        sm["first_step_s"] = float(np.median([r["first_step_s"] for r in runs]))
        rest = [t - r["first_step_s"] for t, r in zip(sm["times"], runs) if t is not None]
        sm["time_after_first"] = reporting.interval(rest) if rest else None
        out[k] = sm
    return out


def verdict(name: str, sm: Mapping[str, dict], declared=None) -> tuple:
    """``(winner, sentence)``: the method that reaches the target first on average among those
    that reached it in every seed (None when none did), by how much, and where MGRIT stands
    against the winner and against the strongest serial baseline (the faster of ``serial`` and
    ``serial compiled``), with the paired interval over seeds -- all computed from ``sm``
    (:func:`summarize`). With ``declared`` (:class:`experiments.verdicts.Declaration`): the
    MGRIT sentence is its declared "time to target" verdict (steps x time per step, paired over
    seeds, no verdict when a run failed the load gate) instead of beats / loses."""
    full = [k for k in sm if sm[k]["reached"] == sm[k]["seeds"]]
    if not full:
        return None, f"On `{name}` no method reached the target in every seed."
    t = {k: sm[k]["time"]["mean"] for k in full}
    win = min(full, key=t.get)
    others = ", ".join(f"{k} {t[k]:.2f} s ({t[k] / t[win]:.2f}x)" for k in sorted(t, key=t.get)
                       if k != win)
    text = (f"On `{name}`, **{win}** reaches the target first: {t[win]:.2f} s on average over "
            f"{sm[win]['seeds']} seed(s); then {others or 'no other method in every seed'}.")
    if len(full) > 1:
        second = min((k for k in full if k != win), key=t.get)
        d = reporting.paired_interval(sm[win]["times"], sm[second]["times"])
        text += f" Paired difference {second} - {win}: {_ci(d)} s."
    missing = [f"{k} ({sm[k]['reached']}/{sm[k]['seeds']} seeds)" for k in sm if k not in full]
    if missing:
        text += f" Not at the target in every seed within the cap: {', '.join(missing)}."
    if "MGRIT" not in sm:
        return win, text
    if "MGRIT" not in full:
        return win, text + " MGRIT **loses**: it did not reach the target in every seed."
    if declared is not None:  # the verdict declared before the run, on steps x time per step
        rest = [k for k in full if k != "MGRIT"
                and all(v is not None for v in sm[k]["sxt_wall"])]
        if rest and all(v is not None for v in sm["MGRIT"]["sxt_wall"]):
            ref = min(rest, key=lambda k: float(np.mean(sm[k]["sxt_wall"])))
            iv = measure.paired_log_ratio(sm[ref]["sxt_wall"], sm["MGRIT"]["sxt_wall"])
            rel = sm[ref]["reliable"] and sm["MGRIT"]["reliable"]
            return win, text + " Declared: " + declared.judge(
                "time to target", dict(iv, b=ref), reliable=rel).replace(
                "the fastest other method", ref) + "."
        return win, text + " Declared verdict: not every seed has steps x time per step."
    serials = [k for k in ("serial", "serial compiled") if k in full]
    rest = [k for k in full if k != "MGRIT"]
    refs = ([min(rest, key=t.get)] if rest else []) + ([min(serials, key=t.get)] if serials else [])
    for ref in dict.fromkeys(refs):  # the best other method, the strongest serial
        d = reporting.paired_interval(sm[ref]["times"], sm["MGRIT"]["times"])
        how = "**loses** to" if t["MGRIT"] > t[ref] else "**beats**"
        text += (f" MGRIT {how} {ref}{' (the strongest serial)' if ref in serials else ''}: "
                 f"{t['MGRIT'] / t[ref]:.2f}x its time (paired difference MGRIT - {ref} "
                 f"{_ci(d)} s).")
    return win, text


def plot(path, name, res):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for j, k in enumerate(res["runs"]):
        for i, r in enumerate(res["runs"][k]):
            kw = dict(color=f"C{j}", lw=1.6 if i == 0 else 0.6, alpha=1.0 if i == 0 else 0.5,
                      label=k if i == 0 else None)
            axes[0].plot(r["clock"], r["val_acc"], **kw)
            axes[1].plot(r["clock"], r["val_loss"], **kw)
    axes[0].axhline(res["target"], color="k", ls="--", lw=0.8, label="target")
    for ax, yl in zip(axes, ("validation accuracy", "validation loss")):
        ax.set_xlabel("training wall clock [s] (evaluation excluded)")
        ax.set_ylabel(yl)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{name}: every seed (seed 0 bold), 2 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict, meta: dict, out_dir: Path, args: dict, rule: dict,
          declared=None) -> None:
    body, lines, head = [], [], []
    for name, res in results.items():
        s, sm = res["settings"], summarize(res)
        res["summary"] = sm
        rows = [[k, f"{v['reached']}/{v['seeds']}", _ci(v["time"]),
                 "-" if not v["reached"] else
                 f"{np.mean([x for x in v['steps_to_target'] if x is not None]):.0f}",
                 _ci(v["time_after_first"]), _ci(v.get("sxt_wall_iv")), _ci(v.get("sxt_cpu_iv")),
                 f"{1e3 * v['s_per_step']:.1f}",
                 f"{v['first_step_s']:.2f}",
                 _ci(v["test"], "{:.4f}")] for k, v in sm.items()]
        ms = ", ".join(f"{m}: {1e3 * t:.1f} ms" if not isinstance(t, str) else f"{m}: {t}"
                       for m, t in res["pipeline_candidates"].items())
        setting = (f"N = {s['layers']} dense tanh steps of width {s['width']}, batch {s['batch']}, "
                   f"{s['n_train']} training / {s['n_val']} validation / {s['n_test']} test "
                   f"images, SGD lr 0.01 momentum 0.9; evaluation every {s['every']} steps; cap "
                   f"{s['cap_epochs']} epochs ({s['cap_steps']} steps); pipeline {res['pipeline']} "
                   f"(torch.distributed.pipelining; the fastest step of {len(res['pipeline_candidates'])}"
                   f" candidates: {ms})")
        how = (f"target = {rule['fraction']} x the validation accuracy of a serial pilot run "
               f"(seed {rule['pilot_seed']}, {s['pilot_epochs']} epochs: "
               f"{res['pilot']['val_acc'][-1]:.4f}) = **{res['target']:.4f}**")
        win, v = verdict(name, sm, declared)
        unrel = [k for k, x in sm.items() if not x["reliable"]]
        if unrel:
            v += f" Load gate: {measure.UNRELIABLE} for {', '.join(unrel)}."
        if "serial compiled" not in sm:
            setting += "; serial compiled: not run (--smoke or --no-compile)"
        checks = [e for r in res["runs"].get("MGRIT", []) for e in r.get("bias_checks", [])]
        if checks:
            ratios = [e["bias"] / e["noise"] for e in checks
                      if e["noise"] and e["bias"] is not None and e["noise"] is not None]
            acted = [e for e in checks if e["action"] in ("raise", "serial")]
            setting += (f"; MGRIT's bias monitor: {len(checks)} checks over all seeds, "
                        f"bias/noise median {np.median(ratios) if ratios else float('nan'):.3g}, "
                        f"max {max(ratios, default=float('nan')):.3g}, {len(acted)} action(s)")
        body += [f"## {name}", "", setting + ".", "", how + ".", "",
                 reporting.markdown_table(
                     ["method", "seeds at target", "time to target [s] mean (95% CI)",
                      "steps to target (mean)", "without the first step [s]",
                      "steps x s per step, wall [s]", "steps x s per step, CPU [s]",
                      "ms per later step (median)", "first step [s] (median)",
                      "final test acc mean (95% CI)"], rows), "", v, "",
                 f"![accuracy and loss against time]({name}_curves.png)", ""]
        lines += [f"- {v}"]
        head.append({"claim": f"time to a fixed validation accuracy, 2 ranks ({name}: N = "
                              f"{s['layers']}, width {s['width']})",
                     "ours": "; ".join(f"{k} {_ci(x['time'])} s ({x['reached']}/{x['seeds']} "
                                       "seeds)" for k, x in sm.items()) + f"; first: {win}",
                     "kind": "measured" if not unrel else "unreliable timing"})
        plot(out_dir / f"{name}_curves.png", name, res)
    note = ("Time to target: training wall clock (max over the 2 ranks, evaluation excluded; "
            "compilation and the bias monitor's checks included) at the first evaluation with "
            "validation accuracy >= target; mean and Student-t 95% interval over the seeds that "
            "reached it. 'Without the first step': the same minus the first step's time (which "
            "carries torch.compile's compilation; every run starts with cleared in-process "
            "compile caches and a fresh inductor cache). 'Steps x s per step': steps to the target x "
            "the median time per step after the first block (wall, and per-process CPU time, "
            "max over the ranks). Every choice (target, stop, the pipeline's schedule and M) "
            "was made on the "
            "validation split or on step times; test accuracy: the weights at the stop, "
            "reported only. Timings are valid only when the header carries no load warning.")
    reporting.write_table(out_dir / "table.md", "Time to accuracy: serial, data parallel, pipeline, "
                          "MGRIT on 2 ranks", meta, note + "\n\n" + "\n".join(body))
    reporting.write_table(out_dir / "summary.md", "Time to accuracy: summary", meta,
                          "\n".join(lines) + "\n\nTables and curves: table.md.")
    write_headline(out_dir, head, [meta])
    doc = {"meta": meta, "args": args, "rule": rule, "networks": results}
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
