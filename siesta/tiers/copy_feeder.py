"""Tier copies issued through a bounded window, refilled as chunks land.

A copy queue holding gigabytes delays the step's own small copies in the same
direction (inputs in, sampled tokens out) until all of it has moved, so tier
copies go out a window at a time. Refilling that window only between engine
steps leaves the link idle whenever a step outlasts the window's transfer time
(H200: 256 MiB moves in 4.9 ms while a decode step of the 8B model takes ~9 ms;
a 16-request resume then loaded at 28 of 55 GB/s). A threaded feeder therefore
waits for the oldest chunk in a thread of its own and issues the next one as
soon as it lands. Unthreaded, the caller's polls drive it: the connector's
stores (a step's worth at a time; a thread would take the GIL from the steps),
and everything on CPU, where a copy is done when issued.

Jobs go out in submission order, chunk after chunk, so a job's copies all land before
those of the next one (a later job overlaps only the window's tail of an earlier one):
a resume of N requests lands the first request's KV after its own bytes, not after
nearly all N requests' bytes. A call that lands a job never carries part of a later
one, whose bytes would hold it back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from siesta.attention.base import KVCache
from siesta.device_activity import DEVICE_WORK
from siesta.tiers.transfer import BlockCopier, CopyHandle

logger = logging.getLogger(__name__)

# How much each landed call moves the link rate the feeder predicts landings at: a few calls
# (a few ms of link) settle it, one late wake-up of the thread does not.
RATE_WEIGHT = 0.25

# A window is issued in this many chunks: the feeder tops it up one chunk at a time,
# so a late wake-up (the GIL held by the step loop, up to its 5 ms switch interval)
# still finds the rest of it queued. Fewer, larger chunks wake the thread less often.
CHUNKS_PER_WINDOW = 4

# Host rows and the device block ids they pair with, row i with block_ids[i].
CopyPart = tuple[torch.Tensor, Sequence[int]]
Direction = Literal["in", "out"]  # into the device cache (loads) or out of it (stores)
# Told each job's moments, from the thread that sees them: "submitted", "issued" (its first
# chunk), "landed" (its last); with the job id and time.perf_counter().
CopyTrace = Callable[[str, object, float], None]


@dataclass
class _Chunk:
    job_id: object
    parts: list[CopyPart]
    nbytes: int
    last: bool  # its landing lands the whole job (chunks land in issue order)
    kv: KVCache
    after: torch.cuda.Event | None  # compute the copies wait for


@dataclass
class _Issued:
    chunks: list[_Chunk]  # queued chunks of several small jobs go out in one call
    handle: CopyHandle
    issued_at: float  # time.perf_counter()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


class CopyFeeder:
    def __init__(self, copier: BlockCopier, direction: Direction, window_bytes: int, block_bytes: int,
                 threaded: bool) -> None:  # fmt: skip
        if window_bytes <= 0:
            raise ValueError("copy window must be positive")
        self.copier = copier
        self.direction = direction
        self.window_bytes = window_bytes
        self.block_bytes = block_bytes
        self.chunk_bytes = max(block_bytes, window_bytes // CHUNKS_PER_WINDOW)
        self._lock = threading.Condition()
        self._queue: deque[_Chunk] = deque()
        self._issued: deque[_Issued] = deque()
        self._issued_bytes = 0
        self._queued_bytes = 0
        self._landed: list[object] = []
        self._error: BaseException | None = None
        self.trace: CopyTrace | None = None  # a bench's timeline; None costs a test per call
        # Wall seconds with copies in flight: bytes over this is the link's rate while copying,
        # not diluted by the idle time between resumes.
        self._busy_s = 0.0
        self._busy_since: float | None = None
        # The link as this feeder sees it: when the oldest call in flight began to move (its
        # issue, or the landing of the call before it), and bytes a second over landed calls.
        self._head_since: float | None = None
        self._bytes_per_s: float | None = None
        if threaded:
            device = copier.device
            if device.type == "cuda" and device.index is None:  # the thread's own default is device 0
                device = torch.device("cuda", torch.cuda.current_device())
            name = f"siesta-copy-{direction}"
            threading.Thread(target=self._feed, args=(device,), name=name, daemon=True).start()

    # -- caller side -------------------------------------------------------------------------

    def submit(self, job_id: object, parts: Sequence[CopyPart], kv: KVCache, issue: bool = True,
               after: torch.cuda.Event | None = None) -> None:  # fmt: skip
        """Queue one job's copies; ``landed`` reports ``job_id`` once all of them have landed.

        ``issue=False`` leaves them queued for the next ``landed``/``drain``, so that jobs
        submitted together go out in as few calls as the chunk size allows. ``after``:
        a ``compute_mark`` several jobs submitted together may share.
        """
        if after is None:
            after = self.compute_mark()
        chunks = self._split(job_id, list(parts), kv, after)
        if self.trace is not None:
            self.trace("submitted", job_id, time.perf_counter())
        with self._lock:
            self._queue.extend(chunks)
            self._queued_bytes += sum(c.nbytes for c in chunks)
            if issue:
                self._pump()
            self._lock.notify_all()

    def compute_mark(self) -> torch.cuda.Event | None:
        """The copier's ``compute_mark``; None on CPU, where copies are done when issued."""
        return self.copier.compute_mark() if self.copier.cuda else None

    def _split(self, job_id: object, parts: list[CopyPart], kv: KVCache, after) -> list[_Chunk]:
        chunks: list[_Chunk] = []
        current: list[CopyPart] = []
        nbytes = 0
        for part in parts:
            size = len(part[1]) * self.block_bytes
            if current and nbytes + size > self.chunk_bytes:
                chunks.append(_Chunk(job_id, current, nbytes, False, kv, after))
                current, nbytes = [], 0
            current.append(part)
            nbytes += size
        chunks.append(_Chunk(job_id, current, nbytes, True, kv, after))
        return chunks

    def landed(self) -> list[object]:
        """Jobs whose copies all landed since the last call, in submission order."""
        with self._lock:
            self._raise_error()
            self._pump()
            landed, self._landed = self._landed, []
        return landed

    @property
    def pending_bytes(self) -> int:
        """Bytes submitted and not landed yet: queued, or issued and in flight."""
        with self._lock:
            return self._issued_bytes + self._queued_bytes

    def landing_within(self, horizon_s: float) -> list[tuple[object, Any]]:
        """Jobs whose last copies are issued and, at the rate calls have landed at so far, land
        within ``horizon_s`` from now: (job id, the event their landing records), in landing
        order. Calls move one after another on the copy stream, so a call lands once those
        before it have."""
        with self._lock:
            self._raise_error()
            self._pump()
            if not self._bytes_per_s or not self._issued:
                return []
            now = time.perf_counter()
            lands_in = self._head_since - now  # the head call has been moving this long
            jobs: list[tuple[object, Any]] = []
            for call in self._issued:
                lands_in += call.nbytes / self._bytes_per_s
                event = self.copier.ready_event(call.handle)
                if lands_in > horizon_s or event is None:
                    break
                jobs.extend((c.job_id, event) for c in call.chunks if c.last)
            return jobs

    def busy(self) -> bool:
        with self._lock:
            return bool(self._queue or self._issued or self._landed)

    @property
    def busy_seconds(self) -> float:
        """Wall seconds so far with copies in flight, from a call's issue to its landing as
        this feeder saw it: at once in the thread; unthreaded, at the caller's next poll."""
        with self._lock:
            open_s = 0.0 if self._busy_since is None else time.perf_counter() - self._busy_since
            return self._busy_s + open_s

    def wait_for_progress(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` (releasing the GIL) for the oldest chunk in flight."""
        with self._lock:
            oldest = self._issued[0].handle if self._issued else None
        if oldest is not None:
            self.copier.wait_for(oldest, timeout_s)

    def drain(self) -> None:
        """Issue and land everything queued; ``landed`` still reports the jobs."""
        while True:
            with self._lock:
                self._raise_error()
                self._pump()
                if not self._issued:
                    return
                oldest = self._issued[0].handle
            self.copier.wait(oldest)

    # -- the window --------------------------------------------------------------------------

    def _pump(self) -> None:
        """Retire landed chunks and issue while the window has room (lock held)."""
        while True:
            while self._issued and self.copier.done(self._issued[0].handle):
                self._retire(self._issued.popleft())
            if not self._issued and self._busy_since is not None:
                self._busy_s += time.perf_counter() - self._busy_since
                self._busy_since = None
            if not self._queue or self._issued_bytes >= self.window_bytes:
                return
            chunks = [self._queue.popleft()]
            while self._queue and self._joins_call(chunks, self._queue[0]):
                chunks.append(self._queue.popleft())
            nbytes = sum(c.nbytes for c in chunks)
            self._queued_bytes -= nbytes
            now = time.perf_counter()
            if self._busy_since is None:
                self._busy_since = now  # before the issue: on CPU the copy runs in it
            if not self._issued:
                self._head_since = now
            self._issued.append(_Issued(chunks, self._issue(chunks), now))
            self._issued_bytes += nbytes
            if self.trace is not None:
                _trace_issued(self.trace, chunks)

    def _joins_call(self, chunks: list[_Chunk], nxt: _Chunk) -> bool:
        """Whether queued chunk ``nxt`` goes out in the same call as ``chunks``: if it fits in
        a chunk's bytes, and does not hold back a job that call lands (small jobs, each whole,
        may share a call; the head of a large one waits for the next)."""
        if sum(c.nbytes for c in chunks) + nxt.nbytes > self.chunk_bytes:
            return False
        return nxt.last or not chunks[-1].last

    def _issue(self, chunks: list[_Chunk]) -> CopyHandle:
        DEVICE_WORK.touch()  # no backup pinning beside tier copies (its driver lock)
        parts = [part for c in chunks for part in c.parts]
        # Queued in submission order on one compute stream: the last chunk's event comes last.
        kv, after = chunks[-1].kv, chunks[-1].after
        if self.direction == "in":
            return self.copier.load(parts, kv, after=after)
        return self.copier.store_parts(parts, kv, after=after)

    def _retire(self, issued: _Issued) -> None:
        """The oldest call landed (already off ``_issued``)."""
        self._issued_bytes -= issued.nbytes
        now = time.perf_counter()
        self._measure_rate(issued.nbytes, now)
        self._head_since = max(self._issued[0].issued_at, now) if self._issued else None
        landed = [c.job_id for c in issued.chunks if c.last]
        self._landed.extend(landed)
        if self.trace is not None:
            for job_id in landed:
                self.trace("landed", job_id, now)

    def _measure_rate(self, nbytes: int, landed_at: float) -> None:
        moved_s = landed_at - self._head_since if self._head_since is not None else 0.0
        if moved_s <= 0:
            return
        rate = nbytes / moved_s
        last = self._bytes_per_s
        self._bytes_per_s = rate if last is None else last + RATE_WEIGHT * (rate - last)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"tier copies ({self.direction}) failed") from self._error

    def _feed(self, device: torch.device) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the driver calls below need this thread's context
            while True:
                with self._lock:
                    self._pump()
                    while not self._issued:
                        self._lock.wait()
                        self._pump()
                    oldest = self._issued[0].handle
                self.copier.wait(oldest)
        except BaseException as e:  # reported to the step loop, which owns the requests
            logger.exception("tier copy feeder (%s) stopped", self.direction)
            with self._lock:
                self._error = e


def _trace_issued(trace: CopyTrace, chunks: list[_Chunk]) -> None:
    now = time.perf_counter()
    for job_id in dict.fromkeys(c.job_id for c in chunks):
        trace("issued", job_id, now)  # told again for a job's later chunks: a reader keeps the first
