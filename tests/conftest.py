"""Test isolation shared by every room: a test that sets torch's default dtype (many build
float64 networks in-process) must not change it for the tests after it (found when the rooms
changed the test order: a float64 default left behind broke an autocast check)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


def pytest_collection_finish(session):
    """The MPI harness joins the shared batches of these files into one job per rank count."""
    from tests import mpi_harness

    mpi_harness.select_modules({item.module.__name__ for item in session.items
                                if getattr(item, "module", None) is not None
                                and item.get_closest_marker("slow") is not None})
