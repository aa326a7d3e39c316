"""Report helpers of the model's validation (T5) and of Kirby's setting (T4) for
``experiments/benchmarks/bench_layerparallel.py``: markdown from measured and predicted times.

* :func:`error_table` -- per configuration: the measured and predicted medians and the median
  of the per-repeat errors (each repeat's prediction comes from that repeat's calibration).
* :func:`kirby_table` -- N = 4096, P = 64, m = 64, 2 levels, FCF, 2 forward cycles (Kirby et
  al. 2020's setting) from calibrated costs, over message latencies, against the blocking chain
  (nn.Sequential kernels: Kirby's comparison; lean kernels), GPipe with the best number of
  micro-batches (lean kernels) and the strongest baseline (incl. data parallelism).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

from ..options import MGRITOptions
from .model import CommCost
from .steptime import training_times
from .strategies import best_gpipe, data_parallel_step, gpipe_step, serial_step

__all__ = ["error_table", "kirby_table", "KIRBY"]

med = statistics.median

#: Kirby et al. 2020's setting.
KIRBY = dict(N=4096, P=64, m=64, batch=64, levels=2, relax="FCF", K_f=2, K_b=1)


def error_table(cases: Sequence[dict], target: float = 0.25) -> tuple[list, dict]:
    """``cases``: dicts with ``N``, ``label``, ``P``, ``measured`` and ``predicted`` (lists,
    one entry per repeat). Returns markdown lines and ``{P: max |median per-repeat error|}``."""
    L = ["| N | configuration | P | measured [s] (median) | predicted [s] (median) | "
         "error, median of per-repeat errors |", "|---|---|---|---|---|---|"]
    worst = {}
    for c in cases:
        errs = [(p - m) / m for m, p in zip(c["measured"], c["predicted"]) if m > 0]
        e = med(errs) if errs else float("nan")
        worst[c["P"]] = max(worst.get(c["P"], 0.0), abs(e))
        flag = "" if abs(e) <= target else " **(> 25%)**"
        L.append(f"| {c['N']} | {c['label']} | {c['P']} | {med(c['measured']):.4f} | "
                 f"{med(c['predicted']):.4f} | {e * 100:+.0f}%{flag} |")
    return L, worst


def _opts(m, iters, relax, levels=2):
    return MGRITOptions(max_levels=levels, cfactor=m, tol=0, max_iter=iters, relax=relax)


def kirby_table(sources: dict, latencies: Sequence[float] = (1e-6, 10e-6, 50e-6, 100e-6),
                bandwidth: float = 10e9, setting: dict = KIRBY) -> list:
    """``sources``: ``name -> (module NetCosts, lean NetCosts, TrainCosts of 2-level MGRIT,
    TrainCosts of the 2-level forward with a one-level adjoint)`` (per-layer costs at
    ``setting['batch']``, the last from ``chain_costs(..., backward=MGRITOptions(max_levels=1))``:
    the adjoint's single steps of Kirby's serial sweep; the lean curves down to batch 1 for
    GPipe's micro-batches). Returns markdown lines."""
    s = setting
    N, P, b, m = s["N"], s["P"], s["batch"], s["m"]
    fo, bo = _opts(m, s["K_f"], s["relax"], s["levels"]), _opts(m, s["K_b"], s["relax"], s["levels"])
    one = MGRITOptions(max_levels=1)
    L = ["| per-rank costs | latency [us] | MGRIT fwd vs chain (nn.Sequential) | MGRIT train vs "
         "chain (nn.Sequential) | vs chain (lean) | vs GPipe, lean, best M | vs strongest "
         "baseline (which) | train with serial adjoint (Kirby) vs chain (nn.Sequential) |",
         "|---|---|---|---|---|---|---|---|"]
    for name, (mod, lean, tc, tc1) in sources.items():
        mod, lean = dataclasses.replace(mod, n_layers=N), dataclasses.replace(lean, n_layers=N)
        for lat in latencies:
            cc = CommCost(lat, bandwidth)
            tm = training_times(N, P, tc, fo, bo, s["K_f"], s["K_b"], cc)["mgrit"]
            kb = training_times(N, P, tc1, fo, one, s["K_f"], 1, cc)["mgrit"]
            kirby_train = tm["forward"] + kb["backward"] + (kb["train"] - kb["forward"] - kb["backward"])
            beta = cc.message(b * mod.state_bytes)
            chain_fwd = N * mod.layer_fwd(b) + (P - 1) * beta
            chain_mod = gpipe_step(mod, b, P, 1, cc)
            chain_lean = gpipe_step(lean, b, P, 1, cc)
            gp, M = best_gpipe(lean, b, P, cc)
            base = {"lean serial": serial_step(lean, b), "lean chain": chain_lean,
                    f"GPipe lean M={M}": gp, f"data parallel lean x{P}": data_parallel_step(lean, b, P, cc)}
            which = min(base, key=base.get)
            L.append(f"| {name} | {lat * 1e6:.0f} | {chain_fwd / tm['forward']:.1f}x | "
                     f"{chain_mod / tm['train']:.1f}x | {chain_lean / tm['train']:.1f}x | "
                     f"{gp / tm['train']:.1f}x (M = {M}) | {base[which] / tm['train']:.1f}x "
                     f"({which}) | {chain_mod / kirby_train:.1f}x |")
    return L
