"""Ctrl-C (issue 40 item 6): a checkpoint write cut by the user says so and leaves the previous
file intact (torch's writer turned the interrupt into ``RuntimeError ... unexpected pos``, which
read as a disk failure); with the job's handler (:mod:`mgrit.training.support.interrupts`) a
SIGINT waits for the next step boundary, so no write is ever cut and every rank stops at the
same step. One process; the launched job is in ``tests/job/test_train_job.py``."""
from __future__ import annotations

import signal

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mgrit.training.checkpoint.io as io
from mgrit.training import Trainer
from mgrit.training.checkpoint import save_checkpoint
from mgrit.training.checkpoint.io import FORMAT, read_file, write_atomic
from mgrit.training.support import interrupts


class _Cut:
    """A file whose ``write`` runs ``action`` once, after ``after`` bytes (torch's zip writer
    calls it from C++, where a signal's KeyboardInterrupt would surface)."""

    def __init__(self, fh, after, action):
        self.fh, self.n, self.after, self.action = fh, 0, after, action

    def write(self, b):
        self.n += len(b)
        if self.n > self.after:
            self.after = float("inf")
            self.action()
        return self.fh.write(b)

    def flush(self):
        self.fh.flush()


def _sigint():
    signal.raise_signal(signal.SIGINT)


def _raise():
    raise KeyboardInterrupt


@pytest.fixture
def cut(monkeypatch):
    """``cut(action, nth)``: the ``nth`` (1-based) checkpoint write runs ``action`` midway."""
    def arm(action, nth=1):
        count = [0]
        orig = io._dump

        def dump(obj, fh):
            count[0] += 1
            orig(obj, _Cut(fh, 2000, action) if count[0] == nth else fh)
        monkeypatch.setattr(io, "_dump", dump)
    yield arm
    interrupts.uninstall()


def test_a_cut_checkpoint_write_says_so_and_keeps_the_previous_file(tmp_path, cut):
    path = str(tmp_path / "c.pt")
    first = {"format": FORMAT, "w": torch.arange(5000, dtype=torch.float64), "epoch": 1}
    write_atomic(path, first)
    cut(_raise)
    with pytest.raises(KeyboardInterrupt, match=r"checkpoint write to .*c\.pt was interrupted "
                       r"\(Ctrl-C\); .* is unchanged \(the previous checkpoint, if any, is "
                       r"intact\)"):
        write_atomic(path, {**first, "epoch": 2, "w": torch.zeros(5000, dtype=torch.float64)})
    got, err = read_file(path)
    assert err is None and got["epoch"] == 1 and torch.equal(got["w"], first["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]  # no PATH.tmp left
    # the collective save: every rank gets the interrupt, not a CheckpointError with disk advice
    net = nn.Linear(40, 40).double()
    save_checkpoint(tmp_path / "n.pt", net, None)
    before = net.weight.detach().clone()
    with torch.no_grad():
        net.weight.add_(1.0)
    cut(_raise)
    with pytest.raises(KeyboardInterrupt, match="was interrupted"):
        save_checkpoint(tmp_path / "n.pt", net, None)
    got, err = read_file(str(tmp_path / "n.pt"))
    assert err is None and torch.equal(next(iter(got["model"].values())), before)


def test_deferral_zones(cut):
    comm = MPI.COMM_SELF
    assert interrupts.install() and interrupts.installed()
    with pytest.raises(KeyboardInterrupt):  # outside a zone: at once, as Python's default
        _sigint()
    with pytest.raises(KeyboardInterrupt):  # leaving the outermost zone acts on it
        with interrupts.deferred(comm):
            with interrupts.deferred(comm):
                _sigint()
                assert interrupts.pending()
            assert interrupts.pending()  # an inner zone does not check
    assert not interrupts.pending()
    with interrupts.deferred(comm):
        _sigint()
        with pytest.raises(KeyboardInterrupt):  # a second one while pending: at once
            _sigint()
        interrupts.check(comm)  # nothing pending any more
    interrupts.uninstall()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    interrupts.check(comm)  # not installed: nothing, no communication
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred(comm):
            _sigint()  # the default handler: at once


def test_sigterm_is_deferred_alike_and_raises_terminated(cut):
    """SIGTERM (a scheduler's time limit) waits for the zone's end like SIGINT and raises
    ``Terminated`` (a KeyboardInterrupt); SIGTERM wins over a SIGINT; uninstall restores the previous SIGTERM handler."""
    comm = MPI.COMM_SELF
    before = signal.getsignal(signal.SIGTERM)
    assert interrupts.install()
    with pytest.raises(interrupts.Terminated, match="SIGTERM"):
        with interrupts.deferred(comm):
            signal.raise_signal(signal.SIGTERM)
            assert interrupts.pending()
    with pytest.raises(KeyboardInterrupt) as got:  # a plain SIGINT stays a plain one
        with interrupts.deferred(comm):
            _sigint()
    assert not isinstance(got.value, interrupts.Terminated)
    with pytest.raises(interrupts.Terminated):  # check() agrees on the larger signal number
        with interrupts.deferred(comm):
            _sigint()
            interrupts._state["signal"] = int(signal.SIGTERM)  # as if another rank's SIGTERM
    interrupts.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def _fit(tmp_path, callbacks=()):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(30, 30), nn.Tanh(), nn.Linear(30, 3)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, 30, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (60,), generator=g)
    tr = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), callbacks=list(callbacks),
                 checkpoint=tmp_path / "c.pt", checkpoint_every=1)
    return tr, lambda **kw: tr.fit((x, y), epochs=2, batch_size=10, seed=0, **kw)


def test_fit_stops_at_a_step_boundary_never_inside_a_checkpoint_write(tmp_path, cut):
    """A SIGINT midway through the 4th step's checkpoint write: the write completes, the fit
    stops right after it (a valid checkpoint of that step), and resuming from it reproduces
    the uninterrupted run."""
    ref_tr, ref_fit = _fit(tmp_path / "ref")
    ref = ref_fit().history
    interrupts.install()
    cut(_sigint, nth=4)
    tr, fit = _fit(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        fit()
    assert tr.steps_done == 4 and tr.saved_at == (0, 4) and tr.position == (0, 3)
    got, err = read_file(str(tmp_path / "c.pt"))
    assert err is None and got["extra"]["position"] == [0, 4]
    interrupts.uninstall()
    tr2, fit2 = _fit(tmp_path)
    hist = fit2(resume=tmp_path / "c.pt").history
    assert hist["loss"] == ref["loss"] and hist["test_acc"] == ref["test_acc"]
    assert all(torch.equal(a, b) for a, b in zip(tr2.net.parameters(), ref_tr.net.parameters()))
