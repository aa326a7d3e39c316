"""Recorded runs of issue 15, over seeds (issue 24 item 2): the ViT (MNIST subset) and the
character-level GPT (the Python documentation shipped with CPython, ``pydoc-topics``) trained
serially (1 rank) and layer-parallel (2 ranks, inexact MGRIT, 2 levels, coarsening factor 2,
nested iteration), seeds 0, 1, 2, in two scalings: ``ode`` (``--T 1``, h = 1/N) and ``h1``
(``--T`` = the number of layers: h = 1, the standard pre-LN transformer).

Budgets, fixed in advance (not tuned on any result): the ViT 4 pre-LN blocks of width 32 on
3,200 training images (800 held out for validation), 10 epochs = 32,000 images; the GPT 8
layer-parallel blocks of width 32 (one serial block each side), context 32, the first 5,000
training windows of which 4,000 are trained on (1,000 held out), 6 epochs = 768,000 training
tokens. A fixed budget, not a stopping rule: how far each run is from a plateau is reported
(the relative change of the validation loss over the last epoch, mean and 95% interval over
seeds), and so is the gap at every epoch, not only the last.

Why the GPT has 8 blocks (changed after the record at commit 48a9d82, before any run of this
design): with 4 blocks on 2 levels and coarsening factor 2 there are only 2 coarse steps, so
both candidates' forward solves converged to round-off and MGRIT equalled serial to 3e-9: the
record measured nothing about inexact training. With 8 blocks (4 coarse steps) a 1-epoch probe
(1,200 windows) left forward residuals of 1e-1 (2 / 1) and 3e-3 (3 / 2): both are inexact.

Held-out choice, fixed before any run: the MGRIT cycles per solve (forward / adjoint) are chosen
per model among :data:`CANDIDATES` (2 / 1, 3 / 2) on the ``ode`` runs by the mean over seeds of
the last epoch's VALIDATION metric (ViT: accuracy, higher; GPT: loss, lower; a tie keeps the
cheaper 2 / 1); the ``h1`` runs use the setting chosen for their model. The test split is never
looked at for it; ``choice.json`` and ``table.md`` keep the validation numbers that chose it and
test numbers are reported for the chosen setting only. Targets (from issue 15): the ViT's test
accuracy within 1 point of serial, the GPT's test loss within 3% of serial; the verdict is what
the last epoch's 95% interval of the per-seed gap supports (``seeds.record_verdict``).

Usage (plain python: the script launches the 2-rank jobs itself with the venv's mpiexec)::

    python experiments/records/transformer_records.py --full          # the record (30 jobs)
    python experiments/records/transformer_records.py --report-only   # rewrite the tables
    python experiments/records/transformer_records.py --smoke --out /tmp/x   # 4 tiny jobs

Run directories:
``experiments/results/records/transformers/runs/<model>-<variant>-s<seed>-<method>/``
(``<method>``: ``serial`` or ``mgrit-c21`` / ``mgrit-c32``). Full-mode run time: 3594 s (60 min)
measured at 01fee7f, 2 idle cores, the 8-block GPT (``results/manifest.json``).
``--smoke``: seed 0, the ``ode`` variant, 2 / 1 only, tiny runs (4 jobs, about 30 s on 2 idle
cores). Accuracy is valid on a busy machine; the times per epoch are wall times under the
recorded load (kind: mixed). Machinery: ``records.py`` (jobs, rows, the exact evaluation) and
``experiments/reports/seeds.py`` (intervals, choice, verdict).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``python experiments/<kind>/<script>.py``
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "records"  # default results base folder

from experiments.records import records  # noqa: E402
from experiments.reports import seeds  # noqa: E402
from mgrit.reporting.writers import (add_study_flags, finish_metadata, results_dir,  # noqa: E402
                                   run_metadata, write_table)

STUDY = "transformers"
SEEDS = (0, 1, 2)
#: layer-parallel blocks per model (the GPT: see the docstring)
LAYERS = {"vit": 4, "gpt": 8}
_ADAM = ["--optimizer", "adam", "--batch-size", "50", "--val-fraction", "0.2"]
#: model -> (flags of every run, choice metric, reported metric, tolerance, unit)
MODELS = {
    "vit": (["--model", "vit", "--dataset", "mnist5k", "--d-model", "32", "--heads", "4",
             "--layers", str(LAYERS["vit"]), "--patch", "7", *_ADAM, "--lr", "1e-3",
             "--epochs", "10"],
            "val_acc", "test_acc", 1.0, "points"),
    "gpt": (["--model", "gpt", "--dataset", "pydoc-topics", "--d-model", "32", "--heads", "4",
             "--layers", str(LAYERS["gpt"]), "--buffer-layers", "1", "--context", "32",
             "--limit-train", "5000", "--limit-test", "1000", *_ADAM, "--lr", "2e-3",
             "--epochs", "6"],
            "val_loss", "test_loss", 3.0, "%"),
}
#: scaling -> model -> flags: h = T / N (``h1``: ``--T`` = the model's number of blocks)
VARIANTS = {"ode": {m: ["--T", "1"] for m in LAYERS},
            "h1": {m: ["--T", str(n)] for m, n in LAYERS.items()}}
_MG = ["--levels", "2", "--cfactor", "2", "--nested-iteration"]
#: the held-out choice: name -> MGRIT flags, in order of cost (a tie keeps the earlier)
CANDIDATES = {"2/1": [*_MG, "--fwd-iters", "2", "--bwd-iters", "1"],
              "3/2": [*_MG, "--fwd-iters", "3", "--bwd-iters", "2"]}
SMOKE = ["--limit-train", "80", "--limit-test", "32", "--epochs", "2"]
SMOKE_SEEDS, SMOKE_VARIANTS, SMOKE_CANDIDATES = (0,), ("ode",), ("2/1",)


def tag(candidate: str) -> str:
    return "mgrit-c" + candidate.replace("/", "")


def run_dir(base: Path, model: str, variant: str, seed: int, method: str) -> Path:
    return base / "runs" / f"{model}-{variant}-s{seed}-{method}"


def run(model: str, variant: str, seed: int, method: str, base: Path, smoke: bool) -> None:
    mg = next((f for c, f in CANDIDATES.items() if tag(c) == method), [])
    out = run_dir(base, model, variant, seed, method)
    flags = [*MODELS[model][0], *VARIANTS[variant][model], "--seed", str(seed)]
    # --smoke: the gpt keeps its --limit-train unless overridden (later flags win)
    records.run_job(records.command(flags, mg, method, out, smoke, SMOKE), out)


def _runs(base, model, variant, seeds_, method) -> dict:
    got = {k: records.load(run_dir(base, model, variant, k, method)) for k in seeds_}
    return {k: v for k, v in got.items() if v is not None}


def chosen(base: Path, model: str, seeds_, candidates) -> tuple[str, dict]:
    """The candidate chosen on the ``ode`` runs' validation metric (seeds all have)."""
    runs = {c: _runs(base, model, "ode", seeds_, tag(c)) for c in candidates}
    common = sorted(set.intersection(*(set(r) for r in runs.values())))
    if not common:
        raise ValueError(f"{model}: no seed has a run of every candidate {list(candidates)}")
    return seeds.choose({c: [runs[c][k] for k in common] for c in candidates},
                        MODELS[model][1])


def analyse(base: Path, seeds_, variants, candidates) -> dict:
    """Per model: the choice; per variant: the per-epoch statistics of the reported metric,
    the validation metric, the plateau numbers and the table rows of the chosen setting."""
    out = {}
    for model, (_, vkey, tkey, tol, unit) in MODELS.items():
        try:
            pick, val = chosen(base, model, seeds_, candidates)
        except ValueError:
            continue
        m = {"chosen": pick, "validation": val, "variants": {}}
        for variant in variants:
            s = _runs(base, model, variant, seeds_, "serial")
            g = _runs(base, model, variant, seeds_, tag(pick))
            pairs = {k: (s[k], g[k]) for k in sorted(set(s) & set(g))}
            if not pairs:
                continue
            test = seeds.per_epoch(pairs, tkey)
            m["variants"][variant] = {
                "pairs": pairs, "test": test, "val": seeds.per_epoch(pairs, vkey),
                "verdict": seeds.record_verdict(test[-1]["gap"], tol, unit,
                                         seeds.METRICS[tkey][1]),
                "plateau": {meth: seeds.plateau([p[i] for p in pairs.values()], "val_loss")
                            if len(test) > 1 else None
                            for i, meth in enumerate(("serial", "mgrit"))}}
        out[model] = m
    return out


COLUMNS = ["model", "method", "ranks", "epochs", "parameters", "train loss", "test accuracy",
           "test loss", "bpc", "final weights, exact forward", "time / epoch (s)",
           "last fwd residual (epoch mean)", "commit"]


def _plateau_text(p) -> str:
    if p is None:
        return "one epoch: no plateau measure"
    return f"{seeds.fmt_interval(p, '%', 2, signed=True)}"


def report(base: Path, seeds_=SEEDS, variants=tuple(VARIANTS), candidates=tuple(CANDIDATES)):
    """table.md, summary.md, choice.json, gap_<model>.png and headline.json from base/runs."""
    a = analyse(base, seeds_, variants, candidates)
    meta = run_metadata()
    blocks = ", ".join(f"{m} {n}" for m, n in LAYERS.items())
    body = [f"Serial (1 rank) vs layer-parallel MGRIT (2 ranks, inexact, 2 levels, coarsening "
            f"factor 2, nested iteration), seeds {list(seeds_)}; `ode`: `--T 1` (h = 1/N), "
            f"`h1`: `--T` = the number of blocks ({blocks}; h = 1). Budgets fixed in "
            f"advance (see the script's "
            f"docstring). Every run holds out the last 20% of its training data as a "
            f"validation split (`--val-fraction 0.2`); the MGRIT cycles are chosen on it "
            f"(the `ode` runs), never on the test split; test numbers for the chosen setting "
            f"only. Intervals: two-sided 95% Student-t over the seeds; accuracy gaps are the "
            f"paired interval of the per-seed differences (points), loss gaps the interval of "
            f"the per-seed relative differences (% of serial).", ""]
    rows = []
    for model, m in a.items():
        _, vkey, tkey, tol, unit = MODELS[model]
        what = "validation accuracy" if vkey == "val_acc" else "validation loss"
        body += [f"## {model}: held-out choice ({what}, last epoch, `ode`)", "",
                 "| MGRIT cycles (forward / adjoint) | mean [95% interval] | seeds | chosen |",
                 "|---|---|---|---|"]
        for c, st in m["validation"].items():
            u = "%" if vkey == "val_acc" else ""
            body.append(f"| {c} | {seeds.fmt_interval(st, u, 2 if u else 4)} | {st['n']} | "
                        f"{'yes' if c == m['chosen'] else ''} |")
        body.append("")
        curves = {}
        for variant, v in m["variants"].items():
            tw = "test accuracy" if tkey == "test_acc" else "test loss"
            body += [f"### {model} {variant}: {tw} per epoch (MGRIT {m['chosen']})", "",
                     *seeds.gap_table(v["test"], tkey, tw), "",
                     f"### {model} {variant}: {what} per epoch", "",
                     *seeds.gap_table(v["val"], vkey, what), "",
                     f"Verdict (last epoch, test, target within {tol:g} {unit}): "
                     f"{v['verdict']}.", "",
                     f"Change of the validation loss over the last epoch (plateau: near 0): "
                     f"serial {_plateau_text(v['plateau']['serial'])}, MGRIT "
                     f"{_plateau_text(v['plateau']['mgrit'])}.", ""]
            curves[f"{variant} test"] = v["test"]
            for k, (s, g) in v["pairs"].items():
                for summ, meth in ((s, "serial"), (g, tag(m["chosen"]))):
                    d = run_dir(base, model, variant, k, meth)
                    rows.append(records.row(f"{model}-{variant}-s{k}", meth, summ, d, STUDY))
        if curves:
            seeds.gap_figure(base / f"gap_{model}.png", curves, unit,
                             f"{model}: MGRIT {m['chosen']} - serial")
    body += ["## Runs (chosen setting)", "", *records.table(rows, COLUMNS), "",
             *records.commands(rows), "", "GPT accuracy columns are token accuracies; bpc = "
             "test loss / ln 2."]
    write_table(base / "table.md", "ViT and GPT over seeds: serial (1 rank) vs layer-parallel "
                "MGRIT (2 ranks)", meta, "\n".join(body))
    (base / "choice.json").write_text(json.dumps({
        "meta": finish_metadata(meta), "rule": "per model, the best mean last-epoch "
        "validation metric of the ode runs over seeds (vit: val_acc, gpt: val_loss); ties keep "
        "the cheaper", "chosen": {k: m["chosen"] for k, m in a.items()},
        "validation": {k: m["validation"] for k, m in a.items()}}, indent=1))
    (base / "summary.md").write_text(_summary(a, rows, meta))
    (base / "headline.json").write_text(json.dumps(_headline(a, rows), indent=1))
    print((base / "summary.md").read_text())


def readme_sentence(a: dict) -> str:
    """The top README's sentence on the transformers (checked against the stored runs by
    ``tests/experiments/test_provenance.py``)."""
    parts = []
    for model, m in a.items():
        for variant, v in m["variants"].items():
            g = v["test"][-1]["gap"]
            u = MODELS[model][4]
            parts.append(f"{model} {variant} {seeds.fmt_interval(g, '', 2, signed=True)} {u}")
    chosen_ = ", ".join(f"{k} {m['chosen']}" for k, m in a.items())
    return (f"cycles chosen on the validation split: {chosen_}; final test gap MGRIT - serial, "
            f"mean [95% interval] over seeds: {'; '.join(parts)}")


def _headline(a: dict, rows: list) -> dict:
    out = []
    for model, m in a.items():
        tkey = MODELS[model][2]
        for variant, v in m["variants"].items():
            last = v["test"][-1]
            u = "%" if tkey == "test_acc" else ""
            d = 2 if u else 4
            out.append({"claim": f"{model} ({variant}): 2-rank inexact MGRIT ({m['chosen']} "
                                 f"cycles, chosen on validation) vs serial, "
                                 f"{'test accuracy' if u else 'test loss'}",
                        "ours": f"serial {seeds.fmt_interval(last['serial'], u, d)} vs MGRIT "
                                f"{seeds.fmt_interval(last['mgrit'], u, d)} ({len(v['pairs'])} "
                                f"seeds, {last['epoch']} epochs); {v['verdict']}",
                        "kind": "measured"})
    return {"commits": sorted({r["commit"] for r in rows}), "rows": out}


def _summary(a: dict, rows: list, meta: dict) -> str:
    out = ["# Summary (generated from the runs; every run in table.md)", "",
           "Targets (issue 15): ViT test accuracy within 1 point of serial, GPT test loss "
           "within 3% of serial, shown by the 95% interval over seeds of the last epoch's gap.",
           ""]
    for model, m in a.items():
        for variant, v in m["variants"].items():
            gaps = ", ".join(f"{r['epoch']}: {seeds.fmt_interval(r['gap'], '', 2, signed=True)}"
                             for r in v["test"])
            out.append(f"- **{model} {variant}** (MGRIT {m['chosen']}, chosen on validation): "
                       f"{v['verdict']}. Gap per epoch: {gaps}. Validation loss change over "
                       f"the last epoch: serial {_plateau_text(v['plateau']['serial'])}, MGRIT "
                       f"{_plateau_text(v['plateau']['mgrit'])}.")
    out += ["", f"README sentence: {readme_sentence(a)}.", "",
            f"Commits of the runs: {sorted({r['commit'] for r in rows})}. Report written "
            f"{meta['date']}.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_study_flags(p, "the record: both models, both scalings, seeds 0-2, both candidates "
                    "(the default)", "seed 0, ode, 2/1 only, tiny runs: " + " ".join(SMOKE))
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite the tables from the runs under runs/")
    p.add_argument("--only", choices=sorted(MODELS), action="append",
                   help="run only these models (repeatable)")
    a = p.parse_args(argv)
    if a.full and a.smoke:
        p.error("--full and --smoke exclude each other")
    seeds_ = SMOKE_SEEDS if a.smoke else SEEDS
    variants = SMOKE_VARIANTS if a.smoke else tuple(VARIANTS)
    candidates = SMOKE_CANDIDATES if a.smoke else tuple(CANDIDATES)
    base = Path(a.out or OUT) / STUDY  # created below, after --report-only's check
    if a.report_only:  # every model's ode runs (the choice), then its other variants' runs
        records.require_runs(p, [run_dir(base, model, "ode", k, m) for model in MODELS
                                 for k in seeds_ for m in ("serial", *map(tag, candidates))])
        records.require_runs(p, [run_dir(base, model, v, k, m) for model in MODELS
                                 for m in ("serial", tag(chosen(base, model, seeds_,
                                                                candidates)[0]))
                                 for v in variants if v != "ode" for k in seeds_])
    base = results_dir(STUDY, a.out or OUT)
    if not a.report_only:
        for model in a.only or MODELS:
            for seed in seeds_:  # ode: serial and every candidate
                for method in ("serial", *map(tag, candidates)):
                    run(model, "ode", seed, method, base, a.smoke)
            pick, _ = chosen(base, model, seeds_, candidates)  # validation only
            for variant in variants:
                if variant == "ode":
                    continue
                for seed in seeds_:
                    for method in ("serial", tag(pick)):
                        run(model, variant, seed, method, base, a.smoke)
    report(base, seeds_, variants, candidates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
