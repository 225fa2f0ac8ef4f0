"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from siesta.model import cpu_linear


@pytest.fixture
def library():
    """Sets this process's CPU matmul for one test, then puts the engine's choice back."""
    before = cpu_linear.library()
    yield cpu_linear.set_library
    cpu_linear.set_library(before)
