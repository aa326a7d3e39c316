"""Issue 36 items 10 and 12, run on 2 ranks by tests/nn/test_offpath.py (a whole job: the
MPI thread level is fixed when mpi4py initializes MPI).

``level``: two training threads per rank, each on its own duplicate of COMM_WORLD, under
``MPI4PY_RC_THREAD_LEVEL=single`` (set by the test): every thread must get the library's
RuntimeError naming the thread level (before any message), and the job must end.
``loader``: a thread draws from torch's default generator while the main thread solves: the
forward either passes or its error names another thread as a possible cause.
"""
import sys
import threading
import time

import torch
from mpi4py import MPI

from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet
from mgrit.options import MGRITOptions

COMM = MPI.COMM_WORLD


def _net(comm):
    torch.set_default_dtype(torch.float64)
    o = MGRITOptions(max_levels=2, cfactor=2, tol=1e-12, max_iter=40)
    seg = LayerParallelResNet.build(lambda k: DenseStep(3, "tanh"), 6, (3,), comm=comm,
                                    forward=o, backward=o)
    return LayerParallelNet(torch.nn.Linear(2, 3), seg, torch.nn.Linear(3, 2))


def level():
    comms = [COMM.Dup() for _ in range(2)]
    nets = [_net(c) for c in comms]  # built on the main thread: allowed
    results = [None, None]

    def train(i):
        try:
            # the input from the thread's own generator: a draw from the process-wide default
            # generator during the other thread's solve is item 12's case (``loader``), not this
            x = torch.randn(4, 2, generator=torch.Generator().manual_seed(i))
            y = torch.tensor([0, 1, 0, 1])
            nets[i].loss(nets[i](x), y).backward()
            results[i] = "trained"
        except RuntimeError as exc:
            results[i] = f"refused: {exc}"
    threads = [threading.Thread(target=train, args=(i,), name=f"trainer-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"rank {COMM.Get_rank()} level {MPI.Query_thread()}: {results}", flush=True)


def loader():
    net = _net(COMM)
    stop = threading.Event()

    def draw():
        while not stop.is_set():
            torch.rand(16)
            time.sleep(1e-4)
    t = threading.Thread(target=draw, name="loader", daemon=True)
    t.start()
    try:
        for _ in range(5):
            x, y = torch.randn(4, 2, generator=torch.Generator().manual_seed(0)), \
                torch.tensor([0, 1, 0, 1])
            net.loss(net(x), y).backward()
        print(f"rank {COMM.Get_rank()} loader: trained", flush=True)
    except (ValueError, RuntimeError) as exc:
        print(f"rank {COMM.Get_rank()} loader: refused: {exc}", flush=True)
    stop.set()
    t.join()


if __name__ == "__main__":
    {"level": level, "loader": loader}[sys.argv[1]]()
