"""``table.md``, ``summary.md`` and plots of ``reproduce_layerwise.py``, rebuilt from
``results.h5`` alone (parts ``accuracy`` and ``timing``): every number comes from the file."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mgrit.reporting import writers as reporting
from experiments.reports import seeds as st
from experiments.reports.study_parts import read_part, write_headline

METHODS = {"e2e": "end-to-end", "seq": "sequential (B / (L+1) per stage)", "dgl": "DGL",
           "e2e_long": "end-to-end ((L+1) B epochs)", "seq_long": "sequential (B per stage)"}
#: the two budgets, in passes over the training data: methods compared with each other
BUDGETS = {"B": ("e2e", "seq", "dgl"), "(L+1) B": ("e2e_long", "seq_long")}
PUBLISHED = [["DGL (Belilovsky 2020), CIFAR-10 ResNet-32 error, K = 2/4/8/16 vs e2e",
              "8.69 / 11.48 / 14.17 / 16.21% vs 7.37%", "not run (CIFAR-10, GPU scale)"],
             ["Greedy layer-wise (Belilovsky 2019), CIFAR-10 acc, k = 1/2/3", "88.3 / 90.4 / 91.7%",
              "not run"],
             ["DGL ImageNet VGG-13 K = 4 vs backprop", "67.8 vs 66.6%", "not run"],
             ["Kim 2019 sequential training", "abstract only: sub-optimal vs full training, large "
              "compute/memory savings, better convergence", "our reading (grow-at-top), below"]]


def _settings(acc):
    return list(acc[1]["settings"])


def _methods(s, n):
    """The methods with stored results for setting ``n``, in :data:`METHODS` order."""
    return [m for m in METHODS if f"{n}/{m}/selected" in s]


def _fmt(v, kind):
    return "n/a" if np.isnan(v) else (f"{v:.4f}" if kind == "reg" else f"{100 * v:.1f}%")


def _pm(a, kind):
    """Mean over seeds [Student-t 95% interval]: accuracy in %, MSE with 4 decimals."""
    a = np.asarray(a, dtype=float)
    if np.all(np.isnan(a)):
        return "not run (needs `loss='mse'` in layerwise)"
    return st.fmt_values(a, 1, 4) if kind == "reg" else st.fmt_values(a, 100, 1, "%")


#: Equivalence margin of the accuracy verdicts (points), fixed in advance; MSE: sign only.
MARGIN = 1.0


def _diff(s, meta, n, m, ref):
    """(paired interval text, verdict) of method ``m`` - ``ref`` on the test metric at their
    selected rates (same seeds: same initial weights), or None when either is missing."""
    if f"{n}/{m}/selected" not in s or f"{n}/{ref}/selected" not in s:
        return None
    (la, a), (lb, b) = selected(s, n, ref, meta["lrs"]), selected(s, n, m, meta["lrs"])
    if la is None or lb is None or np.any(np.isnan(a)) or np.any(np.isnan(b)):
        return None
    d = reporting.paired_interval(a, b)
    if _kind(n) == "reg":
        return st.fmt(d, 1, 4, signed=True), "MSE " + st.verdict(d, None, "", 1.0)
    return st.fmt(d, 100, 1, signed=True) + " points", st.verdict(d, MARGIN)


def gap_tables(s, meta):
    """Markdown: each method's validation metric against end-to-end's at the same budget,
    pass by pass over the training data (paired by seed; sequential's passes are its stages'
    epochs, each on the frozen layers' cached features, then the head re-fit)."""
    out = ["## The gap pass by pass (validation metric, paired by seed)", "",
           "Validation metric (20 % of the training split; test data is evaluated only at the "
           "end) after k passes over the training data, at each method's selected rate, mean "
           "[95% interval] over the seeds and the paired difference to end-to-end at the same "
           "budget. Sequential after k passes is the network of its current stage with that "
           "stage's head.", ""]
    for n in _settings((s, meta)):
        scale, dg = (1, 4) if _kind(n) == "reg" else (100, 1)
        for ms in BUDGETS.values():
            ref = ms[0]
            for m in ms[1:]:
                ka, kb = f"{n}/{ref}/curves", f"{n}/{m}/curves"
                if ka not in s or kb not in s:
                    continue
                k = min(s[ka].shape[1], s[kb].shape[1])
                cols = [p - 1 for p in st.checkpoints(k)]
                head = ["passes"] + [h.format(a=METHODS[ref], b=METHODS[m])
                                     for h in st.GAP_HEADER[1:]]
                rows = st.gap_rows(s[ka][:, cols], s[kb][:, cols], scale, dg, [c + 1 for c in cols])
                out += [f"**{n}: {METHODS[m]} vs {METHODS[ref]}**", "",
                        reporting.markdown_table(head, rows), ""]
    return out


def SETTING_DEPTH(name):
    """L of a setting name ``<task>_<L>x<width>``."""
    return int(name.rsplit("_", 1)[1].split("x")[0])


def _kind(name):
    return "reg" if name.startswith("peaksreg") else "cls"


def selected(s, name, m, lrs):
    """(lr, test metrics over seeds) at the selected rate, or (None, NaNs)."""
    i = int(s[f"{name}/{m}/selected"][0])
    test = s[f"{name}/{m}/test"]
    return (lrs[i], test[i]) if i >= 0 else (None, np.full(test.shape[1], np.nan))


def _accuracy_tables(s, meta):
    lrs, out = meta["lrs"], []
    rows, sweep, mem = [], [], []
    for n in _settings((s, meta)):
        kind = _kind(n)
        B, e = (int(v) for v in s[f"{n}/epochs"])
        L = SETTING_DEPTH(n)
        for bname, ms in BUDGETS.items():
            row = [n, f"{bname} = {B if bname == 'B' else (L + 1) * B} passes", int(meta["seeds"])]
            for m in ms:
                if f"{n}/{m}/selected" not in s:
                    row.append("not run")
                    continue
                lr, t = selected(s, n, m, lrs)
                row.append(_pm(t, kind) + ("" if lr is None else f" (lr {lr:g})"))
            row += [""] * (3 - len(ms))
            rows.append(row)
        for m in _methods(s, n):
            v = s[f"{n}/{m}/val"].mean(1)
            sweep.append([n, METHODS[m]] + [_fmt(x, kind) for x in v])
        names = [x.decode() if isinstance(x, bytes) else str(x) for x in s[f"{n}/memory_names"]]
        e2e_total = float(s[f"{n}/memory/0/total"][0])
        for i, mn in enumerate(names):
            g = lambda k: float(s[f"{n}/memory/{i}/{k}"][0])  # noqa: E731
            tps = s[f"{n}/memory/{i}/trainable_per_stage"].astype(int)
            mem.append([n, mn, ", ".join(str(v) for v in tps), f"{g('state') / 1024:.1f}",
                        f"{g('activations') / 1024:.1f}", f"{g('cache') / 1024:.1f}",
                        f"{g('total') / 1024:.1f}", g("total") / e2e_total])
    diffs = []
    for n in _settings((s, meta)):
        for bname, ms in BUDGETS.items():
            for m in ms[1:]:
                r = _diff(s, meta, n, m, ms[0])
                if r is not None:
                    diffs.append([n, bname, f"{METHODS[m]} - {METHODS[ms[0]]}", *r])
    out += ["## Test metric at each method's selected learning rate (mean [95% interval] over "
            "seeds)", "",
            "Accuracy (classification) or MSE on standardized targets (peaksreg). The rate is "
            "chosen per setting and method by the mean validation metric (20 % of the training "
            f"split); layer initialization `{meta.get('init', 'default')}` (the same for every "
            "method). Each row compares methods at an equal budget of passes over the training "
            "data: B (end-to-end and DGL B epochs; sequential B / (L + 1) epochs for each of the L "
            "layers and the head re-fit) and (L + 1) B (end-to-end (L + 1) B epochs; sequential B "
            "epochs per stage).", "",
            reporting.markdown_table(["setting", "budget", "seeds", "end-to-end", "sequential",
                                      "DGL"], rows), "",
            "Differences to end-to-end at the same budget, paired by seed (the same initial "
            f"weights), test metric; verdicts from the paired 95% interval (accuracy margin "
            f"±{MARGIN:g} point, fixed in advance; MSE: the sign only):", "",
            reporting.markdown_table(["setting", "budget", "difference", "mean [95% CI]",
                                      "verdict"], diffs),
            "", *gap_tables(s, meta), "## Learning-rate sweep: mean validation metric", "",
            reporting.markdown_table(["setting", "method"] + [f"lr {v:g}" for v in lrs], sweep), "",
            "## Training memory per method (accounted, KiB; batch of "
            f"{meta['batch_size']}, float32; see experiments/reproductions/layerwise_memory.py)", "",
            "state = trainable parameters x 3 (value, gradient, momentum) + frozen parameters; "
            "activations = tensors autograd saves for backward (measured with saved-tensor hooks); "
            "cache = sequential's cached features of the training set; ratio = total / "
            "end-to-end total. The dataset itself is not counted.", "",
            reporting.markdown_table(["setting", "method", "trainable parameters per stage",
                                      "state", "activations", "cache", "total", "ratio"], mem)]
    return out


def _timing_table(t, tmeta, acc):
    rows = []
    for n in tmeta["settings"]:
        base = np.nanmedian(t.get(f"{n}/e2e/seconds", [np.nan]))
        for m in list(METHODS) + ["dgl_pipe"]:
            k = f"{n}/{m}/seconds"
            if k not in t:
                continue
            v = float(np.nanmedian(t[k]))
            label = METHODS.get(m, f"DGL pipelined over {tmeta['ranks']} ranks")
            rows.append([n, label, f"{v:.2f}", v / base])
    return ["## Training time at the epoch budget (timing part; median of "
            f"{tmeta['reps']} interleaved repeats, seed 0, selected rates)", "",
            f"Machine load average {tmeta['loadavg']}.", "",
            reporting.markdown_table(["setting", "method", "seconds", "vs end-to-end"], rows)]


def _summary(acc, tim):
    L = ["# Study 4: layer-wise training -- our reading of Kim 2019, DGL, end-to-end", "",
         "Generated by `experiments/reproductions/reproduce_layerwise.py` from `results.h5` (every number below "
         "is read from it); `table.md` has the full tables, the learning-rate sweep and each "
         "part's command, commit, machine and load.", "",
         "**What is compared.** 'Sequential' is *our reading of Kim 2019* (arXiv 1905.07490): "
         "only the abstract is checkable (each layer decoupled and trained separately, then "
         "combined; sub-optimal vs full training; large compute and memory savings). We train "
         "grow-at-top: layer k with a fresh linear head on the cached outputs of the frozen "
         "layers below, then re-fit the output head. DGL (Belilovsky et al. 2020) trains all "
         "stages at once with auxiliary heads. Every method's SGD learning rate is tuned on a "
         "validation split before any comparison; methods are compared at equal budgets of passes "
         "over the training data (B, and (L + 1) B where sequential trains each stage B epochs).", ""]
    if acc is None:
        return "\n".join(L + ["Accuracy part not run yet."]) + "\n"
    s, meta = acc
    lrs = meta["lrs"]
    for n in _settings(acc):
        kind = _kind(n)
        B, e = (int(v) for v in s[f"{n}/epochs"])
        metric = "test MSE" if kind == "reg" else "test accuracy"
        for bname, ms in BUDGETS.items():
            parts = []
            for m in ms:
                if f"{n}/{m}/selected" in s:
                    lr, t = selected(s, n, m, lrs)
                    parts.append(f"{METHODS[m]} {_pm(t, kind)}" + ("" if lr is None else f" (lr {lr:g})"))
            passes = B if bname == "B" else (SETTING_DEPTH(n) + 1) * B
            diffs = [f"{METHODS[m]} {r[0]} ({r[1]})" for m in ms[1:]
                     for r in [_diff(s, meta, n, m, ms[0])] if r is not None]
            if parts:
                L += [f"- **{n}**, {passes} passes ({metric}, {meta['seeds']} seeds, mean [95% "
                      "interval]): " + "; ".join(parts) + "."
                      + (f" Paired differences to {METHODS[ms[0]]}: " + "; ".join(diffs) + "."
                         if diffs else "")]
    L += [""]
    for n in _settings(acc):
        names = [x.decode() if isinstance(x, bytes) else str(x) for x in s[f"{n}/memory_names"]]
        tot = {nm: float(s[f"{n}/memory/{i}/total"][0]) for i, nm in enumerate(names)}
        tps = {nm: int(max(s[f"{n}/memory/{i}/trainable_per_stage"])) for i, nm in enumerate(names)}
        e2e = tot["end-to-end"]
        L += [f"- **Memory, {n}:** accounted training memory relative to end-to-end: "
              + ", ".join(f"{nm} {tot[nm] / e2e:.2f}x" for nm in names)
              + "; largest trainable stage: " + ", ".join(f"{nm} {tps[nm]}" for nm in names)
              + " parameters."]
    if not meta.get("lib_mse"):
        L += ["", "**Regression path pending.** Sequential and DGL training with an MSE loss "
              "need `loss=\"mse\"` in `layerwise.train_layerwise` / `SequentialTrainer` / "
              "`DecoupledModel`; until it lands those peaksreg cells read 'not run' and only "
              "end-to-end is reported."]
    if tim is None:
        L += ["", "**Timing part not run at this commit** (wall times need a quiet machine): "
              "`mpiexec -n 2 python -m mpi4py experiments/reproductions/reproduce_layerwise.py --full --part timing`."]
    else:
        t, tmeta = tim
        L += ["", f"**Time at the epoch budget** (load average {tmeta['loadavg']}; median of "
              f"{tmeta['reps']} repeats):"]
        for n in tmeta["settings"]:
            base = np.nanmedian(t.get(f"{n}/e2e/seconds", [np.nan]))
            L += [f"- {n}: " + ", ".join(
                f"{METHODS.get(m, 'DGL pipelined')} {np.nanmedian(t[f'{n}/{m}/seconds']) / base:.2f}x"
                for m in list(METHODS) + ["dgl_pipe"] if f"{n}/{m}/seconds" in t)
                + " of end-to-end's time."]
    return "\n".join(L) + "\n"


def _headline(acc):
    if acc is None:
        return []
    s, meta = acc
    rows = []
    for n in _settings(acc):
        kind = _kind(n)
        cells = []
        for m in _methods(s, n):
            lr, t = selected(s, n, m, meta["lrs"])
            if lr is not None:
                ref = "e2e_long" if m == "seq_long" else "e2e"
                r = None if m == ref else _diff(s, meta, n, m, ref)
                cells.append(f"{METHODS[m]} {_pm(t, kind)}"
                             + ("" if r is None else f" (vs {METHODS[ref]}: {r[0]}, {r[1]})"))
        names = [x.decode() if isinstance(x, bytes) else str(x) for x in s[f"{n}/memory_names"]]
        tot = {nm: float(s[f"{n}/memory/{i}/total"][0]) for i, nm in enumerate(names)}
        rows.append({"claim": f"Kim 2019 (our reading) / DGL vs end-to-end, {n}: sequential "
                              "sub-optimal but saves memory",
                     "ours": ("; ".join(cells) + f" (mean [95% interval], lr tuned on validation, "
                              f"{meta['seeds']} seeds; budgets in "
                              "summary); memory vs end-to-end: "
                              + ", ".join(f"{k} {v / tot['end-to-end']:.2f}x" for k, v in tot.items()
                                          if k != "end-to-end")),
                     "kind": "measured"})
    return rows


def _kept_lines(meta: dict) -> list:
    """Lines naming the cells a run kept from an earlier run (and what that one kept)."""
    out = []
    for m, indent in ((meta, "  - "), (meta.get("kept_before") or {}, "    - (that run) ")):
        kf = m.get("kept_from") or {}
        src = (f"from the earlier run `{kf.get('command')}` at commit `{kf.get('commit')}` "
               f"({kf.get('date')}; same rates, seeds, init and budget)")
        if m.get("kept_cells"):
            cells = "; ".join(f"{n}: {', '.join(ms)}" for n, ms in m["kept_cells"].items())
            out += [f"{indent}cells kept {src}: {cells}"]
        elif m.get("kept_methods"):
            out += [f"{indent}methods {', '.join(m['kept_methods'])} kept {src}"]
    return out


def write(d: Path) -> None:
    acc = read_part(d / "results.h5", "accuracy")
    tim = read_part(d / "results.h5", "timing")
    head, body = [], []
    for name, part in (("accuracy", acc), ("timing", tim)):
        if part is not None:
            head += reporting.part_lines(name, part[1])
            head += _kept_lines(part[1])
    if acc is not None:
        body += _accuracy_tables(*acc) + [""]
    else:
        body += ["## accuracy part: not run yet", ""]
    if tim is not None:
        body += _timing_table(*tim, acc) + [""]
    else:
        body += ["## timing part: not run yet", ""]
    body += ["## Published numbers (not reproduced here)", "",
             reporting.markdown_table(["paper / setting", "published", "ours"], PUBLISHED)]
    title = "# Layer-wise training: end-to-end vs sequential (our reading of Kim 2019) vs DGL"
    (d / "table.md").write_text(title + "\n\n" + "\n".join(head) + "\n\n" + "\n".join(body) + "\n")
    (d / "summary.md").write_text(_summary(acc, tim))
    write_headline(d, _headline(acc), [p[1] for p in (acc, tim) if p is not None])
    if acc is not None:
        s, meta = acc
        for n in _settings(acc):
            curves = {}
            for m in _methods(s, n):
                label, k = METHODS[m], f"{n}/{m}/curve_seed0"
                if k in s and not np.all(np.isnan(s[k])):
                    curves[label] = (list(range(1, len(s[k]) + 1)), s[k])
            if curves:
                reporting.plot_lines(d / f"{n}_validation.png", curves,
                                     "epoch (sequential: stage epochs, then head re-fit)",
                                     "validation MSE" if _kind(n) == "reg" else "validation accuracy",
                                     f"{n}, seed 0, selected learning rates")
