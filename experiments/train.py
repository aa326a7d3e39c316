"""Main job: train a deep ResNet layer-parallel with MGRIT (or serially / layer-wise) on real data.

Launch (the README's first command; default: mnist5k, dense ResNet of 32 tanh steps, width 32,
2 epochs, 3 levels / cfactor 4 / 2+1 iterations; 2 ranks: about 20 s of training on 2 cores)::

    mpiexec -n 2 python -m mpi4py experiments/train.py
    python experiments/train.py --serial                        # the serial reference, 1 rank
    mpiexec -n 4 python -m mpi4py experiments/train.py --dp 2   # 2 layer ranks x 2 replicas

Flag parsing here (the flags: :mod:`layerpar.flags`), everything else in the library:
:func:`layerpar.job.run_job` (grid,
run directory, data, :mod:`mgrit.models`, optimizer, callbacks) trains through
:class:`mgrit.training.Trainer` (``--method mgrit|serial``) or ``layerwise``
(``--method sequential|decoupled``). Every sample of every epoch is used for any ``--dp``
(a replica without samples in a small last batch joins the gradient average with weight 0).
Output (rank 0): ``RUN/config.json``, ``metrics.h5``, ``summary.json``, ``curves.png``
(``RUN`` = ``--out``, default ``runs/<method>-<timestamp>``; an existing non-empty one only with
``--overwrite`` or ``--resume``), ``console.log``, ``metrics.csv``, ``steps.csv`` and
``model.pt`` (``python -m layerpar.export RUN model.pt`` makes a plain PyTorch model of it).
Ctrl-C prints where the run stopped and how to resume it, writes the results so far and exits
with status 130. Started by torchrun or by srun with another MPI: one line saying how to
launch, status 2. A failure prints one line
(rank, phase, message, what to do); the traceback goes to ``RUN/error-rank-R.log``
(``--debug`` prints it too).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # plain ``python experiments/train.py`` from a checkout
    sys.path.insert(0, str(ROOT))

from mgrit.launch import refuse_foreign_launch  # noqa: E402  (imports only mpi4py)

if __name__ == "__main__":  # torchrun / srun with another MPI: one line, before torch loads
    refuse_foreign_launch("experiments/train.py")

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from layerpar.cli import JobParser  # noqa: E402
from mgrit.training.support.faults import abort_quietly, fail_fast  # noqa: E402
from layerpar.flags import job_parser  # noqa: E402
from layerpar.job import run_job  # noqa: E402
from mgrit.training.support import interrupts  # noqa: E402


def build_parser() -> JobParser:
    """The job's parser (:func:`layerpar.flags.job_parser`)."""
    return job_parser("experiments/train.py")


def main(argv=None) -> int:
    refuse_foreign_launch("experiments/train.py")
    comm = MPI.COMM_WORLD
    fail_fast(comm)  # an exception on any rank ends the job: one line, rank and phase named
    parser = build_parser()
    parser.hard_exit = True  # a bad flag: usage once (rank 0), the whole job exits with 2
    config = parser.parse_config(argv)
    fail_fast(comm, debug=config.debug, print_traceback=config.debug)
    if config.threads:
        torch.set_num_threads(config.threads)
    elif comm.Get_size() > 1:
        torch.set_num_threads(1)  # ranks share the cores; oversubscription slows every rank
    torch.set_default_dtype(torch.float64 if config.dtype == "float64" else torch.float32)
    try:
        run_job(config, comm)
    except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM: rank 0 reported where and how to
        if comm.Get_rank() != 0:     # resume; it ends the job once it has written the results
            time.sleep(30.0)         # so far; the others end it only if rank 0 cannot (a hang)
        abort_quietly(comm, 143 if isinstance(exc, interrupts.Terminated) else 130)
    return 0


if __name__ == "__main__":
    sys.exit(main())
