"""MG/Opt driver (mgrit.multilevel.mgopt), serial, float64, on 200 Peaks points.

References: the first-order coherence ``grad F_H(R x) = P^T grad f_h(x)`` against P^T written
out by hand from plain autograd gradients (sum of the two fine layers of each coarse layer),
1e-12 relative; with the correction off, the plain ``torch.optim`` loop, bitwise (SGD with
momentum, Adam, L-BFGS); MG/Opt lowers the loss below the plain optimizer's at the same number
of fine gradient evaluations; the safeguard rejects an ascent correction. The multi-rank checks
(layer- and data-parallel) live in tests/multilevel/test_multilevel_mpi.py.
"""
import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from data import load_dataset
from mgrit.nn import DenseStep, serial_resnet
from mgrit.nn.depth import restrict
from mgrit.multilevel.mgopt import MGOpt, MGOptOptions

DT = torch.float64
W, N = 4, 8
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peaks():
    train, _ = load_dataset("peaks", seed=0)
    return torch.as_tensor(train.x[:200], dtype=DT), torch.as_tensor(train.y[:200])


def _net(n=N, seed=0):
    torch.manual_seed(seed + 100)
    opening, closing = nn.Linear(2, W).to(DT), nn.Linear(W, 5).to(DT)
    steps = serial_resnet(lambda k: DenseStep(W, "tanh").to(DT), n, 1.0, seed)
    return nn.Sequential(opening, *steps, closing)


def _closure(x, y):
    def closure(model, backward):
        loss = F.cross_entropy(model(x), y)
        if backward:
            loss.backward()
        return loss.item()
    return closure


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("prolong,restr", [("constant", "average"), ("constant", "injection"),
                                           ("linear", "injection")])
def test_first_order_coherence(peaks, prolong, restr):
    x, y = peaks
    fine = _net()
    mg = MGOpt.from_fine(fine, 2, lambda ps, l: torch.optim.SGD(ps, lr=0.1),
                         MGOptOptions(prolong=prolong, restrict=restr))
    close = _closure(x, y)
    mg.evaluate(0, close)
    g = mg._grads(0)
    v = mg.coarse_shift(0, close, g, reuse=False)
    mg.evaluate(1, close, shift=v)  # a fresh coarse forward/backward at R x, shifted by v
    coarse_grad = [p.grad for p in mg.params[1]]
    # reference P^T g by hand from plain autograd on a copy of the fine network
    ref_net = copy.deepcopy(fine)
    F.cross_entropy(ref_net(x), y).backward()
    fg = [m.F.linear for m in ref_net[1:-1]]
    ref_layers = []
    for j in range(N // 2):
        if prolong == "constant":
            terms = [(2 * j, 1.0), (2 * j + 1, 1.0)]
        else:  # linear: fine 2j <- (j, 1); fine 2j+1 <- (j, 1/2), (j+1, 1/2), last: (j, 1)
            terms = [(2 * j, 1.0)] + ([(2 * j + 1, 0.5)] if j < N // 2 - 1 else [(2 * j + 1, 1.0)])
            terms += [(2 * j - 1, 0.5)] if j > 0 else []
        ref_layers.append([sum(w * getattr(fg[k], n).grad for k, w in terms)
                           for n in ("weight", "bias")])
    ref = [ref_net[0].weight.grad, ref_net[0].bias.grad]
    ref += [t for layer in ref_layers for t in layer]
    ref += [ref_net[-1].weight.grad, ref_net[-1].bias.grad]
    assert len(ref) == len(coarse_grad)
    worst = max(_rel(a, b) for a, b in zip(coarse_grad, ref))
    assert worst <= 1e-12, worst
    assert max(_rel(a, b) for a, b in zip(mg.Rg[0](g), ref)) <= 1e-13
    assert mg.gradients == [1, 2] and mg.values == [0, 0]


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "lbfgs": lambda ps: torch.optim.LBFGS(ps, lr=1.0, max_iter=3, history_size=4),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_no_correction_is_the_inner_optimizer_bitwise(peaks, name):
    x, y = peaks
    make = OPTIMIZERS[name]
    a, b = _net(), _net()
    mg = MGOpt([a, restrict(a)], lambda ps, l: make(ps),
               MGOptOptions(correction=False, pre_smooth=2, post_smooth=1))
    for _ in range(3):
        mg.step(_closure(x, y))
    opt = make(list(b.parameters()))

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(b(x), y)
        loss.backward()
        return loss

    for _ in range(9):
        opt.step(closure)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert mg.gradients[1] == 0 and mg.values == [0, 0]
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), _net().parameters()))


def _loss(model, x, y):
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


@pytest.mark.slow
@pytest.mark.parametrize("levels", [2, 3])
def test_mgopt_decreases_loss_beyond_sgd(peaks, levels):
    x, y = peaks
    lr, cycles = 0.5, 12
    fine = _net(16)
    mg = MGOpt.from_fine(fine, levels, lambda ps, l: torch.optim.SGD(ps, lr=lr))
    first = _loss(fine, x, y)
    losses = [mg.step(_closure(x, y)).loss for _ in range(cycles)]
    final = _loss(fine, x, y)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    # plain SGD with the same number of fine gradient evaluations
    plain = _net(16)
    opt = torch.optim.SGD(plain.parameters(), lr=lr)
    for _ in range(mg.fine_gradient_evaluations):
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt.step()
    sgd = _loss(plain, x, y)
    print(f"{levels} levels: loss {first:.4f} -> MG/Opt {final:.4f} ({mg.fine_gradient_evaluations}"
          f" fine gradients, work {mg.work:.1f}) vs SGD {sgd:.4f}")
    assert final < 0.8 * first and final < sgd


def test_line_search_rejects_ascent(peaks):
    x, y = peaks
    fine = _net()
    # the coarse "smoother" ascends: the prolonged correction is not a descent direction
    mg = MGOpt.from_fine(fine, 2, lambda ps, l: torch.optim.SGD(ps, lr=0.1, maximize=l > 0),
                         MGOptOptions(pre_smooth=0, post_smooth=0))
    before = [p.detach().clone() for p in fine.parameters()]
    rec = mg.step(_closure(x, y))
    assert rec.slopes[0] > 0 and rec.alphas == [0.0]
    assert all(torch.equal(p, q) for p, q in zip(fine.parameters(), before))
    # without the line search the full correction is applied and the loss goes up
    mg2 = MGOpt.from_fine(_net(), 2, lambda ps, l: torch.optim.SGD(ps, lr=0.1, maximize=l > 0),
                          MGOptOptions(pre_smooth=0, post_smooth=0, line_search=False))
    rec2 = mg2.step(_closure(x, y))
    assert rec2.alphas == [1.0] and _loss(mg2.models[0], x, y) > rec2.loss


def test_lbfgs_smoother_with_correction(peaks):
    x, y = peaks
    fine = _net()
    mg = MGOpt.from_fine(fine, 2, lambda ps, l: torch.optim.LBFGS(ps, lr=1, max_iter=4),
                         MGOptOptions(prolong="linear"))
    recs = [mg.step(_closure(x, y)) for _ in range(3)]
    assert recs[-1].loss < recs[0].loss and mg.gradients[0] > 3 * 4
    assert _loss(fine, x, y) < recs[-1].loss


def test_options_errors():
    with pytest.raises(ValueError, match="pre_smooth=-1 is not allowed"):
        MGOptOptions(pre_smooth=-1)
    with pytest.raises(ValueError, match="coarse_steps=0 is not allowed"):
        MGOptOptions(coarse_steps=0)
    with pytest.raises(ValueError, match="prolong='cubic' is not allowed"):
        MGOptOptions(prolong="cubic")
    with pytest.raises(ValueError, match="restrict='constant' is not allowed"):
        MGOptOptions(restrict="constant")
    with pytest.raises(ValueError, match="c1=1.5 is not allowed"):
        MGOptOptions(c1=1.5)
    with pytest.raises(ValueError, match="alpha0=0 is not allowed"):
        MGOptOptions(alpha0=0)
    with pytest.raises(ValueError, match="models=\\[\\] is not allowed"):
        MGOpt([], lambda ps, l: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="must be a multiple"):
        MGOpt([_net(8), _net(3)], lambda ps, l: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="must return a torch.optim.Optimizer"):
        MGOpt([_net(8)], lambda ps, l: None)
    with pytest.raises(ValueError, match="models\\[1\\] is a str"):
        MGOpt([_net(8), "coarse"], lambda ps, l: torch.optim.SGD(ps, lr=0.1))
    mg = MGOpt([_net(8)], lambda ps, l: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="the closure returned NoneType"):
        mg.step(lambda model, backward: None)


@pytest.mark.slow
def test_study_multilevel_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("study_multilevel",
                                                  ROOT / "experiments" / "studies" / "study_multilevel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--smoke", "--out", str(tmp_path)])
    d = tmp_path / "multilevel"
    for f in ["results.h5", "table.md", "init_accuracy_vs_time.png", "mgopt_peaks_loss_vs_work.png",
              "mgopt_mnist5k_loss_vs_work.png"]:
        assert (d / f).is_file() and (d / f).stat().st_size > 0, f
    table = (d / "table.md").read_text()
    assert "- commit:" in table and "time to accuracy" in table and "MG/Opt" in table
