"""The bench's probes: phase timing that restores what it wrapped, and a stack sampler that
sees where a blocked thread is waiting."""

from __future__ import annotations

import gc
import time

from siesta.bench.probes import GcPauses, PhaseTimer, StackSampler, cpu_seconds_between, host_cpu_seconds


class Worker:
    def __init__(self) -> None:
        self.helper = lambda x: x + 1  # an instance attribute, not a method

    def work(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"


def test_phases_are_timed_and_everything_wrapped_is_put_back() -> None:
    worker, timer = Worker(), PhaseTimer()
    helper = worker.helper
    timer.wrap(worker, "work")
    timer.wrap(worker, "helper", "plus_one")
    t0 = time.perf_counter()
    assert worker.work(0.02) == "done" and worker.helper(1) == 2
    spent = timer.within(t0, time.perf_counter())
    assert set(spent) == {"work", "plus_one"}
    assert 0.02 <= spent["work"] < 1.0
    assert timer.within(0.0, t0) == {}  # calls outside the window are not counted
    timer.unwrap()
    assert "work" not in vars(worker)  # the class's method again
    assert worker.helper is helper


def _blocked_here(seconds: float) -> None:
    time.sleep(seconds)


def test_the_sampler_sees_the_line_a_thread_waits_on() -> None:
    with StackSampler(interval_s=0.002) as sampler:
        t0 = time.perf_counter()
        _blocked_here(0.1)
        t1 = time.perf_counter()
    stacks = sampler.within(t0, t1)
    assert stacks, "no samples taken"
    top, count = stacks[0]
    assert "_blocked_here" in top.split(" < ")[0] and count >= 10


def test_gc_pauses_record_each_collection_by_generation() -> None:
    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    after = len(pauses.runs)
    gc.collect(2)  # closed: not recorded
    assert [gen for gen, _, _ in pauses.runs] == [0, 2] and len(pauses.runs) == after
    summary = pauses.summary()
    assert summary["runs"] == {0: 1, 1: 0, 2: 1}
    assert summary["full"] == [(pauses.runs[1][1], pauses.runs[1][2])] and pauses.runs[1][2] >= 0


def test_host_cpu_seconds_count_up_by_kind_while_this_process_computes() -> None:
    before = host_cpu_seconds()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    spent = cpu_seconds_between(before, host_cpu_seconds())
    assert set(spent) >= {"user", "system", "idle", "steal"}
    assert spent["user"] + spent["system"] >= 0.1, "the busy loop's CPU time is among the machine's"
    assert all(v >= 0 for v in spent.values())
