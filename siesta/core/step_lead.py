"""How long until the step scheduled now starts on the device, under async scheduling.

Step k+1 is scheduled right after step k-1 was read back, which returned when the device
finished k-1 and began k. So the device starts k+1 about one step's device time after that
read-back. The scheduler joins a loading request whose copies are expected to land by then
(``Scheduler.schedule(join_within_s=...)``): without it, a request landing while step k runs
computes first in step k+2, a whole step later (H100 run 55a: the resume's middle request
landed at 200.4 ms and first computed at 216.0).

A step's device time is read off the interval between two read-backs that each had the next
step already queued behind them (the device never idled between them). The shorter of the
last two is taken: a lead too long makes the step wait on the device for a late landing,
with every request in it; one too short only leaves a request for the step after.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

INTERVALS_KEPT = 2


@dataclass
class StepLead:
    last_read_back: float | None = None
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=INTERVALS_KEPT))

    def read_back(self, chained: bool, now: float | None = None) -> None:
        """A step was read back; ``chained``: another step was queued behind it on the device."""
        now = time.perf_counter() if now is None else now
        if not chained:
            self.last_read_back = None
            return
        if self.last_read_back is not None:
            self.intervals.append(now - self.last_read_back)
        self.last_read_back = now

    def seconds(self, now: float | None = None) -> float:
        """The lead of the step scheduled now: 0 when the device would wait for it anyway (no
        step in flight) or nothing has been measured."""
        if self.last_read_back is None or not self.intervals:
            return 0.0
        now = time.perf_counter() if now is None else now
        return max(self.last_read_back + min(self.intervals) - now, 0.0)
