"""Rank-side check of the reliability suite's acceptance 2 (tests/training/test_reliability.py): a table
of bad inputs (options, solver, partition, network, grid, sampler, layer-wise model, guard,
phase, checkpoints), each raising the named exception with the named words, the messages the
same on every rank. Shares the network builder of :mod:`tests.mpi_cases.training.reliability_cases`."""
from __future__ import annotations

import os

import torch
from mpi4py import MPI
from torch import nn

from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet
from mgrit.options import MGRITOptions
from mgrit.training.checkpoint import load_checkpoint, save_checkpoint
from mgrit.training.guard import ConvergenceGuard
from tests.mpi_cases.training.reliability_cases import WIDTH, build


# -- acceptance 2: validation ----------------------------------------------------------------
def _bad_inputs(tmp):
    from data import GlobalBatchSampler
    from layerwise import DecoupledModel
    from mgrit.training.support.faults import phase
    from mgrit.grid import Hierarchy, Partition
    from mgrit.parallel.procgrid import ProcessGrid
    from mgrit.solver import MGRIT

    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    good_prop = build(MPI.COMM_SELF, "exact", n_layers=2)[0].resnet._chain
    not_ckpt = os.path.join(tmp, "not-a-checkpoint.pt")
    if comm.Get_rank() == 0:
        with open(not_ckpt, "w") as fh:
            fh.write("garbage")
    comm.Barrier()
    ok = os.path.join(tmp, "ok.pt")
    lin = lambda k: DenseStep(WIDTH)  # noqa: E731

    def resnet(**kw):
        return LayerParallelResNet.build(lin, kw.pop("n", 6), (WIDTH,), comm=comm, **kw)

    def load_into(path, n=6):
        net = LayerParallelNet(None, resnet(n=n), None)
        load_checkpoint(path, net, None, ProcessGrid(comm))

    def save_ok():
        net = LayerParallelNet(None, resnet(n=6), None)
        save_checkpoint(ok, net, None, ProcessGrid(comm))

    return [
        ("opts max_levels=0", lambda: MGRITOptions(max_levels=0), ValueError, "max_levels=0"),
        ("opts cfactor=1", lambda: MGRITOptions(cfactor=1), ValueError, "cfactor=1"),
        ("opts cfactor=[]", lambda: MGRITOptions(cfactor=[]), ValueError, "cfactor=[]"),
        ("opts max_iter=0", lambda: MGRITOptions(max_iter=0), ValueError, "max_iter=0"),
        ("opts tol<0", lambda: MGRITOptions(tol=-1.0), ValueError, "tol=-1.0"),
        ("opts rtol=nan", lambda: MGRITOptions(rtol=float("nan")), ValueError, "rtol=nan"),
        ("opts norm", lambda: MGRITOptions(norm="l1"), ValueError, "norm='l1'"),
        ("opts cycle", lambda: MGRITOptions(cycle="W"), ValueError, "cycle='W'"),
        ("opts relax", lambda: MGRITOptions(relax="FC"), ValueError, "relaxation 'FC'"),
        ("opts c_weight=0", lambda: MGRITOptions(c_weight=0), ValueError, "c_weight=0"),
        ("opts batched str", lambda: MGRITOptions(batched="yes"), ValueError, "batched='yes'"),
        ("mgrit n=0", lambda: MGRIT(good_prop, 0, comm=comm), ValueError, "n_intervals=0"),
        ("mgrit N<P", lambda: MGRIT(good_prop, P - 1, comm=comm), ValueError,
         f"N={P - 1} intervals cannot be split over P={P}"),
        ("mgrit dtype", lambda: MGRIT(good_prop, 8, dtype=torch.int64, comm=comm), ValueError,
         "dtype=torch.int64"),
        ("mgrit options", lambda: MGRIT(good_prop, 8, options="fast", comm=comm), ValueError,
         "options must be MGRITOptions"),
        ("mgrit propagator", lambda: MGRIT(None, 8, comm=comm), ValueError,
         "propagator must be a mgrit.Propagator"),
        ("partition sum", lambda: Partition(5, [2, 2]), ValueError, "sum to N=5"),
        ("partition ranks", lambda: Partition(4, [2, 2], [0, 0]), ValueError, "permutation"),
        ("partition P=0", lambda: Partition.even(4, 0), ValueError, "P=0"),
        ("hierarchy levels", lambda: Hierarchy(Partition.even(8, 1), 0, max_levels=0), ValueError,
         "max_levels=0"),
        ("hierarchy min_coarse", lambda: Hierarchy(Partition.even(8, 1), 0, min_coarse=0),
         ValueError, "min_coarse=0"),
        ("resnet T<0", lambda: resnet(T=-1.0), ValueError, "T=-1.0"),
        ("resnet adjoint", lambda: resnet(adjoint="exact"), ValueError, "adjoint='exact'"),
        ("resnet N<P", lambda: resnet(n=P - 1), ValueError, f"N={P - 1} intervals"),
        ("resnet n_layers=0", lambda: LayerParallelResNet([], 0, (WIDTH,), comm=comm),
         ValueError, "n_layers=0"),
        ("resnet dropout", lambda: LayerParallelResNet.build(
            lambda k: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout()), 6, (WIDTH,), comm=comm),
         ValueError, "Dropout"),
        ("grid dp=2 on 3", lambda: ProcessGrid(comm, data_parallel=2), ValueError,
         "P_D=2 does not divide"),
        ("sampler rank", lambda: GlobalBatchSampler(10, 4, seed=0, rank=5, num_replicas=2),
         ValueError, "rank=5 is invalid"),
        ("layerwise classes", lambda: DecoupledModel([nn.Linear(3, 3)], num_classes=0, num_stages=1,
                                                     in_shape=(3,)), ValueError, "num_classes"),
        ("guard window", lambda: ConvergenceGuard(window=0), ValueError, "window=0"),
        ("guard action", lambda: ConvergenceGuard(action="retry"), ValueError, "action='retry'"),
        ("guard threshold", lambda: ConvergenceGuard(threshold=float("inf")), ValueError,
         "threshold=inf"),
        ("phase name", lambda: phase(""), ValueError, "phase name ''"),
        ("ckpt missing", lambda: load_into(os.path.join(tmp, "nope.pt")), FileNotFoundError,
         "does not exist"),
        ("ckpt garbage", lambda: load_into(not_ckpt), ValueError,
         "was refused by torch's weights-only loader (Unsupported operand"),
        ("ckpt layers", lambda: (save_ok(), load_into(ok, n=9)), ValueError,
         "residual layers: [6] in the checkpoint, [9] in the model"),
        ("ckpt path", lambda: save_checkpoint("", LayerParallelNet(None, resnet(), None), None),
         ValueError, "checkpoint path '' is not allowed"),
    ]


KNOWN_RANK_DEPENDENT: set = set()  # every message is agreed across ranks


def check_bad_inputs(tmp_dir):
    comm = MPI.COMM_WORLD
    tmp = comm.bcast(tmp_dir, root=0)
    table = _bad_inputs(tmp)
    assert len(table) >= 25
    messages, failures = [], []
    for name, fn, exc_type, text in table:
        try:
            fn()
        except exc_type as exc:
            msg = str(exc)
            if text not in msg:
                failures.append(f"{name}: message {msg!r} lacks {text!r}")
            messages.append((name, msg))
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{name}: {type(exc).__name__}: {exc} (wanted {exc_type.__name__})")
        else:
            failures.append(f"{name}: no exception")
        comm.Barrier()
    assert not failures, "\n".join(failures)
    everyone = comm.allgather(messages)
    # KNOWN BUG (mgrit/nn/resnet/segment.py, not owned here): the Dropout/BatchNorm message names the
    # rank's own first offending layer, so it differs between ranks; reported, excluded here.
    diffs = [(a, b) for m in everyone for a, b in zip(m, everyone[0])
             if a != b and a[0] not in KNOWN_RANK_DEPENDENT]
    assert not diffs, f"messages differ between ranks: {diffs}"
    return len(messages)
