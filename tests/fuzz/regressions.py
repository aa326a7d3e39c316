"""Regression programs: shrunk findings of the fuzzer, replayed by tests/test_fuzz.py.

Each entry: ``feature`` (the :data:`~tests.fuzz.program.FEATURES` name the program needs, or
None), ``issue`` (issue 22 item), ``ranks``, ``source`` (the seed that found it, or
"hand-reduced" for a program written in the fuzzer's language from a finding) and the
``program``. An entry whose feature is still in ``KNOWN_BROKEN_ON_MAIN`` is skipped; once its
fix is merged and the name deleted from that set, the program must not fail (``ok``, or a
refusal on every rank such as a NaN verdict). With h2's branch (items 4, 5, 10) the entries
of ``unfreeze_dp``, ``nan`` and ``clip`` were checked to pass.
Replay one: ``python -m tests.fuzz replay --ranks K '<program json>'``.
"""


def _net(kind="dense", step="shipped", layers=4, levels=2, seed=0, **kw):
    return dict({"kind": kind, "step": step, "layers": layers, "levels": levels, "norm": "l2",
                 "compiled": False, "dp": 1, "seed": seed}, **kw)  # kw may replace "norm"


FWD = ["forward", {"x": 1, "mode": "grad"}]
BWD = ["backward", {"i": 0, "w": 2, "retain": False, "all": False}]

REGRESSIONS = [
    # item 1: subclass of a shipped step (output 0.18 off at P=1; Hypothesis-shrunk)
    {"feature": "subclass_step", "issue": "item 1", "ranks": 1, "source": "hypothesis",
     "program": {"net": _net(step="subclass"), "actions": [["forward", {"mode": "grad", "x": 0}]]}},
    # item 1 with a per-layer buffer (0.16 off at P=2, 0.025 at P=3; seed 9, 11 -> 1 action)
    *[{"feature": "subclass_step", "issue": "item 1", "ranks": k, "source": "seed 9",
       "program": {"net": _net(step="subclass_buffer", seed=3049),
                   "actions": [["forward", {"mode": "no_grad", "x": 941}]]}} for k in (2, 3)],
    # item 1, TransformerStep subclass with a buffer (0.095 off at P=1; seed 1016)
    {"feature": "subclass_step", "issue": "item 1", "ranks": 1, "source": "seed 1016",
     "program": {"net": _net("transformer", "subclass_buffer", seed=1047),
                 "actions": [["forward", {"mode": "no_grad", "x": 105}]]}},
    # item 2: a counting forward hook on every step, 2 levels: never fires on 1-2 ranks, 3-5
    # times per layer on the last ranks of 3 (serial: once per layer; seed 506, 2 actions)
    *[{"feature": "hooks_multilevel", "issue": "item 2", "ranks": k, "source": "seed 506",
       "program": {"net": _net(seed=8600), "actions": [
           ["hook_add", {"kind": "count"}], ["forward", {"mode": "inference", "x": 25}]]}}
      for k in (1, 2, 3)],
    # item 3: parameters loaded with assign=True (2.2e-2 off; seed 505) / replaced (8e-3 off)
    *[{"feature": "load_assign", "issue": "item 3", "ranks": k, "source": "seed 505",
       "program": {"net": _net(seed=7705), "actions": [
           ["load_assign", {"scale": 1.1}], ["forward", {"mode": "no_grad", "x": 20}]]}}
      for k in (1, 2)],
    # ... and the new parameters get no gradient (P=3; seed 517)
    {"feature": "load_assign", "issue": "item 3", "ranks": 3, "source": "seed 517",
     "program": {"net": _net(seed=2832), "actions": [
         ["load_assign", {"scale": 1.1}], ["accumulate", {"chunks": 3, "w": 959, "x": 8}]]}},
    {"feature": "replace_param", "issue": "item 3", "ranks": 1, "source": "hand-reduced",
     "program": {"net": _net(seed=1), "actions": [["replace_param", {"p": 3}], FWD, BWD]}},
    # item 4: frozen when the buckets are built (new optimizer), unfrozen, then trained (P=2,
    # 2 replicas): the parameter is not averaged (0.36 off)
    {"feature": "unfreeze_dp", "issue": "item 4", "ranks": 2, "source": "hand-reduced",
     "program": {"net": _net(seed=3, dp=2), "actions": [
         ["freeze", {"p": 0, "on": False}],
         ["opt_new", {"kind": "sgd", "lr": 0.1, "momentum": 0.0, "wd": 0.0}],
         ["freeze", {"p": 0, "on": True}], FWD, BWD]}},
    # item 5: a NaN vector-Jacobian product in a middle layer, norm="inf": the adjoint solve
    # reports converged=True with NaN gradients on 2 and 3 ranks (norm="l2" raises everywhere)
    *[{"feature": "nan", "issue": "item 5", "ranks": k, "source": "hand-reduced",
       "program": {"net": _net(step="user", seed=2862, norm="inf"),
                   "actions": [["nan_backward", {"x": 52}]]}} for k in (2, 3)],
    # item 8: compiled steps: parameter keys carry _orig_mod. (no serial key matches)
    {"feature": "compile", "issue": "item 8", "ranks": 1, "source": "seed 25",
     "program": {"net": _net(levels=1, compiled=True), "actions": [["train", {"on": True}]]}},
    # item 10: clip_grad_norm_ on every rank clips by the local norm (P=3; seed 303)
    {"feature": "clip", "issue": "item 10", "ranks": 3, "source": "seed 303",
     "program": {"net": _net(levels=1, seed=4238), "actions": [
         ["forward", {"mode": "grad", "x": 262}],
         ["backward", {"all": False, "i": 3, "retain": False, "w": 296}],
         ["clip", {"max_norm": 0.05}]]}},
    # new (fuzzer): a parameter frozen between forward and autograd.grad: the owning rank alone
    # raises "One of the differentiated Tensors does not require grad" (P=3; seed 1001)
    {"feature": "freeze_pending", "issue": "design (requires_grad at backward)", "ranks": 3,
     "source": "seed 1001",
     "program": {"net": _net(seed=6135), "actions": [
         ["forward", {"mode": "grad", "x": 577}], ["freeze", {"on": False, "p": 9}],
         ["autograd_grad", {"i": 3, "retain": False, "w": 91}]]}},
    # new (campaign on the merged code): torch.compile'd steps, 2 levels: the adjoint reused
    # each layer's graph (retain_graph) and inductor's backward with donated buffers refused it
    # on some ranks; with the abort guard off (the harness) the others waited: a hang (P=3;
    # seed 400009, shrunk by hand). Campaign only (compile), like every compile program.
    {"feature": "compile", "issue": "item 8 (compiled steps in the adjoint)", "ranks": 3,
     "source": "seed 400009",
     "program": {"net": _net("multiseg", "user", seed=8831, norm="inf", compiled=True),
                 "actions": [["forward", {"x": 119, "mode": "grad"}],
                             ["backward", {"i": 2, "w": 869, "retain": False, "all": False}]]}},
    # new (campaign, session 7): torch.compile'd conv steps on the one-level path and
    # backward(retain_graph=True): inductor's donated-buffer backward raised on the last rank
    # only, after the backward agreement, while the other ranks waited for its gradient: a hang
    # (P=3; seed 500247, shrunk by hand). Now refused on every rank before any message.
    {"feature": "compile", "issue": "item 8 (compiled steps, one-level path)", "ranks": 3,
     "source": "seed 500247",
     "program": {"net": _net("conv", "subclass_buffer", layers=6, levels=1, seed=1099,
                             norm="inf", compiled=True),
                 "actions": [["forward", {"x": 929, "mode": "grad"}],
                             ["backward", {"i": 0, "w": 983, "retain": True, "all": False}]]}},
    # new (campaign, session 7): a module hook registered between a multilevel forward and
    # its backward fired in the adjoint's layer recomputations (serial autograd never calls a
    # layer in a backward: 0 calls); P = 1, 2, 3 alike (seed 600387, shrunk by the fuzzer).
    {"feature": None, "issue": "item 2 (hooks)", "ranks": 3, "source": "seed 600387",
     "program": {"net": _net("dense", "shipped", seed=8177),
                 "actions": [["forward", {"mode": "grad", "x": 510}], ["hook_add", {"kind": "count"}],
                             ["backward", {"all": False, "i": 0, "retain": True, "w": 218}]]}},
    {"feature": None, "issue": "item 2 (hooks)", "ranks": 1, "source": "seed 600387",
     "program": {"net": _net("dense", "user", seed=8177),
                 "actions": [["forward", {"mode": "grad", "x": 510}], ["hook_add", {"kind": "count"}],
                             ["backward", {"all": False, "i": 0, "retain": True, "w": 218}]]}},
    # the same with a hook that changes outputs: the recomputed layers were scaled, so the
    # gradients were wrong (hand-reduced from seed 600387)
    {"feature": None, "issue": "item 2 (hooks)", "ranks": 2, "source": "hand-reduced",
     "program": {"net": _net("dense", "user", seed=8177),
                 "actions": [["forward", {"mode": "grad", "x": 510}], ["hook_add", {"kind": "scale"}],
                             ["backward", {"all": False, "i": 0, "retain": False, "w": 218}]]}},
    # issue 36 (transforms; tests/fuzz/paths_autograd.py). A functional_call between a
    # multilevel forward and its backward rebuilt the fast paths twice: the backward was refused
    # as "step modules changed" although they were back (seed 315 of the transform campaign,
    # hand-reduced; P = 1 and 2 alike)
    *[{"feature": "functional_call", "issue": "36 item 11", "ranks": k, "source": "seed 315",
       "program": {"net": _net("multiseg", "buffer", layers=5, seed=9570), "actions": [
           ["forward", {"mode": "grad", "x": 80}],
           ["functional_call", {"scale": 1.2, "shift": 0.01, "w": 147, "x": 257}],
           ["backward", {"all": False, "i": 0, "retain": False, "w": 841}]]}} for k in (1, 2)],
    # the fuzzer's own: serial's hook calls of a refused transform were compared (Hypothesis),
    # and a vjp ran the layer-parallel forward twice (seed 111)
    {"feature": "forward_ad", "issue": "36 item 7", "ranks": 1, "source": "hypothesis",
     "program": {"net": _net(levels=1), "actions": [
         ["hook_add", {"kind": "count"}], ["forward", {"mode": "grad", "x": 0}],
         ["forward_ad", {"x": 0}], ["func_transform", {"x": 0, "which": "vmap"}]]}},
    {"feature": "input_grad", "issue": "36 item 8", "ranks": 2, "source": "seed 111",
     "program": {"net": _net("conv", "user", layers=5, levels=1, seed=2779), "actions": [
         ["hook_add", {"kind": "count"}], ["input_grad", {"how": "vjp", "w": 462, "x": 582}]]}},
    # ParallelGRU raised PyTorch's NotImplementedError (forward AD of its autograd.Function)
    # on some ranks only (seed 6 of the transform campaign; now one agreed ValueError)
    {"feature": "forward_ad", "issue": "36 item 7", "ranks": 2, "source": "seed 6",
     "program": {"net": _net("gru", levels=2), "actions": [
         ["forward_ad", {"x": 0}], ["forward", {"mode": "grad", "x": 1}], BWD]}},
]
