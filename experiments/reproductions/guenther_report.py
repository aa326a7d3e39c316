"""``table.md``, ``summary.md`` and plots of ``reproduce_guenther.py``, rebuilt from ``results.h5``
alone: every number comes from the file (mean +- std over the weight seeds)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mgrit.training import report as reporting
from experiments.reports.study_parts import read_part, write_headline

TITLE = "Günther et al. 2020 -- Peaks, serial vs simultaneous layer-parallel training"


def _final(s, seeds, method, key):
    return np.array([s[f"seed{i}/{method}/{key}"][-1] for i in range(seeds)], dtype=float)


def _pm(a, pct=False):
    a = np.asarray(a, dtype=float)
    if pct:
        return f"{100 * a.mean():.1f} ± {100 * a.std():.1f}%"
    return f"{a.mean():.4g} ± {a.std():.2g}"


def _curve(s, seeds, method, key):
    return np.mean([s[f"seed{i}/{method}/{key}"] for i in range(seeds)], axis=0)


def write(d: Path) -> None:
    s, meta = read_part(d / "results.h5", "run")
    methods, S = meta["methods"], int(meta["setting_seeds"])
    iters, P = int(meta["setting_iters"]), int(meta["world_size"])
    N = int(meta["setting_layers"])
    model_P = [int(q) for q in s["model/P"]]
    per_eval = {m: s[f"model/{m}/per_eval"] for m in methods}
    rows = []
    for m in methods:
        ev = _final(s, S, m, "evals")
        rows.append([m, iters, _pm(ev), _pm(_final(s, S, m, "objective")),
                     _pm(_final(s, S, m, "train_loss")), _pm(_final(s, S, m, "train_acc"), True),
                     _pm(_final(s, S, m, "val_acc"), True), _pm(_final(s, S, m, "wall"))]
                    + [f"{ev.mean() * per_eval[m][j]:.3g}" for j in range(len(model_P))])
    seeds_rows = [[i] + [f"{100 * s[f'seed{i}/{m}/val_acc'][-1]:.1f}%" for m in methods]
                  for i in range(S)]
    body = [f"## Final numbers, mean ± std over {S} weight seeds (same Peaks data)", "",
            "Accuracy, objective and evaluations are valid on a loaded machine; wall seconds "
            f"(measured, P = {P}, load average {meta['loadavg']}) and the modeled seconds (cost "
            "model with step costs calibrated on this machine x mean evaluations) need a quiet "
            "one.", "",
            reporting.markdown_table(["method", "L-BFGS iters", "evaluations",
                                      "final objective (optimizer's)", "train loss (exact)",
                                      "train acc", "val acc", f"wall s (P={P})"]
                                     + [f"modeled s, P={q}" for q in model_P], rows), "",
            "Validation accuracy per seed:", "",
            reporting.markdown_table(["seed"] + methods, seeds_rows), ""]
    if "serial" in methods and "simultaneous" in methods:
        sp = [[q, per_eval["serial"][j], per_eval["simultaneous"][j],
               per_eval["serial"][j] / per_eval["simultaneous"][j]] for j, q in enumerate(model_P)]
        body += ["## MODELED time per evaluation (forward + gradient), critical path", "",
                 reporting.markdown_table(["P", "serial s", "simultaneous s", "modeled speedup"], sp),
                 "", "## MODELED scaling (cost model only, not run)", "",
                 reporting.markdown_table(["N layers", "P", "serial s / eval",
                                           "simultaneous s / eval", "modeled speedup"],
                                          [[int(r[0]), int(r[1]), r[2], r[3], r[2] / r[3]]
                                           for r in s["model/scaling"]]), ""]
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
    _summary(d, s, meta, methods, S, iters, N, rows)
    head = [{"claim": "simultaneous training reaches serial training's accuracy (no published "
                      "number for this run)",
             "ours": "; ".join(f"{r[0]}: val {r[6]}, train {r[5]}" for r in rows)
                     + f" ({S} seeds, {iters} L-BFGS its)", "kind": "measured"}]
    if "serial" in methods and "simultaneous" in methods:
        sc = [r for r in s["model/scaling"] if int(r[0]) == 1024]
        if sc:
            head.append({"claim": "speedup with many cores for deep networks",
                         "ours": "N = 1024: " + ", ".join(f"{r[2] / r[3]:.2f}x (P = {int(r[1])})"
                                                          for r in sc)
                                 + " per evaluation (CPU-calibrated cost model)",
                         "kind": "modeled"})
    write_headline(d, head, [meta])
    _plots(d, s, methods, S, N, model_P, per_eval)


def _summary(d, s, meta, methods, S, iters, N, rows):
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
    if "serial" in methods and "simultaneous" in methods:
        q = [int(v) for v in s["model/P"]]
        sp = [s["model/serial/per_eval"][j] / s["model/simultaneous/per_eval"][j] for j in range(len(q))]
        sc = s["model/scaling"]
        deep = [f"{r[2] / r[3]:.2f}x (P = {int(r[1])})" for r in sc if int(r[0]) == 1024]
        L += ["", f"**Speed (MODELED, cost model with step costs calibrated on this machine; load "
              f"average {meta['loadavg']}).** Per evaluation at N = {N}: "
              + ", ".join(f"{v:.2f}x (P = {p})" for p, v in zip(q, sp))
              + (f"; at N = 1024: {', '.join(deep)}" if deep else "")
              + ". Measured wall times at P = 2 are in `table.md`; both need a quiet machine."]
    (d / "summary.md").write_text("\n".join(L) + "\n")


def _plots(d, s, methods, S, N, model_P, per_eval):
    it = s[f"seed0/{methods[0]}/iter"]
    for key, ylabel, logy in (("objective", "objective J (optimizer's)", True),
                              ("train_loss", "exact training loss", True),
                              ("train_acc", "training accuracy", False),
                              ("val_acc", "validation accuracy", False)):
        reporting.plot_lines(d / f"{key}_vs_iter.png",
                             {f"{m} (mean of {S} seeds)": (it, _curve(s, S, m, key)) for m in methods},
                             "L-BFGS iteration", ylabel, f"Peaks, N={N}", logy=logy)
    q = max(model_P)
    j = model_P.index(q)
    reporting.plot_lines(d / "train_loss_vs_modeled_time.png",
                         {f"{m} (P={q})": (_curve(s, S, m, "evals") * per_eval[m][j],
                                           _curve(s, S, m, "train_loss")) for m in methods},
                         "modeled time [s] (cost model)", "exact training loss",
                         f"Peaks, N={N} [modeled time]", logy=True)
    if "simultaneous" in methods:
        reporting.plot_lines(d / "convergence_factors.png",
                             {"forward r2/r1": (it, _curve(s, S, "simultaneous", "fwd_factor")),
                              "adjoint r2/r1": (it, _curve(s, S, "simultaneous", "bwd_factor"))},
                             "L-BFGS iteration", "MGRIT convergence factor",
                             f"simultaneous, N={N}, mean of {S} seeds")
