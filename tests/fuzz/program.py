"""Programs: a network spec and a list of user actions, generated from a choice source, plus the
shrinker used for multi-rank runs.

A program is JSON: ``{"net": {spec, see tests.fuzz.nets}, "actions": [[kind, {args}], ...]}``.
:func:`generate` draws one from a *chooser* with three methods (``int(lo, hi)``,
``pick(seq)``, ``bool(p)``): :class:`RandomChooser` (a seeded ``random.Random``: the same
program on every rank, no message needed) or the Hypothesis chooser of
``tests/test_fuzz.py`` (``data.draw``), so both share one generator and Hypothesis shrinks
the same program space. Choices are ordered simplest first (Hypothesis shrinks towards the
first element).

Every feature of :data:`FEATURES` is generated only when it is in ``enabled``; by default
(:func:`default_features`) those not in :data:`KNOWN_BROKEN_ON_MAIN` (issue 22 items 1-10).
"""
from __future__ import annotations

import json
import random

from . import paths_autograd
from .nets import KINDS

#: Features that can be switched off, each a class of issue 22.
FEATURES = frozenset({
    "subclass_step",     # item 1: subclasses of shipped steps overriding forward
    "hooks_multilevel",  # item 2: module hooks on steps with 2 levels
    "replace_param",     # item 3: step.weight = nn.Parameter(...) after build
    "load_assign",       # item 3: load_state_dict(sd, assign=True)
    "unfreeze_dp",       # item 4: unfreezing under data parallelism (2 replicas, P = 2)
    "nan",               # item 5: NaN in the adjoint, every rank the same verdict
    "autocast",          # item 7: torch.autocast around the net (float64: must be a no-op)
    "compile",           # item 8: torch.compile'd steps, state-dict keys
    "clip",              # item 10: clip_grad_norm_ on every rank (global norm expected)
    "freeze_pending",    # found by the fuzzer: freezing a parameter while a graph is pending
    "spatial",           # issue 35: spatial coarsening of the coarse level (conv kind)
}) | paths_autograd.FEATURES  # issue 36: transforms (input_grad, functional_call, ...)

#: THE SWITCH: features main gets wrong. Generated only when asked for (``--enable``); delete
#: a line once the fix of its class is merged, and CI and the campaign include it.
KNOWN_BROKEN_ON_MAIN: frozenset = frozenset()  # every class found so far is fixed

#: Too slow for the CI budget (torch.compile takes seconds per module): campaign only.
CAMPAIGN_ONLY = frozenset({"compile"}) | paths_autograd.CAMPAIGN_ONLY


def default_features(ci: bool = False) -> frozenset:
    """What runs without ``--enable``: every feature not known broken (CI: nor campaign-only)."""
    return FEATURES - KNOWN_BROKEN_ON_MAIN - (CAMPAIGN_ONLY if ci else frozenset())

ACTIONS = ("forward", "backward", "autograd_grad", "accumulate", "zero_grad", "train", "freeze",
           "opt_new", "opt_step", "hook_add", "hook_remove", "checkpoint", "reload_self",
           "clip", "replace_param", "load_assign", "nan_backward")


class RandomChooser:
    """Choices from ``random.Random(seed)``: identical on every rank for the same seed."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def bool(self, p: float = 0.5) -> bool:
        return self.rng.random() < p


def generate_spec(c, enabled=frozenset()) -> dict:
    kind = c.pick(KINDS)
    steps = ["shipped", "user", "buffer"]
    if "subclass_step" in enabled:
        steps += ["subclass", "subclass_buffer"]
    spec = {"kind": kind, "step": "shipped" if kind == "gru" else c.pick(steps),
            "layers": c.pick([4, 5, 6]), "levels": c.pick([1, 2]), "norm": c.pick(["l2", "inf"]),
            "compiled": kind != "gru" and "compile" in enabled and c.bool(0.05),
            "dp": c.pick([1, 1, 2]), "seed": c.int(0, 9999)}
    if kind == "conv" and "spatial" in enabled and c.bool(0.5):  # drawn last: other specs keep
        spec["spatial"] = {"grid": c.pick(["cell", "vertex"]),    # their seeds' programs
                           "restrict": c.pick(["full_weighting", "injection"]),
                           "prolong": c.pick(["linear", "constant"])}
    return spec


def _kinds(spec, enabled, pending, hooks):
    """The action kinds allowed now, repeated by weight (simplest first)."""
    out = ["forward"] * 4 + ["backward"] * (4 if pending else 1)
    out += ["zero_grad", "opt_step", "opt_step", "train", "opt_new", "accumulate",
            "autograd_grad", "checkpoint", "reload_self"]
    if not pending or "freeze_pending" in enabled:  # (requires_grad changed before a backward)
        out.append("freeze")
    gru = spec["kind"] == "gru"
    if not gru and (spec["levels"] == 1 or "hooks_multilevel" in enabled):
        out += ["hook_add"] * 2 + ["hook_remove"] * (2 if hooks else 0)
    for feat, kind in (("clip", "clip"), ("replace_param", "replace_param"),
                       ("load_assign", "load_assign"), ("nan", "nan_backward")):
        if feat in enabled:  # weighted up: enabled to be looked for
            out += [kind] * 3
    return out + paths_autograd.kinds(enabled)


def generate_action(c, spec, enabled, state) -> list:
    kind = c.pick(_kinds(spec, enabled, state["pending"], state["hooks"]))
    modes = ["grad", "grad", "no_grad", "inference"] + (["autocast"] if "autocast" in enabled
                                                         else [])
    if kind == "forward":
        args = {"x": c.int(0, 999), "mode": c.pick(modes)}
        state["pending"] += args["mode"] in ("grad", "autocast")
    elif kind in ("backward", "autograd_grad"):
        args = {"i": c.int(0, 3), "w": c.int(0, 999), "retain": c.bool(0.2)}
        if kind == "backward":
            args["all"] = c.bool(0.3)
        if not args["retain"]:
            state["pending"] = 0 if args.get("all") else max(0, state["pending"] - 1)
    elif kind == "accumulate":
        args = {"x": c.int(0, 999), "w": c.int(0, 999), "chunks": c.pick([2, 3])}
    elif kind == "zero_grad":
        args = {"none": c.bool(0.7)}
    elif kind == "train":
        args = {"on": c.bool()}
    elif kind == "freeze":  # unfreezing under data parallelism is gated (item 4)
        args = {"p": c.int(0, 99),
                "on": c.bool() and (spec["dp"] == 1 or "unfreeze_dp" in enabled)}
    elif kind == "opt_new":
        args = {"kind": c.pick(["sgd", "adam"]), "lr": c.pick([0.1, 0.01]),
                "momentum": c.pick([0.0, 0.9]), "wd": c.pick([0.0, 0.01])}
    elif kind == "hook_add":
        args = {"kind": c.pick(["count", "scale", "pre"])}
        state["hooks"] += 1
    elif kind == "hook_remove":
        args = {}
        state["hooks"] = max(0, state["hooks"] - 1)
    elif kind == "clip":
        args = {"max_norm": c.pick([0.5, 0.05])}
    elif kind == "replace_param":
        args = {"p": c.int(0, 99)}
    elif kind == "load_assign":
        args = {"scale": c.pick([0.9, 1.1])}
    elif kind in ("checkpoint", "reload_self", "nan_backward"):
        args = {"x": c.int(0, 999)}
    else:
        args = paths_autograd.action_args(c, kind, state) or {}
    if kind in ("opt_step", "replace_param", "load_assign", "checkpoint"):
        state["pending"] = 0
        state["hooks"] = 0 if kind == "checkpoint" else state["hooks"]
    return [kind, args]


def generate(c, enabled=None, max_actions: int = 12) -> dict:
    """One program from chooser ``c``; ``enabled``: names of :data:`FEATURES` (default:
    :func:`default_features`)."""
    enabled = default_features() if enabled is None else frozenset(enabled)
    spec = generate_spec(c, enabled)
    state = {"pending": 0, "hooks": 0}
    n = c.int(1, max_actions)
    return {"net": spec, "actions": [generate_action(c, spec, enabled, state) for _ in range(n)]}


def from_seed(seed: int, enabled=None) -> dict:
    return generate(RandomChooser(seed), enabled)


def dumps(program: dict) -> str:
    return json.dumps(program, sort_keys=True, separators=(",", ":"))


# -- shrinking (multi-rank runs; Hypothesis shrinks the 1-rank ones) ----------------------------
SIMPLER = (("spatial", None), ("compiled", False), ("dp", 1), ("norm", "l2"), ("levels", 1), ("step", "shipped"),
           ("kind", "dense"), ("layers", 4))


def shrink(program: dict, fails, budget: int = 60) -> dict:
    """A smaller program for which ``fails(program) -> bool`` still holds (greedy delta
    debugging: drop chunks of actions, halving the chunk size, then simplify the network spec
    one key at a time). ``fails`` must be deterministic (it is run collectively on every rank
    with the same candidates). At most ``budget`` candidates are tried."""
    tries = [0]

    def check(candidate):
        if tries[0] >= budget:
            return False
        tries[0] += 1
        return fails(candidate)

    best = json.loads(dumps(program))
    acts = best["actions"]
    chunk = max(1, len(acts) // 2)
    while chunk >= 1:
        i = 0
        while i < len(acts):
            cand = acts[:i] + acts[i + chunk:]
            if cand and check({"net": best["net"], "actions": cand}):
                acts = cand
            else:
                i += chunk
        chunk //= 2
    best["actions"] = acts
    for key, value in SIMPLER:
        if best["net"].get(key, value) != value:
            net = dict(best["net"], **{key: value})
            if check({"net": net, "actions": acts}):
                best["net"] = net
    return best
