"""Running an oracle on one torch thread (and restoring the setting after)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One thread, as the test servers run: on two cores that other test processes keep busy, two
    OpenMP threads on a forward of a few dozen rows spin on each other (SmolLM2 through
    transformers: 5.4 s against 0.55)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
