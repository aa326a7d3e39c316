"""Regression programs: shrunk findings of the fuzzer, replayed by tests/test_fuzz.py.

Each entry: ``feature`` (the :data:`~tests.fuzz.program.KNOWN_BROKEN_ON_MAIN` name the program
needs, or None), ``issue`` (issue 22 item), ``ranks`` and the ``program``. An entry whose
feature is still in ``KNOWN_BROKEN_ON_MAIN`` is skipped; once the fix is merged and the name
removed from that set, the program must give the verdict ``ok``.
"""
REGRESSIONS = []
