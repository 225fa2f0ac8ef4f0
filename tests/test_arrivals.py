"""Arrival counters (``siesta/arrivals.py``): one zeroed buffer a device, never made inside a
capture, and none for a launch of more groups than it holds. Their kernels' use is tested where
they are used (the fused decode merge, the split down-and-sum): the same bits as the separate
closing, and every counter zero after."""

from __future__ import annotations

import pytest
import torch

from siesta import arrivals

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arrivals, "_counters", {})


def test_a_device_gets_one_zeroed_buffer_and_keeps_it() -> None:
    first = arrivals.counters(CPU, 3)
    assert first.dtype == torch.int32 and first.numel() == arrivals.SLOTS and first.count_nonzero() == 0
    assert arrivals.counters(CPU, arrivals.SLOTS) is first


def test_a_launch_of_more_groups_than_the_slots_closes_them_apart() -> None:
    assert arrivals.counters(CPU, arrivals.SLOTS + 1) is None
    assert CPU not in arrivals._counters


def test_a_capture_never_makes_them(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Memory taken during a capture is the graph's and would not stay zeroed between replays."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert arrivals.counters(torch.device("cuda", 0), 1) is None
    assert not arrivals._counters and "closed apart" in caplog.text
