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
