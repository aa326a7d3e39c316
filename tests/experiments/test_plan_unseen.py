"""``experiments/benchmarks/plan_unseen.py`` (issue 24, item 4): the seeded draw of unseen
networks, the regret bookkeeping against hand-computed values, the compiled baseline's
gradients against ``nn.Sequential`` autograd (float64), and its smoke run through
``experiments/regenerate.py --quick`` (slow: MPI), whose regrets are recomputed from the raw
per-repeat numbers it wrote."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "benchmarks"))
import plan  # noqa: E402
import plan_unseen as pu  # noqa: E402
from compiled_resnet import CompiledResNet  # noqa: E402
from mgrit.perf.planner import Option  # noqa: E402


def test_draw_is_seeded_bounded_and_excludes_the_design_networks():
    nets = pu.draw(12)
    assert nets == pu.draw(12) and nets != pu.draw(12, seed=pu.SEED + 1)
    assert len(set(nets)) == 12
    for N, w, b in nets:
        assert pu.DEPTH[0] <= N <= pu.DEPTH[1] and w in pu.WIDTHS and b in pu.BATCHES
        assert N * w * w * b <= pu.MAX_WORK
    assert pu.DESIGN == {(4096, 8, 64), (32, 32, 50), (8, 1024, 128)}
    assert not set(nets) & pu.DESIGN
    # an excluded network is never drawn (the rejection works, not luck)
    assert nets[0] not in pu.draw(12, exclude=pu.DESIGN | {nets[0]})
    tiny = pu.draw(2, **pu.SMOKE)
    assert all(16 <= N <= 24 and N * w * w * b <= pu.SMOKE["max_work"] for N, w, b in tiny)
    with pytest.raises(ValueError, match="only"):
        pu.draw(3, depth=(16, 16), widths=(4,), batches=(16,))  # one network exists


def test_regret_bookkeeping_against_hand_computed_values():
    T = {"a": [1.0, 2.0, 4.0], "b": [1.5, 1.5, 1.5], "c": [3.0, 3.0, 9.0]}
    r = pu.regret(T, "c")  # medians 2, 1.5, 3; per-round c / b = 2, 2, 6
    assert r["fastest"] == "b" and r["regret"] == pytest.approx(2.0)
    assert (r["ratio_q1"], r["ratio_q3"]) == pytest.approx((2.0, 4.0))
    r = pu.regret(T, "c", among=["a", "c"])  # c / a per round: 3, 1.5, 2.25
    assert r["fastest"] == "a" and r["regret"] == pytest.approx(1.5)
    assert (r["ratio_q1"], r["ratio_q3"]) == pytest.approx((1.875, 2.625))
    assert pu.regret(T, "b")["regret"] == 1.0
    with pytest.raises(KeyError):
        pu.regret(T, "d")
    d = pu.distribution([1.0, 1.04, 1.05, 1.2])
    assert d["within_1_05"] == 3 and d["median"] == pytest.approx(1.045)
    assert (d["q1"], d["q3"], d["max"]) == pytest.approx((1.03, 1.0875, 1.2))


def test_option_keys_and_mgrit_settings():
    mg = Option("MGRIT", 2, 1, 0.1, {"config": "m=8, L=3, FCF", "K_f": 1, "K_b": 2})
    assert pu.option_key(mg) == "MGRIT m=8, L=3, FCF K_f 1 K_b 2"
    assert plan.mgrit_spec(mg) == dict(cfactor=8, levels=3, relax="FCF", K_f=1, K_b=2)
    assert pu.option_key(Option("GPipe", 2, 1, 0.1, {"M": 4})) == "GPipe M=4"
    assert pu.option_key(Option("data parallel", 1, 2, 0.1)) == "data parallel"


def test_lean_step_matches_the_autograd_serial_step():
    """The planner's lean options (issue 34 item 6) as measured: three momentum-SGD steps of
    the lean step (residual layers on the lean loop, head / tail in autograd) leave the same
    weights as three of the autograd ``nn.Sequential`` step (float32 round-off)."""
    from mpi4py import MPI
    from mgrit.models import build_model
    s = dict(layers=6, width=8, batch=16)
    x, y = plan.batch(16)
    serial = build_model("resnet", plan.config(6, 8, 16), (784,), 10)
    opt = torch.optim.SGD(serial.parameters(), 0.01, momentum=0.9)
    step = plan.lean_step_fn(MPI.COMM_SELF, 0, s, x, y, False)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(serial(x), y).backward()
        opt.step()
        step()
    cells = {type(c.cell_contents).__name__: c.cell_contents for c in step.__closure__}
    lean, head, tail = cells["LeanResNet"], *(c.cell_contents for c in step.__closure__
                                              if isinstance(c.cell_contents, torch.nn.Module))
    mods = list(serial)
    W = torch.stack([m.F.linear.weight for m in mods[1:-1]]).detach()
    b = torch.stack([m.F.linear.bias for m in mods[1:-1]]).detach()
    torch.testing.assert_close(lean.WT.transpose(1, 2), W, rtol=0, atol=1e-6)
    torch.testing.assert_close(lean.b, b, rtol=0, atol=1e-6)
    moved = (W - torch.stack([m.F.linear.weight for m in list(build_model(
        "resnet", plan.config(6, 8, 16), (784,), 10))[1:-1]]).detach()).abs().max()
    assert moved > 1e-4  # the steps changed the weights: the comparison is not vacuous
    for a, r in ((head, mods[0]), (tail, mods[-1])):
        for p, q in zip(a.parameters(), r.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_compiled_resnet_matches_sequential_autograd():
    torch.manual_seed(0)
    seq = plan.build_model("resnet", plan.config(7, 5, 6), (784,), 10).double()
    net = CompiledResNet(seq, block=3, backend="eager")  # blocks 3, 3 and a remainder of 1
    x, y = torch.randn(6, 784, dtype=torch.float64), torch.randint(0, 10, (6,))
    ce = torch.nn.functional.cross_entropy
    ref, out = ce(seq(x), y), ce(net(x), y)
    ref.backward()
    out.backward()
    assert out.item() == pytest.approx(ref.item(), rel=1e-12)
    steps = list(seq)[1:-1]
    gW = torch.stack([s.F.linear.weight.grad.t() for s in steps])
    gb = torch.stack([s.F.linear.bias.grad for s in steps])
    torch.testing.assert_close(net.WT.grad, gW, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(net.b.grad, gb, rtol=1e-10, atol=1e-12)
    for a, b in zip((*net.opening.parameters(), *net.closing.parameters()),
                    (*seq[0].parameters(), *seq[-1].parameters())):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="block"):
        CompiledResNet(seq, block=0)
    with pytest.raises(ValueError, match="ResidualStep"):
        CompiledResNet(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 4),
                                           torch.nn.Linear(4, 10)))


QUICK = ["plan_unseen"]  # run by the session's one quick run (tests/experiments/conftest.py)


@pytest.mark.slow  # two MPI launches
def test_smoke_run_through_regenerate(quick):
    from tests.experiments.regenerate_quick import assert_every_script_ok
    assert_every_script_ok(quick, QUICK)
    d = quick[0] / "benchmarks"
    md = (d / "plan_unseen.md").read_text()
    raw = json.loads((d / "plan_unseen.raw.json").read_text())
    head = json.loads((d / "plan_unseen.headline.json").read_text())
    assert "- commit:" in md and "hash-object" in md and head["rows"][0]["ours"]
    # every regret in the table is the one recomputed from the raw per-repeat numbers
    rows = re.findall(r"^\| (\d+) \| (\d+ x \d+ x \d+) \| (\d+) \| (.+?) \| (.+?) \| ([\d.]+) \(", md, re.M)
    assert len(rows) == 2 * 2, md[:3000]  # 2 networks x 2 calibrations
    for i, net, _, rec, fastest, reg in rows:
        T = {k.split(" / ", 1)[1]: v["values"] for k, v in raw["series"].items()
             if k.startswith(f"net {i} ({net}) / ")}
        assert len(T) >= 5 and all(len(v) == 2 for v in T.values())
        assert fastest == min(T, key=lambda k: sorted(T[k])[0] + sorted(T[k])[1])
        assert math.isclose(pu.regret(T, rec)["regret"], float(reg), abs_tol=0.006)
