"""CopyFeeder: the window bound, landing order, coalescing, background top-up, failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from siesta.tiers.copy_feeder import CHUNKS_PER_WINDOW, CopyFeeder

BLOCK_BYTES = 1 << 20
LAND_AFTER_S = 0.002  # how long a fake copy takes


class _Timed:
    """A copy handle that lands a fixed time after it was issued."""

    def __init__(self, delay_s: float) -> None:
        self.at = time.perf_counter() + delay_s

    def query(self) -> bool:
        return time.perf_counter() >= self.at


class _Held:
    """A copy handle that lands only when waited on: what the feeder issues does not depend on
    how fast the machine runs the test (a timed one may land while jobs are still submitted)."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed


class FakeCopier:
    """Records each load's blocks and the bytes in flight when it was issued; copies nothing."""

    cuda = False
    device = torch.device("cpu")

    def __init__(self, fail_on_call: int | None = None, held: bool = False) -> None:
        self.held = held  # handles land when waited on, not after LAND_AFTER_S
        self.calls: list[list[int]] = []
        self.in_flight_at_issue: list[int] = []
        self.handles: list[_Timed] = []
        self.fail_on_call = fail_on_call
        self.lock = threading.Lock()

    def load(self, pieces, kv, after=None):
        return self._record(pieces)

    def store_parts(self, pieces, kv, after=None):
        return self._record(pieces, stored=True)

    def _record(self, pieces, stored: bool = False):
        self.stored = stored
        with self.lock:
            if self.fail_on_call == len(self.calls):
                raise RuntimeError("copy engine on fire")
            flying = sum(len(ids) for (ids, h) in zip(self.calls, self.handles) if not h.query())
            self.in_flight_at_issue.append(flying * BLOCK_BYTES)
            self.calls.append([b for _, ids in pieces for b in ids])
            handle = _Held() if self.held else _Timed(LAND_AFTER_S)
            self.handles.append(handle)
            return handle

    @staticmethod
    def done(handle) -> bool:
        return handle is None or handle.query()

    @staticmethod
    def ready_event(handle):
        return handle

    @staticmethod
    def wait(handle) -> None:
        if isinstance(handle, _Held):
            handle.landed = True
        while not handle.query():
            time.sleep(LAND_AFTER_S / 10)

    @classmethod
    def wait_for(cls, handle, timeout_s: float) -> None:
        if isinstance(handle, _Held):
            handle.landed = True
        deadline = time.perf_counter() + timeout_s
        while not handle.query() and time.perf_counter() < deadline:
            time.sleep(LAND_AFTER_S / 10)


def job(first_block: int, blocks: int, per_part: int = 1) -> list[tuple[torch.Tensor, list[int]]]:
    ids = list(range(first_block, first_block + blocks))
    return [(torch.empty(0), ids[i : i + per_part]) for i in range(0, blocks, per_part)]


@pytest.mark.parametrize("threaded", [False, True])
def test_every_block_goes_out_once_in_order_within_the_window(threaded: bool) -> None:
    copier = FakeCopier()
    window = 16 * BLOCK_BYTES  # chunks of two blocks
    feeder = CopyFeeder(copier, "in", window, BLOCK_BYTES, threaded=threaded)
    jobs = {f"r{i}": job(100 * i, 20 + i) for i in range(5)}
    for rid, parts in jobs.items():
        feeder.submit(rid, parts, kv=None)
    landed: list[str] = []
    deadline = time.perf_counter() + 10
    while len(landed) < len(jobs) and time.perf_counter() < deadline:
        feeder.wait_for_progress(0.01)
        landed += feeder.landed()
    assert landed == list(jobs), "jobs land in submission order"
    issued = [b for call in copier.calls for b in call]
    assert issued == [b for parts in jobs.values() for _, ids in parts for b in ids]
    assert max(copier.in_flight_at_issue) < window, "a chunk only goes out while the window has room"
    assert all(len(call) * BLOCK_BYTES <= feeder.chunk_bytes for call in copier.calls)
    assert not feeder.busy()


def test_the_thread_tops_the_window_up_without_the_caller() -> None:
    copier = FakeCopier()
    feeder = CopyFeeder(copier, "in", 4 * BLOCK_BYTES, BLOCK_BYTES, threaded=True)
    feeder.submit("r0", job(0, 64), kv=None)
    deadline = time.perf_counter() + 10
    while len(copier.calls) < 64 // (feeder.chunk_bytes // BLOCK_BYTES) and time.perf_counter() < deadline:
        time.sleep(LAND_AFTER_S)  # no landed()/wait calls: only the feeder thread issues
    assert sum(len(c) for c in copier.calls) == 64
    time.sleep(2 * LAND_AFTER_S)
    assert feeder.landed() == ["r0"]


def test_unthreaded_feeder_waits_for_the_caller() -> None:
    copier = FakeCopier()
    feeder = CopyFeeder(copier, "in", 4 * BLOCK_BYTES, BLOCK_BYTES, threaded=False)
    feeder.submit("r0", job(0, 64), kv=None)
    issued = sum(len(c) for c in copier.calls)
    time.sleep(5 * LAND_AFTER_S)
    assert sum(len(c) for c in copier.calls) == issued == 4, "one window, then nothing until polled"
    feeder.drain()
    assert sum(len(c) for c in copier.calls) == 64
    assert feeder.landed() == ["r0"]


def test_a_part_larger_than_a_chunk_goes_out_whole() -> None:
    copier = FakeCopier()
    feeder = CopyFeeder(copier, "in", 8 * BLOCK_BYTES, BLOCK_BYTES, threaded=False)
    feeder.submit("r0", job(0, 12, per_part=6), kv=None)
    feeder.drain()
    assert copier.calls == [list(range(6)), list(range(6, 12))]


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failed_copy_is_reported_to_the_caller(threaded: bool) -> None:
    copier = FakeCopier(fail_on_call=1)
    feeder = CopyFeeder(copier, "in", 2 * BLOCK_BYTES, BLOCK_BYTES, threaded=threaded)
    with pytest.raises(RuntimeError):
        feeder.submit("r0", job(0, 16), kv=None)
        feeder.drain()


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window"):
        CopyFeeder(FakeCopier(), "in", 0, BLOCK_BYTES, threaded=False)


def test_small_jobs_queued_behind_a_full_window_share_a_call() -> None:
    copier = FakeCopier(held=True)
    window_blocks = 4 * CHUNKS_PER_WINDOW  # chunks of 4 blocks
    feeder = CopyFeeder(copier, "out", window_blocks * BLOCK_BYTES, BLOCK_BYTES, threaded=False)
    jobs = [("entry", i) for i in range(30)]
    for i, job_id in enumerate(jobs):
        feeder.submit(job_id, job(10 * i, 2), kv=None)
    alone = window_blocks // 2
    assert [len(call) for call in copier.calls] == [2] * alone, "alone while the window has room"
    feeder.drain()
    assert copier.stored, "stores go through the copier's store path"
    assert [len(call) for call in copier.calls[alone:]] == [4] * ((30 - alone) // 2), "then two queued jobs per call"
    assert feeder.landed() == jobs


def test_jobs_submitted_without_issue_go_out_together() -> None:
    copier = FakeCopier()
    feeder = CopyFeeder(copier, "out", 16 * CHUNKS_PER_WINDOW * BLOCK_BYTES, BLOCK_BYTES, threaded=False)  # chunks of 16
    for i in range(6):
        feeder.submit(i, job(10 * i, 4), kv=None, issue=False)
    assert copier.calls == []
    feeder.drain()
    assert [len(call) for call in copier.calls] == [16, 8]
    assert feeder.landed() == list(range(6))


def _owner(block: int) -> int:
    return block // 100  # job i's blocks are 100 * i + k (see ``job``)


def test_queued_jobs_land_one_after_another_each_as_soon_as_its_own_copies_land() -> None:
    # Several requests' loads queued at once (a resume): each job's copies go out before any
    # of the next job's, no call that lands a job carries part of a later one, and a job is
    # reported the moment the call with its last copy lands, not when later jobs' copies do.
    copier = FakeCopier(held=True)
    window = 8 * BLOCK_BYTES  # chunks of two blocks, four in flight
    feeder = CopyFeeder(copier, "in", window, BLOCK_BYTES, threaded=False)
    # Parts of one or two blocks: a job's one-block tail could share a call with the one-block
    # head of the next (a part of one, then one of two, which does not fit beside it).
    parts = [[1, 1, 1, 1, 1], [1, 2], [1], [2, 1], [1, 2, 2], [1], [1]]
    sizes = [sum(p) for p in parts]
    for i, part_sizes in enumerate(parts):
        firsts = [100 * i + sum(part_sizes[:k]) for k in range(len(part_sizes))]
        feeder.submit(i, [(torch.empty(0), list(range(f, f + n))) for f, n in zip(firsts, part_sizes)], kv=None)
    last_block = {i: 100 * i + blocks - 1 for i, blocks in enumerate(sizes)}
    reported: list[int] = []
    landed_calls = 0
    while len(reported) < len(sizes):
        assert landed_calls < len(copier.calls), "every job lands once its calls have"
        copier.handles[landed_calls].landed = True  # the oldest call in flight lands
        landed_calls += 1
        reported += feeder.landed()
        done = {_owner(b) for call in copier.calls[:landed_calls] for b in call if b == last_block[_owner(b)]}
        assert sorted(reported) == sorted(done), "a job is reported as soon as its last copy lands"
    assert reported == list(range(len(sizes))), "jobs land in submission order"
    issued = [b for call in copier.calls for b in call]
    assert issued == [b for i, blocks in enumerate(sizes) for b in range(100 * i, 100 * i + blocks)]
    for call in copier.calls:
        owners = [_owner(b) for b in call]
        for i in set(owners):
            if last_block[i] in call:  # the call lands job i: nothing after it but whole jobs
                later = {j for j in owners if j > i}
                assert all(last_block[j] in call for j in later), f"call {call} holds job {i} back"
    assert max(copier.in_flight_at_issue) < window, "the window still bounds the bytes in flight"
    assert feeder.pending_bytes == 0 and not feeder.busy()


def test_pending_bytes_count_queued_and_in_flight_copies_until_they_land() -> None:
    copier = FakeCopier(held=True)
    feeder = CopyFeeder(copier, "in", 4 * BLOCK_BYTES, BLOCK_BYTES, threaded=False)
    feeder.submit("r0", job(0, 10), kv=None)
    feeder.submit("r1", job(100, 3), kv=None)
    assert feeder.pending_bytes == 13 * BLOCK_BYTES  # one window issued, the rest queued
    copier.handles[0].landed = True
    feeder.landed()
    assert feeder.pending_bytes == (13 - len(copier.calls[0])) * BLOCK_BYTES
    feeder.drain()
    assert feeder.landed() == ["r0", "r1"]
    assert feeder.pending_bytes == 0


def test_busy_seconds_run_from_a_call_s_issue_to_its_landing_and_leave_idle_time_out() -> None:
    copier = FakeCopier(held=True)
    feeder = CopyFeeder(copier, "in", 16 * BLOCK_BYTES, BLOCK_BYTES, threaded=False)  # a job: one call
    assert feeder.busy_seconds == 0.0
    t0 = time.perf_counter()
    feeder.submit("r0", job(0, 2), kv=None)
    time.sleep(0.05)
    assert 0.05 <= feeder.busy_seconds, "a copy in flight counts while it flies"
    copier.handles[0].landed = True
    assert feeder.landed() == ["r0"]
    first = feeder.busy_seconds
    assert 0.05 <= first <= time.perf_counter() - t0
    time.sleep(0.05)
    assert feeder.busy_seconds == first, "nothing in flight: the idle time is not counted"
    t1 = time.perf_counter()
    feeder.submit("r1", job(10, 2), kv=None)
    feeder.drain()
    assert feeder.landed() == ["r1"]
    assert first < feeder.busy_seconds <= first + (time.perf_counter() - t1)


def test_issuing_tier_copies_marks_the_device_busy(monkeypatch) -> None:
    """The weights' sleep backup is pinned only while the device has no work: tier copies count."""
    from siesta.device_activity import ActivityClock
    from siesta.tiers import copy_feeder

    clock = ActivityClock()
    monkeypatch.setattr(copy_feeder, "DEVICE_WORK", clock)
    feeder = CopyFeeder(FakeCopier(), "out", 4 * BLOCK_BYTES, BLOCK_BYTES, threaded=False)
    assert clock.quiet_in(60.0) == 0.0
    feeder.submit("r0", job(0, 2), kv=None)
    feeder.wait_for_progress(0.01)
    assert clock.quiet_in(60.0) > 59.0


class FakeClock:
    """``time.perf_counter`` for the feeder, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def _timed_feeder(monkeypatch, jobs: int) -> tuple[FakeClock, FakeCopier, CopyFeeder]:
    """A feeder on a fake clock with ``jobs`` jobs of one call (4 blocks) each submitted, at
    most four calls in flight."""
    from siesta.tiers import copy_feeder

    clock = FakeClock()
    monkeypatch.setattr(copy_feeder, "time", clock)
    copier = FakeCopier(held=True)
    feeder = CopyFeeder(copier, "in", 16 * BLOCK_BYTES, BLOCK_BYTES, threaded=False)
    for i in range(jobs):
        feeder.submit(f"r{i}", job(10 * i, 4), kv=None)
    return clock, copier, feeder


def _land_first_call(clock: FakeClock, copier: FakeCopier, feeder: CopyFeeder) -> list[object]:
    clock.now += 0.010  # the first call moves 4 blocks in 10 ms
    copier.handles[0].landed = True
    return feeder.landed()  # the next call goes out as it lands


def test_jobs_landing_within_a_horizon_are_predicted_from_the_rate_calls_landed_at(monkeypatch) -> None:
    clock, copier, feeder = _timed_feeder(monkeypatch, 6)
    assert len(copier.calls) == 4, "a window of four calls in flight, two jobs queued"
    assert feeder.landing_within(1.0) == [], "no call has landed: no rate to predict with"
    assert _land_first_call(clock, copier, feeder) == ["r0"]
    clock.now += 0.004  # r1, now the head, has been moving 4 of its 10 ms
    lands = feeder.landing_within(0.0165)
    assert [job_id for job_id, _ in lands] == ["r1", "r2"], "r1 in 6 ms, r2 in 16, r3 in 26"
    assert [event for _, event in lands] == copier.handles[1:3], "each job's own call's event"
    assert [job_id for job_id, _ in feeder.landing_within(1.0)] == ["r1", "r2", "r3", "r4"], "r5 is not issued"


def test_a_call_the_issuing_thread_has_not_issued_yet_stops_the_prediction(monkeypatch) -> None:
    clock, copier, feeder = _timed_feeder(monkeypatch, 3)
    _land_first_call(clock, copier, feeder)
    monkeypatch.setattr(copier, "ready_event", lambda handle: None if handle is copier.handles[2] else handle)
    assert [job_id for job_id, _ in feeder.landing_within(1.0)] == ["r1"]
