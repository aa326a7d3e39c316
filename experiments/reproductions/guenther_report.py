"""``table.md``, ``summary.md`` and plots of ``reproduce_guenther.py``, rebuilt from ``results.h5``
alone: every number comes from the file (mean +- std over the weight seeds; the accuracy
comparison with 95% intervals, paired by seed: :func:`accuracy_over_seeds`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mgrit.reporting import writers as reporting
from experiments.reports import seeds as st
from experiments.reports.study_parts import read_part, write_headline
from experiments.reproductions import guenther_timing

TITLE = "Günther et al. 2020 -- Peaks, serial vs simultaneous layer-parallel training"


def _final(s, seeds, method, key):
    return np.array([s[f"seed{i}/{method}/{key}"][-1] for i in range(seeds)], dtype=float)


def _pm(a, pct=False):
    a = np.asarray(a, dtype=float)
    if pct:
        return f"{100 * a.mean():.1f} ± {100 * a.std():.1f}%"
    return f"{a.mean():.4g} ± {a.std():.2g}"


#: Equivalence margin of the accuracy verdict (points), fixed in advance.
MARGIN = 1.0


def accuracy_over_seeds(s, meta, methods, S):
    """(table lines, summary lines, headline text) of simultaneous vs serial accuracy over the
    ``S`` weight seeds (paired: a seed gives both methods the same initial weights and data):
    each method's mean with its Student-t 95% interval, the paired difference's interval
    iteration by iteration (validation and training accuracy) and the verdict computed from
    the last iteration's interval (margin +-1 point). ``([], [], None)`` without both methods.
    The settings are the paper's, fixed in advance: nothing is chosen on the validation data."""
    if not ("serial" in methods and "simultaneous" in methods):
        return [], [], None
    out, said = [f"## Accuracy over the {S} weight seeds (95% intervals, paired by seed)", "",
                 "Settings fixed in advance from the paper (nothing chosen on these data). "
                 "Accuracy in %, mean [Student-t 95% interval]; difference simultaneous - "
                 f"serial in points [paired 95% interval]; verdict margin ±{MARGIN:g} point.",
                 ""], {}
    for key, name in (("val_acc", "validation"), ("train_acc", "training")):
        a, b = ([s[f"seed{i}/{m}/{key}"] for i in range(S)] for m in ("serial", "simultaneous"))
        k = min(min(len(x) for x in a), min(len(x) for x in b))
        a, b = np.array([x[:k] for x in a], dtype=float), np.array([x[:k] for x in b], dtype=float)
        it = np.asarray(s["seed0/serial/iter"][:k], dtype=int)
        cols = [c - 1 for c in st.checkpoints(k)]
        head = ["L-BFGS iteration"] + [h.format(a="serial", b="simultaneous")
                                       for h in st.GAP_HEADER[1:]]
        d = reporting.paired_interval(a[:, -1], b[:, -1])
        said[name] = (f"{name} accuracy serial {st.fmt_values(a[:, -1], 100, 1, '%')}, "
                      f"simultaneous {st.fmt_values(b[:, -1], 100, 1, '%')}; difference "
                      f"{st.fmt(d, 100, 1, signed=True)} points: {st.verdict(d, MARGIN)}")
        out += [f"{name.capitalize()} accuracy by L-BFGS iteration:", "",
                reporting.markdown_table(head, st.gap_rows(a[:, cols], b[:, cols],
                                                           epochs=[int(it[c]) for c in cols])),
                ""]
    out += [f"**Verdicts** (last iteration, computed from the intervals): {said['validation']}; "
            f"{said['training']}.", ""]
    summary = ["", f"**Accuracy over {S} seeds (95% intervals, paired by seed; table.md has the "
               f"gap by iteration).** {said['validation']}; {said['training']}."]
    return out, summary, f"{said['validation']} ({S} seeds, {int(meta['setting_iters'])} L-BFGS its)"


def _curve(s, seeds, method, key):
    return np.mean([s[f"seed{i}/{method}/{key}"] for i in range(seeds)], axis=0)


def write(d: Path) -> None:
    s, meta = read_part(d / "results.h5", "run")
    methods, S = meta["methods"], int(meta["setting_seeds"])
    iters, P = int(meta["setting_iters"]), int(meta["world_size"])
    N = int(meta["setting_layers"])
    tim = read_part(d / "results.h5", "timing")
    rows = []
    for m in methods:
        ev = _final(s, S, m, "evals")
        rows.append([m, iters, _pm(ev), _pm(_final(s, S, m, "objective")),
                     _pm(_final(s, S, m, "train_loss")), _pm(_final(s, S, m, "train_acc"), True),
                     _pm(_final(s, S, m, "val_acc"), True), _pm(_final(s, S, m, "wall"))])
    seeds_rows = [[i] + [f"{100 * s[f'seed{i}/{m}/val_acc'][-1]:.1f}%" for m in methods]
                  for i in range(S)]
    body = [f"## Final numbers, mean ± std over {S} weight seeds (same Peaks data)", "",
            "Accuracy, objective and evaluations are valid on a loaded machine; wall seconds "
            f"(measured, P = {P}, load average {meta['loadavg']}) need a quiet one.", "",
            reporting.markdown_table(["method", "L-BFGS iters", "evaluations",
                                      "final objective (optimizer's)", "train loss (exact)",
                                      "train acc", "val acc", f"wall s (P={P})"], rows), "",
            "Validation accuracy per seed:", "",
            reporting.markdown_table(["seed"] + methods, seeds_rows), ""]
    acc_lines, acc_summary, acc_head = accuracy_over_seeds(s, meta, methods, S)
    body += acc_lines
    if tim is not None:
        body += guenther_timing.report_body(*tim) + [""]
    if "simultaneous" in methods:
        ff = np.array([s[f"seed{i}/simultaneous/fwd_factor"] for i in range(S)], dtype=float)
        bf = np.array([s[f"seed{i}/simultaneous/bwd_factor"] for i in range(S)], dtype=float)
        body += ["## MGRIT convergence during simultaneous training", "",
                 f"Mean convergence factor r2/r1 of the last solve per L-BFGS iteration, over "
                 f"iterations and seeds: forward {np.nanmean(ff):.3g} (seed range "
                 f"{np.nanmin(np.nanmean(ff, 1)):.3g}..{np.nanmax(np.nanmean(ff, 1)):.3g}), adjoint "
                 f"{np.nanmean(bf):.3g}; MGRIT levels {meta['levels']}.", ""]
    body += ["## Published setting (Günther et al. 2020) next to ours", "",
             reporting.markdown_table(["paper", "value"], [[k, v] for k, v in meta["paper"].items()]),
             "", "The paper publishes no accuracy table for this run that we could compare with; "
             "the comparison is our serial vs our simultaneous training under the same code, "
             "initialization and optimizer."]
    keys = (*reporting.PROVENANCE_KEYS, "world_size")
    reporting.write_table(d / "table.md", TITLE, {k: meta[k] for k in keys if k in meta},
                          "\n".join(body))
    _summary(d, s, meta, methods, S, iters, N, rows, tim)
    with open(d / "summary.md", "a") as f:  # the accuracy over seeds (accuracy_over_seeds)
        f.write("\n".join(acc_summary) + ("\n" if acc_summary else ""))
    head = [{"claim": "simultaneous training reaches serial training's accuracy (no published "
                      "number for this run)",
             "ours": acc_head or ("; ".join(f"{r[0]}: val {r[6]}, train {r[5]}" for r in rows)
                                  + f" ({S} seeds, {iters} L-BFGS its)"), "kind": "measured"}]
    if tim is not None:
        head += guenther_timing.headline_rows(*tim)
    metas = [meta] + ([tim[1]] if tim is not None else [])
    if (d / "authors.json").is_file():  # the authors' own rows (reproduce_guenther --authors-config)
        import json
        from experiments.reproductions.guenther_authors import headline_row
        authors = json.loads((d / "authors.json").read_text())
        head.append(headline_row(authors))
        metas.append(authors)
    write_headline(d, head, metas)
    _plots(d, s, methods, S, N)


def _summary(d, s, meta, methods, S, iters, N, rows, tim=None):
    L = ["# Study 2: Günther et al. 2020 -- simultaneous layer-parallel training on Peaks", "",
         "Generated by `experiments/reproductions/reproduce_guenther.py` from `results.h5`; `table.md` has the "
         "full tables, command, commit, machine and load.", "",
         "**Their claim.** Simultaneous (one-shot) training -- 2 MGRIT iterations per "
         "optimization step, warm started, the optimizer seeing the inexact loss and gradient -- "
         "reaches the training and validation accuracy of conventional serial training, and the "
         "layer-parallel solves give a speedup on many cores for deep networks. **There is no "
         "published number for this Peaks run to compare with**: we compare our two methods with "
         "each other.", "",
         f"**Setting.** Peaks ({meta['setting_train']} training / {meta['setting_val']} "
         f"validation points), width {meta['setting_width']}, {N} residual layers, SmoothReLU, "
         f"L-BFGS({meta['setting_history']}) + Armijo, {iters} iterations, full batch, "
         f"regularization as in the paper; MGRIT cfactor {meta['setting_cfactor']}, "
         f"{meta['levels']} levels, F fine / FCF coarse, {meta['setting_mgrit_iters']} iterations "
         f"per evaluation; {S} weight seeds, {meta['world_size']} ranks.", "",
         "**Results (mean ± std over seeds).**", ""]
    for r in rows:
        L += [f"- {r[0]}: validation accuracy {r[6]}, training accuracy {r[5]}, exact training "
              f"loss {r[4]}, {r[2]} function evaluations."]
    if "simultaneous" in methods:
        ff = np.array([s[f"seed{i}/simultaneous/fwd_factor"] for i in range(S)], dtype=float)
        bf = np.array([s[f"seed{i}/simultaneous/bwd_factor"] for i in range(S)], dtype=float)
        L += [f"- MGRIT convergence factors during simultaneous training: forward "
              f"{np.nanmean(ff):.3g}, adjoint {np.nanmean(bf):.3g} (mean over iterations and seeds)."]
    if tim is not None:
        L += guenther_timing.summary_lines(*tim)
    (d / "summary.md").write_text("\n".join(L) + "\n")


def _plots(d, s, methods, S, N):
    it = s[f"seed0/{methods[0]}/iter"]
    for key, ylabel, logy in (("objective", "objective J (optimizer's)", True),
                              ("train_loss", "exact training loss", True),
                              ("train_acc", "training accuracy", False),
                              ("val_acc", "validation accuracy", False)):
        reporting.plot_lines(d / f"{key}_vs_iter.png",
                             {f"{m} (mean of {S} seeds)": (it, _curve(s, S, m, key)) for m in methods},
                             "L-BFGS iteration", ylabel, f"Peaks, N={N}", logy=logy)
    if "simultaneous" in methods:
        reporting.plot_lines(d / "convergence_factors.png",
                             {"forward r2/r1": (it, _curve(s, S, "simultaneous", "fwd_factor")),
                              "adjoint r2/r1": (it, _curve(s, S, "simultaneous", "bwd_factor"))},
                             "L-BFGS iteration", "MGRIT convergence factor",
                             f"simultaneous, N={N}, mean of {S} seeds")
