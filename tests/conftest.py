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
