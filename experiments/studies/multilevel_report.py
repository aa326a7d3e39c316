"""Report helpers of ``study_multilevel.py``: the time to a target accuracy, the intervals over
seeds of part (a) (multilevel initialization vs scratch) and of part (b) (MG/Opt vs its inner
optimizer), and ``summary.md`` -- every number computed from the study's series (issue 24,
item 2: paired 95% intervals and verdicts computed from them)."""
from __future__ import annotations

import math

import numpy as np

from mgrit.reporting import writers as reporting

def time_to(curve, target):
    return next((t for t, acc in zip(curve["time"], curve["test_acc"]) if acc >= target - 1e-12),
                math.inf)


#: Equivalence margin of the accuracy verdict of (a) (points), fixed in advance.
MARGIN = 1.0


def init_intervals(series, args):
    """(table lines, summary lines, headline rows) of (a) over the seeds of ``--init-seeds``:
    final test accuracy at depth N and its gap epoch by epoch over the epochs at depth N
    (paired 95% intervals: a seed gives both runs the same data and seeding), and the paired
    interval of the time to the target (multilevel - scratch); verdicts computed from the
    intervals."""
    from experiments.reports import seeds as st
    S = args.init_seeds
    get = lambda s, k, q: np.asarray(series[f"init/seed{s}/{k}/{q}"], dtype=float)  # noqa: E731
    a = np.array([get(s, "scratch", "test_acc")[-args.epochs:] for s in S])
    b = np.array([get(s, "multilevel", "test_acc")[get(s, "multilevel", "depth") == args.layers]
                  [-args.epochs:] for s in S])
    head = [h.format(a="scratch", b="multilevel") for h in st.GAP_HEADER]
    d = reporting.paired_interval(a[:, -1], b[:, -1])
    ts = [time_to({"time": get(s, "scratch", "time"), "test_acc": get(s, "scratch", "test_acc")},
                  get(s, "scratch", "test_acc")[-1]) for s in S]
    tm = [time_to({"time": get(s, "multilevel", "time"),
                   "test_acc": get(s, "multilevel", "test_acc")},
                  get(s, "scratch", "test_acc")[-1]) for s in S]
    never = sum(not math.isfinite(t) for t in tm)
    if never:
        tline = f"the multilevel run never reached the target in {never} of {len(S)} seeds"
    else:
        dt = reporting.paired_interval(ts, tm)
        if dt["n"] >= 2 and math.isfinite(dt["lo"]):
            said = ("faster" if dt["hi"] < 0 else "slower" if dt["lo"] > 0
                    else "no difference shown (the interval contains 0)")
        else:
            said = "one seed: no interval"
        tline = (f"time to the target, multilevel - scratch: {st.fmt(dt, 1, 2, signed=True)} "
                 f"{args.clock} s ({said}); scratch {st.fmt_values(ts, 1, 2)} s, multilevel "
                 f"{st.fmt_values(tm, 1, 2)} s")
    acc = (f"final test accuracy at depth {args.layers}: scratch "
           f"{st.fmt_values(a[:, -1], 100, 1, '%')}, multilevel "
           f"{st.fmt_values(b[:, -1], 100, 1, '%')}; difference {st.fmt(d, 100, 1, signed=True)}"
           f" points: {st.verdict(d, MARGIN)}")
    table = [f"### Over the {len(S)} seeds (paired 95% intervals)", "",
             f"Test accuracy over the {args.epochs} epochs at depth {args.layers} (multilevel: "
             "after its coarse depths), epoch by epoch:", "",
             reporting.markdown_table(head, st.gap_rows(a, b)), "",
             f"**Verdicts** (computed from the intervals; accuracy margin ±{MARGIN:g} point, "
             f"fixed in advance): {acc}; {tline}.", ""]
    summary = [f"- Over {len(S)} seeds (95% intervals): {acc}; {tline}."]
    rows = [{"claim": "multilevel initialization (nested iteration in depth) vs scratch: time "
                      "to the scratch run's final test accuracy and final accuracy",
             "ours": f"{tline}; {acc} ({len(S)} seeds, N = {args.layers})", "kind": "measured"}]
    return table, summary, rows


def _pays(mg, alone) -> str:
    """Whether MG/Opt's final losses ``mg`` are below the inner optimizer's ``alone`` (same
    seeds, paired): ``yes`` (the paired 95% interval of ``mg - alone`` lies below 0), ``no``
    (above 0), ``not shown`` (it contains 0), ``one seed`` (no interval)."""
    d = reporting.paired_interval(alone, mg)
    if d["n"] < 2 or not math.isfinite(d["lo"]):
        return "one seed"
    return "yes" if d["hi"] < 0 else "no" if d["lo"] > 0 else "not shown"


def _diff(mg, alone) -> str:
    """``mean [lo, hi]`` of the paired differences ``mg - alone`` (4 significant digits)."""
    d = reporting.paired_interval(alone, mg)
    return f"{d['mean']:.3g} [{d['lo']:.3g}, {d['hi']:.3g}]"


def write_summary(out, init_rows, mg_rows, meta, args, isum=()) -> None:
    """``summary.md`` from the table rows (the numbers in the text are the table's)."""
    lines = [f"# Summary: multilevel training in depth ({meta['date']}, commit {meta['commit']})",
             ""]
    if init_rows:
        faster = [r for r in init_rows if r[6] != "never" and float(r[6]) > 1.0]
        speed = ", ".join(f"seed {r[0]}: {r[6]}" for r in init_rows)
        lines += ["## (a) Multilevel initialization (main job, --multilevel-init)", "",
                  f"- Depths {init_rows[0][2]}, final depth N = {init_rows[0][1]}: the multilevel "
                  f"run reached the scratch run's final test accuracy in less {args.clock} time "
                  f"in {len(faster)} of {len(init_rows)} seed(s) (speedup in time to accuracy: "
                  f"{speed}).",
                  f"- Targets (scratch final test accuracy): "
                  f"{', '.join(r[3] for r in init_rows)}; reached by the multilevel run at "
                  f"depth {', '.join(str(r[7]) for r in init_rows)} (the depth of the "
                  f"network at that epoch: where a coarse network already reaches the target, "
                  f"the saving is that of training a shallower network); multilevel final "
                  f"accuracy at depth N: {', '.join(r[9] for r in init_rows)}.", *isum, ""]
    if mg_rows:
        lines += ["## (b) MG/Opt vs the inner optimizer alone", ""]
        for r in mg_rows:
            if r[2] == "inner alone":
                continue
            work, wall = r[10].split(" / ")
            says = {"yes": "pays", "no": "does not pay", "not shown": "neither shown",
                    "one seed": "one seed, nothing shown"}
            lines.append(f"- {r[0]}, {r[1]}, {r[2]}: loss {r[3]} after {r[4]} fine gradients "
                         f"(work {r[5]}) vs the inner optimizer alone {r[8]} at the same work "
                         f"and {r[9]} at the same wall time: {says[work]} at equal work, "
                         f"{says[wall]} at equal wall time (paired 95% intervals of the "
                         f"difference: {r[11]}).")
        lines.append("")
    lines.append("Wall times were measured on a shared, loaded machine; the CPU clock of (a) "
                 "and the work model of (b) do not depend on the load.")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
