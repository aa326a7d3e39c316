"""Run several example scripts in one MPI job (``tests/docs/test_examples.py``): every rank runs
``examples/NAME.py ARGS...`` as ``__main__`` (``runpy``), one after another, with its stdout
captured to ``OUT/I-NAME.rank-R.txt`` (``I``: its position on the command line). Starting torch
on every rank costs seconds, so one launch serves all the examples. An exception propagates:
``python -m mpi4py`` then aborts the whole job.

    mpiexec -n 2 python -m mpi4py tests/examples_runner.py OUT NAME[:ARG,ARG...] ...
"""
import contextlib
import io
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # not tests/: tests/data would shadow the data package

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402


def main(out: str, specs: list) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    for i, spec in enumerate(specs):
        name, _, args = spec.partition(":")
        path = os.path.join(ROOT, "examples", name + ".py")
        dtype, argv = torch.get_default_dtype(), sys.argv
        sys.argv = [path] + [a for a in args.split(",") if a]
        buf = io.StringIO()
        t = time.perf_counter()
        try:
            with contextlib.redirect_stdout(buf):
                runpy.run_path(path, run_name="__main__")
        finally:  # what one example sets must not leak into the next
            sys.argv = argv
            torch.set_default_dtype(dtype)
            with open(os.path.join(out, f"{i}-{name}.rank-{rank}.txt"), "w") as fh:
                fh.write(buf.getvalue())
        if rank == 0:  # on stderr: how long each example took (the test prints it with -s)
            print(f"{name} {args}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
