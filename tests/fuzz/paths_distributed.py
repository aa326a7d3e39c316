"""Paths one step off the Trainer's own (issue 36 item 15, torch_b's part): random programs,
each a *path* with random parameters, run on 1-3 ranks against serial PyTorch in float64
(relative ``1e-9``; ``1e-8`` for the GRU):

* ``protocol``: a user network on ``NetMixin`` around a LayerParallelNet (checkpoint keys,
  resume onto the continuous run and serial), a partial one with local keys or a wrapper
  with its own module on every rank (refused naming a key at P > 1), a plain wrapper
  (refused naming the protocol at P > 1);
* ``clip``: ``mgrit.parallel.clip_grad_norm_(net, max_norm, comm)`` as the README calls it
  (weight-tied groups spanning ranks, a ParallelGRU, a plain module around a net; 2-norm or
  inf-norm) against ``torch.nn.utils.clip_grad_norm_`` on the serial model;
* ``dropout``: ``nn.Dropout`` in the opening and/or closing, mgrit Dropout/DropPath in the
  steps or not, the same seed or per-rank seeds, several steps without reseeding;
* ``bn_eval``: BatchNorm with or without running statistics, every rank a data-parallel
  replica, ``Trainer.evaluate`` in random chunks against the one-process evaluation;
* ``ckpt_bn``: non-reentrant ``torch.utils.checkpoint`` around a net with BatchNorm in the
  steps (running statistics, ``num_batches_tracked``) against serial + checkpoint;
* ``thread``: the layer-parallel net trained from a worker thread (mpi4py's default thread
  level) against serial training;
* ``ptie``: parameter-level ties across ranks (``tie={"lin.weight": ...}``, item 14;
  :mod:`tests.fuzz.paths_ptie`).

A program is JSON ``{"path": name, ...parameters}``; the verdict ``{"status": "ok" | "fail",
"message"}`` is agreed over the ranks (an exception on some ranks only is a failure).
Commands: ``python -m tests.fuzz paths --programs 60 --ranks 1,2,3`` and
``python -m tests.fuzz replay --ranks 2 '{"path": ...}'``.
"""
from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
import time

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import (DenseStep, GRUSequenceClassifier, LayerParallelNet, LayerParallelResNet,
                      ResidualStep, serial_resnet)
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid, clip_grad_norm_
from mgrit.training import Trainer
from mgrit.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

from . import paths_ptie
from .program import RandomChooser, dumps

DT = torch.float64
TOL = 1e-9
PATHS = ("protocol", "clip", "dropout", "bn_eval", "ckpt_bn", "thread", "ptie")


def generate(c, only: str | None = None) -> dict:
    """One path program from chooser ``c`` (``int``, ``pick``, ``bool``); ``only``: of that
    path."""
    path = c.pick(PATHS) if only is None else only
    p = {"path": path, "seed": c.int(0, 9999), "layers": c.pick([3, 4, 5, 7]),
         "levels": c.pick([1, 2])}
    if path == "protocol":
        p.update(kind=c.pick(["full", "full", "partial", "plain", "head"]), steps=c.int(1, 3),
                 momentum=c.pick([0.0, 0.9]))
    elif path == "clip":
        p.update(net=c.pick(["tied", "untied", "gru", "plain_tied"]),
                 max_norm=c.pick([0.01, 0.1, 10.0]), norm=c.pick([2.0, "inf"]))
    elif path == "dropout":
        p.update(p_open=c.pick([0.0, 0.3]), p_close=c.pick([0.0, 0.2]),
                 steps_drop=c.bool(), per_rank=c.bool(), steps=c.int(1, 3))
    elif path == "bn_eval":
        p.update(n=c.int(8, 30), eval_bs=c.int(3, 12), track=c.bool(0.3))
    elif path == "ckpt_bn":
        p.update(momentum=c.pick([0.1, None]), steps=c.int(1, 3))
    elif path == "thread":
        p.update(steps=c.int(1, 3))
    elif path == "ptie":
        p.update(paths_ptie.generate(c, p))
    return p


def from_seed(seed: int, only: str | None = None) -> dict:
    return generate(RandomChooser(seed), only)


# -- helpers ---------------------------------------------------------------------------------
def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def _opts(levels):
    return MGRITOptions(max_levels=levels, cfactor=2, min_coarse=1, tol=1e-13, max_iter=80)


def _data(n, d_in, seed, classes=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=DT), torch.randint(0, classes, (n,), generator=g)


def _pair(comm, p, make=None, ends=None, width=3):
    """``(LayerParallelNet, serial Sequential)`` with the same weights."""
    make = make or (lambda k: DenseStep(width, "tanh").to(DT))
    ends = ends or (lambda: (nn.Linear(2, width).to(DT), nn.Linear(width, 3).to(DT)))
    torch.manual_seed(p["seed"])
    o, c = ends()
    ser = nn.Sequential(o, *serial_resnet(make, p["layers"], 1.0, seed=p["seed"]), c)
    torch.manual_seed(p["seed"])
    o, c = ends()
    seg = LayerParallelResNet.build(make, p["layers"], (width,), comm=comm, seed=p["seed"],
                                    forward=_opts(p["levels"]), backward=_opts(p["levels"]))
    return LayerParallelNet(o, seg, c), ser


def _compare(net, ser, what, tol=TOL, grads=True) -> None:
    ref = dict(ser.named_parameters(remove_duplicate=False))
    for key, q in net.named_global_parameters():
        e = _rel(q, ref[key])
        assert e <= tol, f"{what}: parameter {key} off by {e:.2e}"
        if grads and ref[key].grad is not None:
            assert q.grad is not None, f"{what}: {key} has no .grad"
            e = _rel(q.grad, ref[key].grad)
            assert e <= tol, f"{what}: {key}.grad off by {e:.2e}"
    sd = net.gather_state_dict()
    if sd is not None:
        for key, v in ser.state_dict().items():
            if key.endswith("num_batches_tracked"):
                assert int(sd[key]) == int(v), f"{what}: {key} {int(sd[key])} vs {int(v)}"
            else:
                e = _rel(sd[key], v)
                assert e <= tol, f"{what}: buffer/parameter {key} off by {e:.2e}"


def _raises(fn, exc_type, *words) -> None:
    try:
        fn()
    except exc_type as exc:
        for w in words:
            assert w in str(exc), f"the refusal does not name {w!r}: {exc}"
        return
    raise AssertionError(f"accepted where a {exc_type.__name__} naming {words} was expected")


# -- the paths -------------------------------------------------------------------------------
def path_protocol(p, comm):
    from tests.mpi_cases.nn.offpath_cases import LocalLayers, Plain, Wrapped
    grid = ProcessGrid(comm)
    d = comm.bcast(tempfile.mkdtemp(prefix="fuzz-paths-") if comm.rank == 0 else None)
    path = os.path.join(d, "ck.pt")
    if p["kind"] == "partial":
        net = LocalLayers(comm)
        if comm.size > 1:
            _raises(lambda: save_checkpoint(path, net, None, grid), CheckpointError,
                    "'layers.0.weight'", "several layer ranks")
        else:
            save_checkpoint(path, net, None, grid)
        return
    if p["kind"] == "head":  # the wrapper's own module on every rank, used on the last one
        lp, _ = _pair(comm, p)
        net = Wrapped(lp)
        net.head = nn.Linear(3, 3).to(DT)
        if comm.size > 1:
            _raises(lambda: save_checkpoint(path, net, None, grid), CheckpointError,
                    "'head.weight'", "several layer ranks")
        else:
            save_checkpoint(path, net, None, grid)
            keys = sorted(torch.load(path, weights_only=True)["model"])
            want = sorted(["head.weight", "head.bias"] + ["net." + k for k in
                                                          lp.gather_state_dict()])
            assert keys == want, f"checkpoint keys {keys}"
        return
    if p["kind"] == "plain":
        lp, _ = _pair(comm, p)
        if comm.size > 1:
            _raises(lambda: Trainer(Plain(lp), torch.optim.SGD(lp.parameters(), lr=0.1), grid),
                    TypeError, "NetMixin")
        else:
            Trainer(Plain(lp), torch.optim.SGD(lp.parameters(), lr=0.1), grid)
        return
    x, y = _data(8 * 2 * p["steps"], 2, p["seed"])
    lp, ser = _pair(comm, p)
    net = Wrapped(lp)
    mk = lambda params: torch.optim.SGD(params, lr=0.1, momentum=p["momentum"])  # noqa: E731
    opt, sopt = mk(net.parameters()), mk(ser.parameters())
    batches = [(x[8 * s:8 * s + 8], y[8 * s:8 * s + 8]) for s in range(2 * p["steps"])]

    def train(model, o, bs, serial=False):
        for xb, yb in bs:
            o.zero_grad()
            out = model(xb)
            (F.cross_entropy(out, yb) if serial else model.loss(out, yb)).backward()
            o.step()
    train(net, opt, batches[:p["steps"]])
    save_checkpoint(path, net, opt, grid)
    train(net, opt, batches[p["steps"]:])
    train(ser, sopt, batches, serial=True)
    if comm.rank == 0:
        keys = sorted(torch.load(path, weights_only=True)["model"])
        assert keys == sorted("net." + k for k in ser.state_dict()), f"checkpoint keys {keys}"
    _compare(lp, ser, "continuous run", grads=False)
    lp2, _ = _pair(comm, dict(p, seed=p["seed"] + 1))
    net2 = Wrapped(lp2)
    opt2 = mk(net2.parameters())
    load_checkpoint(path, net2, opt2, grid)
    train(net2, opt2, batches[p["steps"]:])
    _compare(lp2, ser, "resumed run", grads=False)


def _tied_nets(comm, p):
    torch.manual_seed(p["seed"])
    shared = DenseStep(3, "tanh").to(DT)
    ref = copy.deepcopy(shared)
    n = p["layers"]
    seg = LayerParallelResNet.build(lambda k: shared, n, (3,), comm=comm, tie=lambda k: 0,
                                    forward=_opts(p["levels"]), backward=_opts(p["levels"]))
    torch.manual_seed(p["seed"] + 1)
    o, c = nn.Linear(2, 3).to(DT), nn.Linear(3, 3).to(DT)
    ser = nn.Sequential(copy.deepcopy(o), *[ResidualStep(ref, 1.0 / n)] * n, copy.deepcopy(c))
    return LayerParallelNet(o, seg, c), ser


def path_clip(p, comm):
    from tests.mpi_cases.nn.offpath_cases import Plain
    norm = float("inf") if p["norm"] == "inf" else float(p["norm"])
    x, y = _data(5, 2, p["seed"])
    if p["net"] == "gru":
        torch.manual_seed(p["seed"])
        o = MGRITOptions(max_levels=p["levels"], cfactor=2, tol=1e-12, max_iter=60)
        model = GRUSequenceClassifier(2, 3, 3, comm=comm, forward=o, backward=o)
        ser = model.to_serial()
        xs = torch.randn(5, p["layers"] + 2, 2, dtype=DT,
                         generator=torch.Generator().manual_seed(p["seed"]))
        model.loss(model(xs), y).backward()
        F.cross_entropy(ser["head"](ser["gru"](xs)[1][0]), y).backward()
        n = float(clip_grad_norm_(model, p["max_norm"], comm, norm_type=norm))
        s = float(torch.nn.utils.clip_grad_norm_(ser.parameters(), p["max_norm"], norm_type=norm))
        assert abs(n - s) <= 1e-8 * max(1.0, s), f"GRU norm {n} vs serial {s}"
        for a, b in zip(model.gru.parameters(), ser["gru"].parameters()):
            assert _rel(a.grad, b.grad) <= 1e-8, f"GRU clipped grad off by {_rel(a.grad, b.grad)}"
        return
    net, ser = _tied_nets(comm, p) if p["net"] != "untied" else _pair(comm, p)
    net.loss(net(x), y).backward()
    F.cross_entropy(ser(x), y).backward()
    arg = Plain(net) if p["net"] == "plain_tied" else net
    n = float(clip_grad_norm_(arg, p["max_norm"], comm, norm_type=norm))
    s = float(torch.nn.utils.clip_grad_norm_(ser.parameters(), p["max_norm"], norm_type=norm))
    assert abs(n - s) <= TOL * max(1.0, s), f"norm {n} vs serial {s}"
    _compare(net, ser, "clipped")


def path_dropout(p, comm):
    from mgrit.nn.steps.stochastic import Dropout, DropPath

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.drop, self.path = (Dropout(0.3), DropPath(0.2)) if p["steps_drop"] else \
                (nn.Identity(), nn.Identity())

        def forward(self, x):
            return self.path(self.drop(torch.tanh(self.lin(x))))

    def ends():
        return (nn.Sequential(nn.Linear(2, 3), nn.Dropout(p["p_open"])).to(DT),
                nn.Sequential(nn.Dropout(p["p_close"]), nn.Linear(3, 3)).to(DT))
    net, ser = _pair(comm, p, make=lambda k: Step().to(DT), ends=ends)
    batches = [_data(6, 2, p["seed"] + s) for s in range(p["steps"])]
    sopt, opt = torch.optim.SGD(ser.parameters(), lr=0.1), torch.optim.SGD(net.parameters(), lr=0.1)
    torch.manual_seed(1000)
    refs = []
    for xb, yb in batches:
        sopt.zero_grad()
        F.cross_entropy(ser(xb), yb).backward()
        refs.append({k: q.grad.clone() for k, q in ser.named_parameters()})
        sopt.step()
    torch.manual_seed(1000 + comm.rank if p["per_rank"] else 1000)
    for i, (xb, yb) in enumerate(batches):
        opt.zero_grad()
        net.loss(net(xb), yb).backward()
        for key, q in net.named_global_parameters():
            e = _rel(q.grad, refs[i][key])
            assert e <= TOL, f"step {i}: {key}.grad off by {e:.2e}"
        opt.step()
    _compare(net, ser, "after training", grads=False)


def path_bn_eval(p, comm):
    x, y = _data(p["n"], 3, p["seed"])
    torch.manual_seed(p["seed"])
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=p["track"]),
                        nn.Tanh(), nn.Linear(4, 3)).to(DT)
    ref = copy.deepcopy(net).eval()
    grid = ProcessGrid(comm, data_parallel=comm.size)
    bs = p["eval_bs"]
    while not p["track"] and p["n"] % bs == 1:
        bs += 1  # (serial BatchNorm refuses a one-sample chunk as well)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), grid, eval_batch_size=bs)
    acc, loss = trainer.evaluate((x, y))
    with torch.no_grad():
        total = sum(F.cross_entropy(ref(x[s:s + bs]), y[s:s + bs], reduction="sum").item()
                    for s in range(0, p["n"], bs))
    assert abs(loss - total / p["n"]) <= TOL * max(1.0, total / p["n"]), \
        f"evaluation loss {loss} vs one process {total / p['n']}"


def path_ckpt_bn(p, comm):
    from torch.utils.checkpoint import checkpoint

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=p["momentum"])

        def forward(self, x):
            return torch.tanh(self.bn(self.lin(x)))
    net, ser = _pair(comm, p, make=lambda k: Step().to(DT))
    opt, sopt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ser.parameters(), lr=0.1)
    for s in range(p["steps"]):
        xb, yb = _data(6, 2, p["seed"] + s)
        opt.zero_grad()
        sopt.zero_grad()
        F.cross_entropy(checkpoint(ser, xb, use_reentrant=False), yb).backward()
        net.loss(checkpoint(net, xb, use_reentrant=False), yb).backward()
        _compare(net, ser, f"step {s}", tol=1e-8)
        opt.step()
        sopt.step()


def path_thread(p, comm):
    net, ser = _pair(comm, p)
    opt, sopt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ser.parameters(), lr=0.1)
    batches = [_data(6, 2, p["seed"] + s) for s in range(p["steps"])]
    failure = []

    def train():
        try:
            for xb, yb in batches:
                opt.zero_grad()
                net.loss(net(xb), yb).backward()
                opt.step()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)
    t = threading.Thread(target=train, name="trainer")
    t.start()
    t.join()
    if failure:
        raise failure[0]
    for xb, yb in batches:
        sopt.zero_grad()
        F.cross_entropy(ser(xb), yb).backward()
        sopt.step()
    _compare(net, ser, "trained from a thread")


#: Counterexamples the path programs found on the code before issue 36's fixes (P = 2, seeds
#: 360000+; each fails there and passes now): replayed by tests/nn/test_offpath.py.
REGRESSIONS = (
    '{"eval_bs":3,"layers":4,"levels":2,"n":26,"path":"bn_eval","seed":1643,"track":false}',
    '{"kind":"plain","layers":7,"levels":2,"momentum":0.0,"path":"protocol","seed":3028,"steps":1}',
    '{"layers":7,"levels":2,"p_close":0.0,"p_open":0.0,"path":"dropout","per_rank":true,'
    '"seed":6164,"steps":3,"steps_drop":true}',
    '{"layers":7,"levels":2,"max_norm":0.01,"net":"plain_tied","norm":2.0,"path":"clip",'
    '"seed":2561}',
    '{"layers":7,"levels":2,"momentum":0.1,"path":"ckpt_bn","seed":7751,"steps":1}',
    '{"kind":"partial","layers":7,"levels":2,"momentum":0.9,"path":"protocol","seed":6233,'
    '"steps":3}',
    '{"kind":"full","layers":7,"levels":1,"momentum":0.9,"path":"protocol","seed":7188,'
    '"steps":1}',
    # the generator's own bug (a one-sample chunk left by the chunk-size bump), seed 362565
    '{"eval_bs":4,"layers":3,"levels":1,"n":21,"path":"bn_eval","seed":7080,"track":false}',
)


def check_path_regressions():
    """Every program of :data:`REGRESSIONS` passes (AssertionError naming those that fail)."""
    bad = [(text, v) for text in REGRESSIONS
           for v in [run_path(json.loads(text), MPI.COMM_WORLD)] if v["status"] == "fail"]
    assert not bad, bad
    return len(REGRESSIONS)


RUNNERS = {"protocol": path_protocol, "clip": path_clip, "dropout": path_dropout,
           "bn_eval": path_bn_eval, "ckpt_bn": path_ckpt_bn, "thread": path_thread,
           "ptie": paths_ptie.path_ptie}


def run_path(program: dict, comm) -> dict:
    """Run one path program on every rank of ``comm``; the agreed verdict."""
    torch.set_default_dtype(DT)
    try:
        RUNNERS[program["path"]](program, comm)
        mine = None
    except Exception as exc:  # noqa: BLE001 - every failure becomes the verdict
        mine = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    errs = comm.allgather(mine)
    bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
    return {"status": "fail" if bad else "ok", "message": "; ".join(bad)[:1500]}


def check_path_seeds(seeds, findings=None, progress=None, raise_on_failure=True, only=None):
    """Run the path programs of ``seeds`` (``only``: of that path); failures appended to
    ``findings`` (JSON lines) by rank 0. Returns counts (per path and verdict)."""
    if only is not None and only not in PATHS:
        raise ValueError(f"only={only!r} is not allowed: use one of {PATHS} or None")
    comm = MPI.COMM_WORLD
    counts, failures, t0 = {}, [], time.perf_counter()
    for seed in seeds:
        program = from_seed(seed, only)
        if comm.rank == 0 and progress:
            with open(progress, "w") as fh:
                fh.write(json.dumps({"seed": seed, "program": program}) + "\n")
        verdict = run_path(program, comm)
        key = f"{program['path']}:{verdict['status']}"
        counts[key] = counts.get(key, 0) + 1
        if verdict["status"] == "fail":
            item = {"seed": seed, "ranks": comm.size, "verdict": verdict, "program": program}
            failures.append(item)
            if comm.rank == 0 and findings:
                with open(findings, "a") as fh:
                    fh.write(json.dumps(item) + "\n")
    summary = {"ranks": comm.size, "programs": len(seeds), "counts": counts,
               "seconds": round(time.perf_counter() - t0, 2), "failures": len(failures)}
    if failures and raise_on_failure:
        raise AssertionError("\n".join(f"seed {f['seed']}: {f['verdict']['message']}\n  replay: "
                                       f"python -m tests.fuzz replay --ranks {comm.size} "
                                       f"'{dumps(f['program'])}'" for f in failures))
    return summary


def check_path_program(program, expect="pass"):
    """Replay one path program (dict or JSON text); AssertionError when it fails."""
    if isinstance(program, str):
        program = json.loads(program)
    verdict = run_path(program, MPI.COMM_WORLD)
    if expect == "pass" and verdict["status"] == "fail":
        raise AssertionError(f"expected pass, got {verdict}")
    return verdict
