"""What a resume may change, in one process (issue 40 items 1, 2, 4, 7, 9):

* a resume with other optimizer settings (``lr``, ``momentum``) trains with them: its weights
  equal a plain PyTorch loop that switches the settings after epoch 2, bit for bit;
* extending a cosine run (``fit(epochs=4, resume=<epoch 2>)``) re-plans the schedule over the
  new horizon: the rates of steps 16..31 are the closed-form cosine over 32 steps (never
  rising), and the weights equal a plain loop with those rates;
* callback states are keyed by name: a resume with other callbacks around the metrics writer
  keeps every step of ``steps.csv``; a state that no callback takes is named in the notes;
* a resume with nothing left to train is said (``epochs`` equal) or refused (fewer); a
  weights-only file and a layer-wise/network mismatch are refused with the real reason.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mgrit.training import LRSchedule, MetricsWriter, Trainer
from mgrit.training.callbacks import restore_states, state_keys
from mgrit.training.checkpoint import save_checkpoint
from mgrit.training.checkpoint.io import read_file, write_atomic
from mgrit.training.checkpoint.match import mismatches

N, BATCH, SEED = 32, 8, 2  # 4 batches per epoch


def _data():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (N,), generator=g))


def _net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _plain(epochs, settings, rate=None):
    """Plain PyTorch SGD loop over the Trainer's batches (``np.random.default_rng([seed,
    epoch])`` permutations); ``settings(epoch) -> (lr, momentum)``; ``rate(step)``: the step's
    rate instead of ``lr`` (a schedule in closed form)."""
    x, y = _data()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    t = 0
    for epoch in range(epochs):
        lr, mom = settings(epoch)
        for g in opt.param_groups:
            g["momentum"] = mom
        perm = np.random.default_rng([SEED, epoch]).permutation(N)
        for s in range(0, N, BATCH):
            for g in opt.param_groups:
                g["lr"] = lr if rate is None else rate(t)
            j = torch.as_tensor(perm[s:s + BATCH])
            opt.zero_grad()
            F.cross_entropy(net(x[j]), y[j]).backward()
            opt.step()
            t += 1
    return net


def _fit(path, epochs, *, lr=0.01, momentum=0.9, callbacks=(), resume=None):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    tr = Trainer(net, opt, callbacks=list(callbacks), checkpoint=path)
    res = tr.fit(_data(), epochs=epochs, batch_size=BATCH, seed=SEED, resume=resume)
    return net, tr, res


def _equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_resume_trains_with_the_changed_optimizer_settings(tmp_path):
    _fit(tmp_path / "c.pt", 2)
    net, tr, res = _fit(tmp_path / "r.pt", 3, lr=0.1, momentum=0.5, resume=tmp_path / "c.pt")
    want = _plain(3, lambda e: (0.01, 0.9) if e < 2 else (0.1, 0.5))
    ignored = _plain(3, lambda e: (0.01, 0.9))
    assert _equal(net, want) and not _equal(net, ignored)
    assert tr.optimizer.param_groups[0]["lr"] == 0.1
    assert tr.optimizer.param_groups[0]["momentum"] == 0.5
    assert any("lr 0.01 -> 0.1" in n and "momentum 0.9 -> 0.5" in n for n in res.plan.notes), \
        res.plan.notes
    # unchanged settings: nothing noted, the exact continuation
    net2, _, res2 = _fit(tmp_path / "s.pt", 3, resume=tmp_path / "c.pt")
    assert _equal(net2, ignored) and not res2.plan.notes


def _cosine(total, lr):
    return lambda t: lr * (1 + math.cos(math.pi * t / total)) / 2


@pytest.mark.parametrize("lr", [0.01, 0.1])
def test_extending_a_cosine_run_replans_it_over_the_new_horizon(tmp_path, lr):
    """2 cosine epochs (8 steps) resumed with epochs=4 (and lr 0.1: a new base rate): the
    rates of steps 8..15 are the cosine over 16 steps, decreasing to 0, not a restart."""
    s1 = LRSchedule("cosine")
    _fit(tmp_path / "c.pt", 2, callbacks=[s1])
    s2 = LRSchedule("cosine")
    net, tr, res = _fit(tmp_path / "r.pt", 4, lr=lr, callbacks=[s2], resume=tmp_path / "c.pt")
    assert s2.lrs[:8] == s1.lrs and len(s2.lrs) == 16
    new = _cosine(16, lr)
    assert s2.lrs[8:] == pytest.approx([new(t) for t in range(8, 16)], rel=1e-12, abs=1e-15)
    assert all(a >= b for a, b in zip(s2.lrs[8:], s2.lrs[9:])), s2.lrs
    old = _cosine(8, 0.01)
    want = _plain(4, lambda e: (lr, 0.9), rate=lambda t: old(t) if t < 8 else new(t))
    assert all(torch.allclose(p, q, rtol=0, atol=1e-13)
               for p, q in zip(net.parameters(), want.parameters()))
    assert any("re-planned" in n and "epochs 2 -> 4" in n for n in res.plan.notes), \
        res.plan.notes


def test_same_schedule_resume_is_exact(tmp_path):
    """Interrupted inside epoch 2 (checkpoint every 3 steps), resumed with the same
    settings: the rates equal the uninterrupted run's and nothing is re-planned."""
    full = LRSchedule("cosine", warmup_epochs=1)
    _fit(tmp_path / "a.pt", 3, callbacks=[full])

    class Stop(Exception):
        pass

    class StopAt:
        def on_step_end(self, trainer, rec):
            if trainer.steps_done == 7:
                raise Stop()

    net = _net()
    tr = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                 callbacks=[LRSchedule("cosine", warmup_epochs=1), StopAt()],
                 checkpoint=tmp_path / "b.pt", checkpoint_every=3)
    with pytest.raises(Stop):
        tr.fit(_data(), epochs=3, batch_size=BATCH, seed=SEED)
    again = LRSchedule("cosine", warmup_epochs=1)
    _, _, res = _fit(tmp_path / "b2.pt", 3, callbacks=[again], resume=tmp_path / "b.pt")
    assert again.lrs == full.lrs and not res.plan.notes


class Quiet:  # a stateless callback (like the progress bar)
    def on_step_end(self, trainer, rec):
        pass


def test_callback_state_survives_other_callbacks(tmp_path):
    """Epoch 1 with [Quiet, LRSchedule, MetricsWriter], resumed without Quiet: the writer's
    steps of epoch 1 are restored (steps.csv has all 8 steps), the schedule continues."""
    a = tmp_path / "a"
    a.mkdir()
    _fit(tmp_path / "c.pt", 1, callbacks=[Quiet(), LRSchedule("step"), MetricsWriter(a)])
    b = tmp_path / "b"
    b.mkdir()
    w = MetricsWriter(b)
    _, _, res = _fit(tmp_path / "r.pt", 2, callbacks=[LRSchedule("step"), w],
                     resume=tmp_path / "c.pt")
    assert w.steps["step"] == list(range(8)), w.steps["step"]
    rows = (b / "steps.csv").read_text().splitlines()
    assert len(rows) == 9 and rows[1].startswith("0,")
    assert not res.plan.notes and res.plan.resumed_from
    # resumed without the writer: its saved state is named, not silently dropped
    _, _, res = _fit(tmp_path / "q.pt", 2, resume=tmp_path / "c.pt")
    assert any("MetricsWriter" in n and "not restored" in n for n in res.plan.notes)


def test_writer_state_without_the_lr_series_loads(tmp_path):
    """A checkpoint from before the per-step ``lr`` series: its steps load, the rate is NaN
    for each of them, so the series stay aligned and new steps append their rate."""
    import math
    w = MetricsWriter(tmp_path)
    old = {"step": [0, 1], "epoch": [0.5, 1.0], "loss": [2.0, 1.5], "accuracy": [0.1, 0.2]}
    w.load_state_dict({"steps": old})
    assert w.steps["step"] == [0, 1] and all(math.isnan(v) for v in w.steps["lr"])
    assert {len(v) for v in w.steps.values()} == {2}


def test_callback_keys_are_names_and_old_keys_still_load():
    class S:
        def __init__(self):
            self.got = None

        def state_dict(self):
            return {}

        def load_state_dict(self, s):
            self.got = s

    class Named(S):
        state_key = "mine"

    cbs = [Quiet(), S(), S(), Named()]
    assert state_keys(cbs) == [None, "S", "S#2", "mine"]
    # a checkpoint of the positional keys ('{i}:{class}') of another callback list
    notes = restore_states(cbs, {"0:S": 1, "4:S": 2, "5:Gone": 3})
    assert (cbs[1].got, cbs[2].got, cbs[3].got) == (1, 2, None)
    assert notes == ["saved state of callback(s) Gone not restored: this run has no callback "
                     "with that key", "callback(s) mine start without saved state: the "
                     "checkpoint has none for them"]
    with pytest.raises(ValueError, match="state_key"):
        Trainer(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                callbacks=[type("Bad", (S,), {"state_key": "a#b"})()])


def test_resume_with_nothing_left_to_train_says_so_or_is_refused(tmp_path):
    """From the checkpoint at the end of epoch 2: epochs=1 is refused, epochs=2 trains nothing
    and says so (a warning and the resume notes); the weights are the checkpoint's."""
    net0, _, _ = _fit(tmp_path / "c.pt", 2)
    with pytest.raises(ValueError, match=r"end of epoch 2 \(step 8\), past fit\(epochs=1\)"):
        _fit(tmp_path / "r.pt", 1, resume=tmp_path / "c.pt")
    with pytest.warns(UserWarning, match=r"fit\(epochs=2, resume=.*\) trains nothing"):
        net, _, res = _fit(tmp_path / "r.pt", 2, resume=tmp_path / "c.pt")
    assert res.steps == 8 and _equal(net, net0)
    assert any(n.startswith("nothing left to train") for n in res.plan.notes)


def test_weights_only_file_is_not_a_checkpoint(tmp_path):
    net = _net()
    save_checkpoint(tmp_path / "model.pt", net, None)  # what a run's model.pt is
    with pytest.raises(ValueError, match="model.pt' is not a training checkpoint: it holds "
                                         "weights only") as e:
        _fit(tmp_path / "r.pt", 2, resume=tmp_path / "model.pt")
    assert "not recorded" not in str(e.value)


def test_layerwise_and_network_checkpoints_name_the_method():
    ckpt = {"extra": {"seed": 0}, "net": {"kind": "serial"}, "model": {},
            "optimizer": {"type": "SGD"}}
    head = {"net": {"kind": "serial"}, "expect": {"seed": 0}, "optimizer_type": "MethodOptimizer"}
    msg = mismatches(ckpt, head, [{"model": {}}])
    assert "written by one network trained with SGD (--method mgrit or serial), this run is " \
           "a layer-wise training method" in msg and "resume with SGD" not in msg
    ckpt["optimizer"]["type"], head["optimizer_type"] = "MethodOptimizer", "Adam"
    assert "written by a layer-wise training method" in mismatches(ckpt, head, [{"model": {}}])


def test_checkpoint_without_the_schedule_setting_is_replanned(tmp_path):
    """A checkpoint of an LRSchedule that did not save its setting (before issue 40): the
    extension is found from the saved scheduler (T_max) and re-planned as well."""
    s1 = LRSchedule("cosine")
    _fit(tmp_path / "c.pt", 2, callbacks=[s1])
    ckpt, error = read_file(str(tmp_path / "c.pt"))
    for r in ckpt["ranks"]:
        del r["extra"]["callbacks"]["LRSchedule"]["setting"]
    write_atomic(str(tmp_path / "old.pt"), ckpt)
    s2 = LRSchedule("cosine")
    _, _, res = _fit(tmp_path / "r.pt", 4, callbacks=[s2], resume=tmp_path / "old.pt")
    new = _cosine(16, 0.01)
    assert s2.lrs[8:] == pytest.approx([new(t) for t in range(8, 16)], rel=1e-12, abs=1e-15)
    assert any("epochs 2 -> 4" in n for n in res.plan.notes), res.plan.notes
