"""Rank side of the MPI runs: many programs in one ``mpiexec`` job, failures shrunk in place.

:func:`check_seeds` is launched through :mod:`tests.mpi_harness` (``target =
"tests.fuzz.driver:check_seeds"``) on every rank. For each seed it generates the program
(seeded alike on every rank; an ``allgather`` of its JSON text checks that they agree), runs it
with :func:`~tests.fuzz.executor.run_program` and, on a failure, shrinks it collectively
(every rank runs the same deterministic shrinker on the same candidates, and every verdict is
agreed, so all ranks take the same path). Rank 0 appends one JSON line per failure to
``findings`` and writes the program it is about to run to ``progress`` (so a hang, which a
timeout ends, still names its program).
"""
from __future__ import annotations

import json
import time

from mpi4py import MPI

from .executor import run_program
from .program import default_features, dumps, from_seed, shrink


def replay_hint(program: dict, ranks: int) -> str:
    return f"python -m tests.fuzz replay --ranks {ranks} '{dumps(program)}'"


def _write(path, text, mode="a"):
    if path:
        with open(path, mode) as fh:
            fh.write(text)


def check_seeds(seeds, enabled=None, findings=None, progress=None, do_shrink=True,
                raise_on_failure=True, budget=60):
    """Run the programs of ``seeds`` (a list of ints, or ``[start, stop]`` as a dict
    ``{"range": [a, b]}``) with the features ``enabled`` (default: those of
    :func:`~tests.fuzz.program.default_features` for CI); returns counts and failures.

    Raises:
        AssertionError: (every rank) with ``raise_on_failure``, after all seeds ran, listing
            each failure's seed, message, shrunk program and the command that replays it.
    """
    comm = MPI.COMM_WORLD
    if isinstance(seeds, dict):
        seeds = list(range(*seeds["range"]))
    enabled = default_features(ci=True) if enabled is None else frozenset(enabled)
    counts, failures, t0 = {}, [], time.perf_counter()
    for seed in seeds:
        program = from_seed(seed, enabled)
        text = dumps(program)
        if len(set(comm.allgather(text))) != 1:
            raise RuntimeError(f"seed {seed}: ranks generated different programs")
        if comm.rank == 0:
            _write(progress, json.dumps({"seed": seed, "program": program}) + "\n", "w")
        verdict = run_program(program, comm)
        counts[verdict["status"]] = counts.get(verdict["status"], 0) + 1
        if verdict["status"] == "fail":
            small = program
            if do_shrink:
                small = shrink(program, lambda p: run_program(p, comm)["status"] == "fail",
                               budget=budget)
                verdict = run_program(small, comm)
            item = {"seed": seed, "ranks": comm.size, "verdict": verdict, "program": small,
                    "actions_before_shrink": len(program["actions"])}
            failures.append(item)
            if comm.rank == 0:
                _write(findings, json.dumps(item) + "\n")
    seconds = time.perf_counter() - t0
    summary = {"ranks": comm.size, "programs": len(seeds), "counts": counts,
               "seconds": round(seconds, 2), "failures": len(failures)}
    if failures and raise_on_failure:
        lines = [f"{len(failures)} of {len(seeds)} programs failed on {comm.size} ranks:"]
        for f in failures:
            lines.append(f"seed {f['seed']}: {f['verdict']['kind']} at action "
                         f"{f['verdict']['step']}: {f['verdict']['message']}\n  replay: "
                         f"{replay_hint(f['program'], comm.size)}")
        raise AssertionError("\n".join(lines))
    return summary


def check_program(program, expect="pass"):
    """Replay one program (a dict or its JSON text); returns its verdict. Raises
    AssertionError (every rank) when the status is not ``expect`` (``"pass"``: any status but
    ``fail``, e.g. ``stopped`` for an agreed refusal of a NaN; None: no check)."""
    if isinstance(program, str):
        program = json.loads(program)
    verdict = run_program(program, MPI.COMM_WORLD)
    bad = verdict["status"] == "fail" if expect == "pass" else verdict["status"] != expect
    if expect is not None and bad:
        raise AssertionError(f"expected {expect}, got {verdict}")
    return verdict
