"""When this process last put work on its device: background host work that holds the CUDA
driver's lock (pinning the weights' sleep backup, ``core/host_backup.py``) waits for a quiet
spell. Below everything that does device work (the model runner's steps, the tiers' copies,
weight pushes), so each can mark it without importing the others."""

from __future__ import annotations

import math
import time


class ActivityClock:
    """The time of the last mark."""

    def __init__(self) -> None:
        self._last = -math.inf

    def touch(self) -> None:
        self._last = time.monotonic()

    def quiet_in(self, quiet_s: float) -> float:
        """Seconds until ``quiet_s`` will have passed without a mark (0: already)."""
        return max(0.0, self._last + quiet_s - time.monotonic())


DEVICE_WORK = ActivityClock()  # this process's: steps launched, tier copies issued, weights written
