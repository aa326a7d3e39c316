"""Hypothesis on one rank (in-process, ``COMM_SELF``): the program generator of
:mod:`tests.fuzz.program` fed by ``data.draw`` instead of a seeded RNG, so Hypothesis generates,
shrinks (towards the first choice of each ``pick``, the low end of each ``int``, fewer actions)
and replays programs with its own database and ``derandomize`` for a fixed CI budget.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from mpi4py import MPI

from .executor import run_program
from .program import default_features, dumps, generate


class HypothesisChooser:
    """The chooser interface of :func:`tests.fuzz.program.generate` over ``st.data()``."""

    def __init__(self, data):
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def pick(self, seq):
        return self.data.draw(st.sampled_from(list(seq)))

    def bool(self, p: float = 0.5) -> bool:  # shrinks towards False
        return self.data.draw(st.integers(0, 99)) >= round(100 * (1 - p))


def fuzz_one_rank(max_examples: int, enabled=None, derandomize: bool = True):
    """A test function (call it) running ``max_examples`` generated programs on one rank; a
    failing program is shrunk by Hypothesis and reported with its JSON and replay command.
    ``enabled``: default :func:`~tests.fuzz.program.default_features` for CI."""
    enabled = default_features(ci=True) if enabled is None else frozenset(enabled)
    @settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(st.data())
    def run(data):
        program = generate(HypothesisChooser(data), enabled)
        note(f"program: {dumps(program)}")
        verdict = run_program(program, MPI.COMM_SELF)
        assert verdict["status"] != "fail", (
            f"{verdict['kind']} at action {verdict['step']}: {verdict['message']}\n  replay: "
            f"python -m tests.fuzz replay --ranks 1 '{dumps(program)}'")
    return run
