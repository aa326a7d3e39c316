"""Parts of the main job ``experiments/train.py``: model construction, run-directory output
and the training loops (end-to-end serial / MGRIT, and layer-wise through :mod:`layerwise`).

Kept apart from the command-line front end so each file stays one concept; see ``train.py``
for the flags.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- model
def features_of(a) -> int:
    return a.width if a.step == "dense" else a.channels


def build_opening_closing(a, in_shape, num_classes):
    """Opening and closing layers, seeded independently of the ranks (identical in every
    method): ``manual_seed(seed)`` before the opening, ``manual_seed(seed + 7919)`` before the
    closing."""
    from mgrit.nn.steps import activation
    torch.manual_seed(a.seed)
    if a.step == "dense":
        d = int(np.prod(in_shape))
        opening = nn.Sequential(nn.Flatten(), nn.Linear(d, a.width), activation(a.activation))
        state_shape = (a.width,)
    else:
        if len(in_shape) != 3:
            raise SystemExit(f"--step {a.step} needs image data (C, H, W); {a.dataset} has "
                             f"samples of shape {in_shape}: use --step dense")
        opening = nn.Sequential(nn.Conv2d(in_shape[0], a.channels, 3, padding=1),
                                activation(a.activation))
        state_shape = (a.channels, *in_shape[1:])
    torch.manual_seed(a.seed + 7919)
    closing = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(state_shape)), num_classes))
    return opening, closing, state_shape


def step_factory(a):
    from mgrit.nn import make_step
    return lambda k: make_step(a.step, features_of(a), a.activation, a.kernel)


def mgrit_options(a):
    from mgrit.options import MGRITOptions
    common = dict(max_levels=a.levels, cfactor=a.cfactor, relax=a.relax_list,
                  skip_first_relaxation=a.skip_first_relaxation)
    if a.tol > 0:
        fwd = MGRITOptions(tol=a.tol, max_iter=max(a.fwd_iters, 50), **common)
        bwd = MGRITOptions(tol=a.tol, max_iter=max(a.bwd_iters, 50), **common)
    else:
        fwd = MGRITOptions(tol=0, max_iter=a.fwd_iters, **common)
        bwd = MGRITOptions(tol=0, max_iter=a.bwd_iters, **common)
    return fwd, bwd


# ----------------------------------------------------------------------------- output
def git_commit() -> str:
    """Commit of the code that ran (``+dirty`` for uncommitted changes), via :mod:`reporting`."""
    from mgrit.training import report as reporting
    return reporting.run_metadata()["commit"]


def write_metrics(run: Path, hist: dict, config: dict) -> None:
    import h5py
    tmp = run / "metrics.h5.tmp"
    with h5py.File(tmp, "w") as f:
        for k, v in hist.items():
            arr = np.array([np.nan if x is None else x for x in v], dtype=np.float64)
            f.create_dataset(k, data=arr)
        f.attrs["config"] = json.dumps(config)
        for k, v in config.items():
            if isinstance(v, (int, float, str, bool)):
                f.attrs[k] = v
    os.replace(tmp, run / "metrics.h5")


def write_curves(run: Path, hist: dict, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ep = hist["epoch"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(ep, hist["loss"], "o-", label="train loss")
    ax1.set_xlabel("epoch"); ax1.set_ylabel("loss"); ax1.legend(); ax1.grid(alpha=0.3)
    ax2.plot(ep, hist["train_acc"], "o-", label="train")
    if any(x is not None for x in hist["test_acc"]):
        ax2.plot(ep, [np.nan if x is None else x for x in hist["test_acc"]], "s-", label="test")
    ax2.set_xlabel("epoch"); ax2.set_ylabel("accuracy"); ax2.legend(); ax2.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(run / "curves.png", dpi=100)
    plt.close(fig)


def default_out(method: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = ROOT / "runs" / f"{method}-{stamp}"
    out, i = base, 1
    while out.exists():
        out, i = Path(f"{base}-{i}"), i + 1
    return out


def _sampler_batches(a, grid, n, epoch):
    from data import GlobalBatchSampler
    s = GlobalBatchSampler(n, a.batch_size, seed=a.seed, rank=grid.data_rank,
                           num_replicas=grid.data_size, drop_last=(0 < n % a.batch_size < grid.data_size))
    s.set_epoch(epoch)
    for gb in s.global_batches():
        yield s.shard(gb), len(gb)


def run_end_to_end(a, grid, xtr, ytr, xte, yte, in_shape, num_classes, dtype, run, config,
                   rank0, say):
    """``--method serial|mgrit``: ordinary training loop; returns (history, final, extra)."""
    from mgrit.parallel.dataparallel import GradientBuckets
    from mgrit.nn import LayerParallelNet, LayerParallelResNet, serial_resnet
    opening, closing, state_shape = build_opening_closing(a, in_shape, num_classes)
    make = step_factory(a)
    mg = a.method == "mgrit"
    if mg:
        fwd, bwd = mgrit_options(a)
        resnet = LayerParallelResNet.build(make, a.layers, state_shape, comm=grid.layer_comm,
                                           seed=a.seed, T=a.T, forward=fwd, backward=bwd,
                                           adjoint=a.adjoint, warm_start=a.warm_start,
                                           warm_start_adjoint=a.warm_start_adjoint)
        net = LayerParallelNet(opening, resnet, closing)
        is_last = net.is_last
        share = net.from_last
        config["warm_start_effective"] = resnet.warm_start
        from mgrit.training.faults import instrument_resnet
        instrument_resnet(resnet)
        for name, solver in (("forward", resnet._fsolver), ("adjoint", resnet._bsolver)):
            lv = solver.hierarchy.levels
            say(f"[train] MGRIT {name}: {len(lv)} level(s), intervals per level "
                f"{[x.n_intervals for x in lv]}, relax {solver.options.relax}, "
                + (f"tol {solver.options.tol:g} (exact mode, <= {solver.options.max_iter} cycles)"
                   if solver.options.tol > 0 else f"{solver.options.max_iter} cycle(s) (inexact)"))
    else:
        net = nn.Sequential(opening, *serial_resnet(make, a.layers, T=a.T, seed=a.seed), closing)
        is_last = True
        share = lambda v: v
    net = net.to(dtype)
    params = [p for p in net.parameters()]
    n_local = sum(p.numel() for p in params)
    n_total = int(grid.layer_comm.allreduce(n_local)) if mg else n_local
    config["parameters"] = n_total
    if a.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=a.lr, momentum=a.momentum)
    else:
        opt = torch.optim.Adam(params, lr=a.lr)
    # data-parallel: the .grad tensors are views of persistent flat buffers (one in-place
    # Allreduce per step, no pack/unpack copies)
    buckets = GradientBuckets(params, grid.data_comm) if grid.data_size > 1 else None
    loss_fn = nn.functional.cross_entropy
    from mgrit.training.faults import phase
    guard = None
    if mg and a.guard != "off":
        from mgrit.training.guard import ConvergenceGuard
        guard = ConvergenceGuard(window=3, threshold=1.0, action=a.guard,
                                 log_path=str(run / "guard.jsonl"))
    ckpt = None
    if mg and a.checkpoint_every:
        name = "checkpoint.pt" if grid.data_size == 1 else f"checkpoint-dp{grid.data_rank}.pt"
        ckpt = str(run / name)  # replicas keep their own RNG states

    def save(epoch, batch, tot, hist):
        from mgrit.training.checkpoint import save_checkpoint
        extra = {"epoch": epoch, "batch": batch, "tot": list(map(float, tot)), "hist": hist,
                 "sampler_seed": a.seed, "guard": guard.state_dict() if guard else None}
        with phase("checkpoint"):
            save_checkpoint(ckpt, net.resnet, opt, extra, grid.layer_comm,
                            opening=net.opening, closing=net.closing)

    start_epoch, start_batch, start_tot, resumed_hist = 0, 0, np.zeros(3), None
    if mg and a.resume:
        from mgrit.training.checkpoint import load_checkpoint
        with phase("checkpoint"):
            extra = load_checkpoint(a.resume, net.resnet, opt, grid.layer_comm,
                                    opening=net.opening, closing=net.closing)
        start_epoch, start_batch = int(extra["epoch"]), int(extra["batch"])
        start_tot, resumed_hist = np.asarray(extra["tot"]), extra["hist"]
        if guard is not None and extra.get("guard"):
            guard.load_state_dict(extra["guard"])
        say(f"[train] resumed {a.resume} at epoch {start_epoch + 1}, batch {start_batch}"
            + (f" ({'; '.join(extra['_notes'])})" if extra.get("_notes") else ""))

    def evaluate():
        """Test accuracy and loss: replicas split the test set, forward only."""
        idx = np.array_split(np.arange(len(yte)), grid.data_size)[grid.data_rank]
        tot = np.zeros(3)
        with torch.no_grad():
            for s in range(0, len(idx), a.eval_batch_size):
                j = torch.as_tensor(idx[s:s + a.eval_batch_size])
                out = net(xte[j])
                if is_last:
                    y = yte[j]
                    tot += [loss_fn(out, y, reduction="sum").item(),
                            (out.argmax(1) == y).sum().item(), len(y)]
        tot = np.asarray(share(tot)) if mg else tot
        tot = grid.data_comm.allreduce(tot)
        return tot[1] / max(tot[2], 1), tot[0] / max(tot[2], 1)

    keys = ("epoch", "loss", "train_acc", "test_acc", "test_loss", "epoch_time", "eval_time",
            "fwd_iters", "fwd_residual", "bwd_iters", "bwd_residual", "fwd_residual_mean",
            "bwd_residual_mean")
    hist = resumed_hist if resumed_hist is not None else {k: [] for k in keys}
    progress = rank0 and not a.no_progress
    nb = len(list(_sampler_batches(a, grid, len(ytr), 0)))
    acc0, loss0 = evaluate()
    say(f"[train] {config['parameters']} parameters; initial test_acc {acc0:.4f} "
        f"test_loss {loss0:.4f}")
    stats_line = ""
    step = 0
    for epoch in range(start_epoch, a.epochs):
        net.train()
        tot = start_tot.copy() if epoch == start_epoch else np.zeros(3)  # loss, correct, count
        fres, bres, fits, bits = [], [], 0, 0
        unconverged = 0  # exact mode: solves that hit the cycle cap before the tolerance
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=nb, desc=f"epoch {epoch + 1}/{a.epochs}", file=sys.stdout,
                       dynamic_ncols=True, leave=False)
        t0 = time.perf_counter()
        for b, (idx, glen) in enumerate(_sampler_batches(a, grid, len(ytr), epoch)):
            if epoch == start_epoch and b < start_batch:
                if bar is not None:
                    bar.update(1)
                continue  # done before the checkpoint we resumed from
            with phase("data loading"):
                j = torch.as_tensor(idx)
                x, y = xtr[j], ytr[j]
            if buckets is None:
                opt.zero_grad(set_to_none=True)
            else:
                buckets.zero_grad()
            out = net(x)
            loss = net.loss(out, y) if mg else loss_fn(out, y)
            loss.backward()
            if guard is not None:
                guard.check_resnet(net.resnet, step)
            if buckets is not None:
                with phase("gradient averaging"):
                    buckets.average(weight=len(idx) / glen)
            opt.step()
            step += 1
            if is_last:
                with torch.no_grad():
                    batch = [loss.item() * len(y), (out.argmax(1) == y).sum().item(), len(y)]
            else:
                batch = None
            batch = share(batch)
            tot += batch
            if mg:
                rf, rb = net.resnet.last_forward, net.resnet.last_backward
                fits, bits = rf.iterations, (rb.iterations if rb is not None else 0)
                if a.tol > 0:
                    unconverged += (not rf.converged) + (rb is not None and not rb.converged)
                if rf.residuals:
                    fres.append(rf.residuals[-1])
                if rb is not None and rb.residuals:
                    bres.append(rb.residuals[-1])
            if ckpt is not None and step % a.checkpoint_every == 0:
                save(epoch, b + 1, tot, hist)
            if bar is not None:
                post = {"loss": f"{batch[0] / batch[2]:.3f}"}
                if fres:
                    post["fres"] = f"{fres[-1]:.1e}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
        t_epoch = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        tot = grid.data_comm.allreduce(tot)
        t1 = time.perf_counter()
        net.eval()
        test_acc, test_loss = evaluate()
        t_eval = time.perf_counter() - t1
        # the slowest rank defines the epoch time
        t_epoch = grid.comm.allreduce(t_epoch, op=MPI.MAX)
        rec = dict(epoch=epoch + 1, loss=tot[0] / tot[2], train_acc=tot[1] / tot[2],
                   test_acc=test_acc, test_loss=test_loss, epoch_time=t_epoch, eval_time=t_eval,
                   fwd_iters=fits if mg else None, bwd_iters=bits if mg else None,
                   fwd_residual=fres[-1] if fres else None,
                   bwd_residual=bres[-1] if bres else None,
                   fwd_residual_mean=float(np.mean(fres)) if fres else None,
                   bwd_residual_mean=float(np.mean(bres)) if bres else None)
        for k in keys:
            hist[k].append(rec[k])
        line = (f"epoch {epoch + 1}/{a.epochs} loss {rec['loss']:.4f} train_acc "
                f"{rec['train_acc']:.4f} test_acc {test_acc:.4f} time {t_epoch:.1f}s "
                f"(eval {t_eval:.1f}s)")
        if mg:
            fr = "-" if not fres else f"{fres[-1]:.2e} (mean {np.mean(fres):.2e})"
            br = "-" if not bres else f"{bres[-1]:.2e} (mean {np.mean(bres):.2e})"
            line += f" | MGRIT fwd {fits} it res {fr}; bwd {bits} it res {br}"
            stats_line = net.resnet._fsolver.stats.summary()
            if unconverged:
                line += (f"\n[train] WARNING: {unconverged} MGRIT solve(s) this epoch stopped at the "
                         f"cycle cap before --tol {a.tol:g}: gradients are not exact")
        say(line)
        if rank0:
            write_metrics(run, hist, config)
        if ckpt is not None:
            save(epoch + 1, 0, np.zeros(3), hist)
    if mg:
        say(f"[train] forward solver counters (rank 0, all solves): {stats_line}")
    if guard is not None and guard.events:
        say(f"[train] convergence guard acted {len(guard.events)} time(s); see {run / 'guard.jsonl'}")
    final = {k: hist[k][-1] for k in ("loss", "train_acc", "test_acc", "test_loss")}
    final["initial_test_acc"] = acc0
    extra = {"forward_stats": stats_line} if mg else {}
    return hist, final, extra


def run_layerwise(a, grid, xtr, ytr, xte, yte, in_shape, num_classes):
    """``--method sequential|decoupled`` through :func:`layerwise.train_layerwise`."""
    from layerwise import train_layerwise
    from mgrit.nn import ResidualStep
    from mgrit.nn.resnet import layer_seed
    opening, _closing, _ = build_opening_closing(a, in_shape, num_classes)
    make = step_factory(a)
    layers = [opening]
    for k in range(a.layers):
        torch.manual_seed(layer_seed(a.seed, k))
        layers.append(ResidualStep(make(k), a.T / a.layers))
    kw = {}
    if a.method == "decoupled":
        kw = dict(num_stages=a.stages, stages_per_rank=a.stages // grid.layer_size)
    out = train_layerwise(a.method, layers, num_classes, xtr, ytr, xte, yte, grid=grid,
                          epochs=a.epochs, batch_size=a.batch_size, optimizer=a.optimizer,
                          lr=a.lr, momentum=a.momentum, seed=a.seed,
                          eval_batch_size=a.eval_batch_size, progress=True, **kw)
    n = len(out["epoch"])
    hist = {"epoch": out["epoch"], "loss": out["loss"], "train_acc": out["train_acc"],
            "test_acc": out["test_acc"], "epoch_time": out["time"]}
    fin = out.get("final") or {}
    final = {"loss": out["loss"][-1] if n else float("nan"),
             "train_acc": out["train_acc"][-1] if n else float("nan"),
             "test_acc": fin.get("acc", out["test_acc"][-1] if n else float("nan"))}
    extra = {"stage": out.get("stage"), "layerwise_final": {k: v for k, v in fin.items()
                                                            if isinstance(v, (int, float))}}
    return hist, final, extra
