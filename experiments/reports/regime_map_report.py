"""Tables, plot and headline of ``experiments/studies/regime_map.py`` (issue 34, item 2).

* :func:`summarize` -- per cell: each option's median wall / CPU time, the strongest baseline
  (lowest median wall among the baselines measured), MGRIT's speed-up over it per paired
  repeat (median and 95% paired log-ratio interval, wall and CPU), the load gate.
* :func:`write` -- ``table.md``, ``results.json``, ``headline.json``, ``regime_map.png``.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from experiments import measure
from mgrit.reporting import writers as reporting

__all__ = ["summarize", "progress", "write"]

BASELINES = ("lean", "compiled lean", "lean DP", "pipeline")


def summarize(c: dict) -> dict:
    """The numbers of one cell (see the module docstring)."""
    raw = c["raw"]
    med = {k: (statistics.median(w for w, _ in v), statistics.median(p for _, p in v))
           for k, v in raw.items()}
    present = [b for b in BASELINES if b in raw]
    best = min(present, key=lambda b: med[b][0])
    sp = {i: measure.paired_log_ratio([t[i] for t in raw[best]], [t[i] for t in raw["MGRIT"]])
          for i in (0, 1)}
    return {"median": med, "best": best, "wall": sp[0], "cpu": sp[1],
            "reliable": c["gate"]["reliable"]}


def _label(c: dict, k: str) -> str:
    return f"pipeline ({c['pipeline']})" if k == "pipeline" else \
        f"MGRIT (m={c['mgrit_m']})" if k == "MGRIT" else k


def progress(c: dict) -> str:
    s = summarize(c)
    return (f"[regime_map] N={c['N']} w={c['width']}: MGRIT {s['median']['MGRIT'][0] * 1e3:.2f}"
            f" ms vs {_label(c, s['best'])} {s['median'][s['best']][0] * 1e3:.2f} ms: "
            f"{s['wall']['median']:.2f}x wall, {s['cpu']['median']:.2f}x CPU; "
            f"{c['gate']['note']}")


def _iv(r: dict) -> str:
    if math.isnan(r["lo"]):
        return f"{r['median']:.2f}x (n={r['n']})"
    return f"{r['median']:.2f}x [{r['lo']:.2f}, {r['hi']:.2f}]"


def write(res: dict, meta: dict, out_dir: Path, declared) -> None:
    out_dir = Path(out_dir)
    cells = res["cells"]
    S = [summarize(c) for c in cells]
    head = ["| N | width | strongest baseline | its wall [ms] | MGRIT wall [ms] | speed-up "
            "wall | speed-up CPU | load gate | verdict (declared) |", "|---|---|---|---|---|---|"
            "---|---|---|"]
    verdicts = []
    for c, s in zip(cells, S):
        v = declared.judge("regime cell, wall", {"mean": s["wall"]["mean"], "lo": s["wall"]["lo"],
                                                 "hi": s["wall"]["hi"], "n": s["wall"]["n"]},
                           reliable=s["reliable"])
        verdicts.append(v)
        short = v.split(": ")[-1]
        head.append(f"| {c['N']} | {c['width']} | {_label(c, s['best'])} | "
                    f"{s['median'][s['best']][0] * 1e3:.3g} | {s['median']['MGRIT'][0] * 1e3:.3g}"
                    f" | {_iv(s['wall'])} | {_iv(s['cpu'])} | "
                    f"{'ok' if s['reliable'] else 'UNRELIABLE'} | {short} |")
    opts = ["| N | width | " + " | ".join(f"{k} wall / CPU [ms]" for k in (*BASELINES, "MGRIT"))
            + " |", "|---|---|" + "---|" * (len(BASELINES) + 1)]
    for c, s in zip(cells, S):
        row = [f"{s['median'][k][0] * 1e3:.3g} / {s['median'][k][1] * 1e3:.3g}"
               if k in s["median"] else "not run" for k in (*BASELINES, "MGRIT")]
        opts.append(f"| {c['N']} | {c['width']} | " + " | ".join(row) + " |")
    pil = ["| N | width | pipeline candidates (pilot step after a warm-up, ms) | MGRIT m candidates "
           "(ms) |", "|---|---|---|---|"]
    f = lambda d: ", ".join(f"{k}: {v * 1e3:.3g}" if not isinstance(v, str) else f"{k}: {v}"  # noqa: E731
                            for k, v in d.items())
    for c in cells:
        pil.append(f"| {c['N']} | {c['width']} | {f(c['pipeline_pilot'])} | "
                   f"{f({str(k): v for k, v in c['mgrit_m_pilot'].items()})} |")
    wins = [f"N={c['N']} w={c['width']}" for c, v in zip(cells, verdicts) if "MGRIT faster" in v]
    unrel = sum(not s["reliable"] for s in S)
    body = ["Where the MGRIT training step (2 ranks) wins or loses against the strongest "
            "baseline on the same 2 ranks. Declared before the run:", "", *declared.lines(), "",
            f"Batch {res['batch']}, float32, momentum SGD (lr {res['lr']}, momentum "
            f"{res['momentum']}) for every option; {res['settings']['reps']} interleaved repeats"
            f" (rotated order, one warm-up step before each); speed-up = strongest baseline / "
            f"MGRIT per paired repeat: median [95% paired log-ratio interval]. Times: max over "
            f"the ranks (serial options: rank 0). MGRIT is inexact (2 forward / 1 adjoint "
            f"cycles): its gradient is not serial's.", "",
            "## MGRIT against the strongest baseline", "", *head, "",
            f"MGRIT faster (declared test) at: {', '.join(wins) if wins else 'no cell'}; "
            f"unreliable cells (load gate): {unrel} of {len(cells)}.", "",
            "## Every option (median wall / CPU per step)", "", *opts, "",
            "## Choices (pilot steps, separate from the timed repeats)", "", *pil, "",
            f"Run time: {res['seconds']:.0f} s."]
    reporting.write_table(out_dir / "table.md", "Regime map: MGRIT training step vs the strongest "
                          "baseline, P = 2", meta, "\n".join(body))
    res = dict(res, summary=[{"N": c["N"], "width": c["width"], **s, "verdict": v}
                             for c, s, v in zip(cells, S, verdicts)])
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, **res}, indent=1,
                                                     default=str))
    (out_dir / "headline.json").write_text(json.dumps({"rows": [{
        "claim": "MGRIT training step vs the strongest baseline, P = 2, depth x width",
        "kind": "timing" if unrel == 0 else "unreliable timing",
        "ours": (f"MGRIT faster at {', '.join(wins) if wins else 'no cell'} of {len(cells)}; "
                 f"{unrel} unreliable") if unrel < len(cells) else measure.UNRELIABLE}]},
        indent=1))
    _plot(out_dir / "regime_map.png", cells, S)


def _plot(path: Path, cells: list, S: list) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    Ns = sorted({c["N"] for c in cells})
    ws = sorted({c["width"] for c in cells})
    grid = np.full((len(Ns), len(ws)), np.nan)
    fig, ax = plt.subplots(figsize=(1.6 * len(ws) + 2, 1.1 * len(Ns) + 1.5))
    for c, s in zip(cells, S):
        i, j = Ns.index(c["N"]), ws.index(c["width"])
        grid[i, j] = math.log2(s["wall"]["median"])
        txt = f"{s['wall']['median']:.2f}x\n{s['best']}" + ("" if s["reliable"] else "\n(unrel.)")
        ax.text(j, i, txt, ha="center", va="center", fontsize=7)
    lim = max(1.0, float(np.nanmax(np.abs(grid))))
    im = ax.imshow(grid, cmap="RdBu", vmin=-lim, vmax=lim, origin="lower")
    ax.set_xticks(range(len(ws)), [str(w) for w in ws])
    ax.set_yticks(range(len(Ns)), [str(n) for n in Ns])
    ax.set_xlabel("width")
    ax.set_ylabel("layers N")
    ax.set_title("MGRIT speed-up over the strongest baseline (wall, P = 2)")
    fig.colorbar(im, ax=ax, label="log2 speed-up (> 0: MGRIT faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
