"""One ``experiments/regenerate.py --quick`` run for the whole session (issue 39 item 4): the
``quick`` fixture runs, once, every script named in the ``QUICK`` list of a module whose
selected tests use it (``test_experiments_a``/``_b``, ``test_plan_unseen``,
``test_time_to_target``), two at a time, instead of one run per module."""
from __future__ import annotations

import pytest

from tests.experiments.regenerate_quick import run_quick


@pytest.fixture(scope="session")
def quick(request, tmp_path_factory):
    """:class:`~tests.experiments.regenerate_quick.QuickRun` of the selected tests' scripts."""
    only = []
    for item in request.session.items:
        if "quick" in getattr(item, "fixturenames", ()):
            only += [n for n in getattr(item.module, "QUICK", ()) if n not in only]
    return run_quick(tmp_path_factory, only)
