"""Rank-side entry point of :mod:`tests.mpi_harness` (not collected by pytest).

Usage: ``mpiexec -n K python -m mpi4py tests/mpi_runner.py CALLS.json``, where the file holds a
list of ``{"name", "target": "package.module:function", "kwargs"}`` (and ``"group"``: the test
file that registered it; where it changes, torch's default dtype and grad mode are set back to
what the job started with, as in a job of that file's own; and ``"timeout"``: seconds after
which a check still running ends its rank with every thread's traceback). Each rank runs the calls in order and rewrites its report (``rank-R.json`` in ``$LAYERPAR_MPI_REPORT_DIR``) after each
one, so a failure keeps the verdicts of the calls before it.
"""
import faulthandler
import importlib
import json
import os
import sys
import traceback

# Run as a script, Python puts tests/ first on sys.path, where tests/data/ would shadow the
# real ``data`` package: drop it (the repository root is on PYTHONPATH).
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

from mpi4py import MPI  # noqa: E402


def main() -> None:
    with open(sys.argv[1]) as fh:
        calls = json.load(fh)
    rank = MPI.COMM_WORLD.Get_rank()
    report = os.path.join(os.environ.get("LAYERPAR_MPI_REPORT_DIR", "."), f"rank-{rank}.json")
    done = {}

    def write():
        tmp = report + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(done, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, report)

    group = None
    for call in calls:
        if call.get("group") != group and "torch" in sys.modules:
            torch = sys.modules["torch"]  # a check imported it: torch's start-up defaults again
            torch.set_default_dtype(torch.float32)
            torch.set_grad_enabled(True)
        group = call.get("group")
        module, func = call["target"].split(":")
        if call.get("timeout"):  # a hung check ends its rank (and so the job) with tracebacks
            faulthandler.dump_traceback_later(call["timeout"], exit=True)
        try:
            result = getattr(importlib.import_module(module), func)(**call["kwargs"])
        except BaseException:
            done[call["name"]] = {"status": "failed", "traceback": traceback.format_exc()}
            write()
            raise  # python -m mpi4py turns this into MPI_Abort: no rank is left hanging
        done[call["name"]] = {"status": "ok", "result": None if result is None else repr(result)}
        write()
        MPI.COMM_WORLD.Barrier()  # keep the checks apart: no message of one leaks into the next
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
