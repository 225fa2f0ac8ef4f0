"""One JSON line per engine step (``EngineConfig.step_trace``): when it started and ended, what
it computed, and how many requests ran, loaded from a tier and waited. A diagnostic for where
a replay's time goes; off unless a path is set, when a step costs one test of it."""

from __future__ import annotations

import json
import time
from typing import IO

from siesta.core.scheduler import Scheduler, SchedulerOutput


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # line-buffered: readable while the engine runs
        self._t0 = time.perf_counter()

    def record(self, start: float, sched: SchedulerOutput | None, scheduler: Scheduler) -> None:
        items = sched.scheduled if sched is not None else []
        decode = sum(1 for item in items if item.num_new_tokens == 1)
        line = {
            "start_s": round(start - self._t0, 6),
            "end_s": round(time.perf_counter() - self._t0, 6),
            "tokens": sum(item.num_new_tokens for item in items),
            "decode_rows": decode,
            "prefill_rows": len(items) - decode,
            "running": len(scheduler.running),
            "loading": len(scheduler.loading),
            "waiting": len(scheduler.waiting),
        }
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
