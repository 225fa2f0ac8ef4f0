"""Where a slow engine step spends its wall time: timed phases and sampled stacks.

``PhaseTimer`` wraps named methods and records when each call began and ended.
``host_cpu_seconds`` reads the machine's CPU time by kind (steal: what the hypervisor gave others).
``GcPauses`` records the cyclic garbage collector's runs and how long each held the GIL.
``StackSampler`` looks at one thread's Python stack every few milliseconds from a
thread of its own; a step blocked in a lock, a driver call or on the GIL shows up
as the line it is blocked on (or, for the GIL, as a late sample).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from siesta.tiers.copy_feeder import CopyFeeder

STACK_DEPTH = 4  # innermost frames kept per sample
LONG_GC_MS = 1.0  # a collector run this long or longer is listed with its start


@dataclass
class PhaseTimer:
    calls: list[tuple[str, float, float]] = field(default_factory=list)  # (phase, start, end)
    device_calls: list[tuple[str, float, Any, Any]] = field(default_factory=list)  # (phase, start, events)
    _wrapped: list[tuple[Any, str, Any]] = field(default_factory=list)  # (owner, attr, own value or None)

    def wrap(self, owner: Any, attr: str, phase: str | None = None, device: bool = False) -> None:
        """Time every call of ``owner.attr`` (an instance attribute shadows the method).

        ``device``: also time, on the current CUDA stream, the work the call queued there.
        """
        fn = getattr(owner, attr)
        name = phase or attr

        def timed(*args, **kwargs):
            start = _stream_event() if device else None
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.append((name, t0, time.perf_counter()))
                if start is not None:
                    self.device_calls.append((name, t0, start, _stream_event()))

        own = vars(owner).get(attr)  # an instance attribute (not a method) is put back as it was
        setattr(owner, attr, timed)
        self._wrapped.append((owner, attr, own))

    def unwrap(self) -> None:
        for owner, attr, own in reversed(self._wrapped):
            if own is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)
        self._wrapped.clear()

    def within(self, start: float, end: float) -> dict[str, float]:
        """Seconds per phase of the calls that began in [start, end)."""
        spent: Counter[str] = Counter()
        for name, t0, t1 in self.calls:
            if start <= t0 < end:
                spent[name] += t1 - t0
        return {k: round(v, 5) for k, v in spent.most_common()}

    def device_within(self, start: float, end: float) -> dict[str, float]:
        """Device seconds, per phase, from where a call's work began on its stream to where it
        ended (waiting in the stream included), for the calls that began in [start, end)."""
        spent: Counter[str] = Counter()
        for name, t0, first, last in self.device_calls:
            if start <= t0 < end:
                last.synchronize()
                spent[name] += first.elapsed_time(last) / 1e3
        return {k: round(v, 5) for k, v in spent.most_common()}


class StackSampler:
    """Samples ``thread_id``'s innermost frames every ``interval_s`` while running."""

    def __init__(self, thread_id: int | None = None, interval_s: float = 0.002) -> None:
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.interval_s = interval_s
        self.samples: list[tuple[float, str]] = []
        self.late: list[tuple[float, float]] = []  # (when, seconds past due): the GIL held elsewhere
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="siesta-stack-sampler", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        due = time.perf_counter()
        while not self._stop.is_set():
            due += self.interval_s
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            now = time.perf_counter()
            if now - due > 5 * self.interval_s:
                self.late.append((now, now - due))
            due = max(due, now)
            frame = sys._current_frames().get(self.thread_id)
            if frame is not None:
                self.samples.append((now, _describe(frame)))

    def within(self, start: float, end: float, top: int = 8) -> list[tuple[str, int]]:
        """The most frequent stacks sampled in [start, end), with their counts."""
        return Counter(s for t, s in self.samples if start <= t < end).most_common(top)

    def late_within(self, start: float, end: float) -> list[float]:
        return [round(lag, 4) for t, lag in self.late if start <= t < end]


PROC_STAT = "/proc/stat"
PROC_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def host_cpu_seconds() -> dict[str, float]:
    """Seconds of CPU time by kind, summed over every CPU since boot (empty where there is no
    /proc/stat): differences over a run say whether its CPUs were stolen or busy elsewhere."""
    try:
        with open(PROC_STAT) as f:
            values = f.readline().split()[1:]
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    return {name: int(v) / tick for name, v in zip(PROC_STAT_FIELDS, values)}


def cpu_seconds_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 3) for k in before if k in after}


class GcPauses:
    """The cyclic collector's runs while open, each as (generation, start s from open, ms):
    a full collection walks every tracked object, with the GIL held."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float, float]] = []
        self._t0 = 0.0
        self._started = 0.0

    def __enter__(self) -> Self:
        self._t0 = time.perf_counter()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            self.runs.append((info["generation"], round(self._started - self._t0, 4), round((now - self._started) * 1e3, 2)))

    def summary(self) -> dict[str, Any]:
        """Runs per generation, their total ms, the full collections as (start s, ms), and every
        run of a millisecond or more as (generation, start s, ms), to set beside a timeline."""
        per_gen = {g: [ms for gen, _, ms in self.runs if gen == g] for g in range(3)}
        return {"runs": {g: len(v) for g, v in per_gen.items()}, "total_ms": {g: round(sum(v), 2) for g, v in per_gen.items()},
                "full": [(at, ms) for gen, at, ms in self.runs if gen == 2],
                "long": [run for run in self.runs if run[2] >= LONG_GC_MS]}  # fmt: skip


class LoadTimeline:
    """Each request's tier loads while open, in seconds from ``t0``: submitted to the feeder,
    its first copy issued, its last landed (as the feeder's thread saw them)."""

    def __init__(self, feeder: CopyFeeder, t0: float) -> None:
        self.jobs: dict[str, dict[str, float]] = {}
        self._feeder = feeder
        self._t0 = t0

    def __enter__(self) -> Self:
        self._feeder.trace = self._record
        return self

    def __exit__(self, *exc: object) -> None:
        self._feeder.trace = None

    def _record(self, moment: str, job_id: object, at: float) -> None:
        self.jobs.setdefault(str(job_id), {}).setdefault(moment, round(at - self._t0, 4))


def _stream_event():
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _describe(frame) -> str:
    parts = []
    while frame is not None and len(parts) < STACK_DEPTH:
        code = frame.f_code
        parts.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)
