"""Host memory for the weights' level-1 sleep backup, made ready before the first sleep.

Pinned memory from ``cudaHostAlloc`` (torch's ``pin_memory=True``) is slow to make: for the
8B shape's 16 GB the first sleep of a process spent 7.7-11 s in it, later ones 0.4 s. Here the
buffer is a plain allocation that a background thread, started once the engine is built, first
touches page by page (no driver call, so nothing else waits) and then pins in chunks with
``cudaHostRegister``. A sleep waits only for what is left of that work.

CUDA graph capture in global mode fails, and invalidates the capture, when another thread
makes a call such as registering host memory meanwhile. Every chunk is registered under
``CAPTURE_LOCK``, which the model runner holds while it captures; each chunk is small, so a
capture waits at most one chunk's registration.

Copies never span two chunks: each chunk is its own registration, and a copy that crossed
from one into the next could be taken for pageable memory by the driver.

Pinning waits for the device to be quiet. ``cudaHostRegister`` holds the driver's lock while it
pins, and every launch, event query and copy of a step waits for that lock: on an H100, batch-1
decode of the 8B shape took 8.3 ms a step while its 16 GB were pinned, 5.8 ms before and after
(run 50; the MoE shape's 61 GB kept it slow for half a minute). So a chunk starts only once no
step has been launched, no tier copy issued and no weight written for ``QUIET_S``
(``device_activity.DEVICE_WORK``, touched by each of them, on every rank), and a
sleep that needs the backup pins the rest at once: an engine that never idles before its first
sleep pays there, as ``first_sleep`` does, and never in its steps.

A backup closed, or a process exiting, while its chunks are still being pinned stops the
thread at the next chunk and waits for it. Left running, the thread was inside the CUDA
runtime as the process tore it down, and such a process aborted at exit ("terminate called
without an active exception") when it ended within seconds of starting an engine.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref

import torch

from siesta.device_activity import DEVICE_WORK, ActivityClock
from siesta.pinned import Pinner, Unpinner

logger = logging.getLogger(__name__)

# Small enough that a step launched while a chunk is pinned waits for one chunk only (~30 ms),
# and so does a capture waiting on the lock; a 16 GB backup is 256 driver calls.
PIN_CHUNK_BYTES = 64 << 20
# Seconds without a step launched (or a weight written) before background pinning goes on.
QUIET_S = 0.5
CAPTURE_LOCK = threading.Lock()

_PINNING: weakref.WeakSet[HostBackup] = weakref.WeakSet()  # those whose thread may still run


class _Stopped(Exception):
    """The backup was stopped before all of it was made."""


class HostBackup:
    """``nbytes`` of host memory in chunks, pinned by ``pinner`` (None: plain memory).

    With ``background`` the memory is made in a thread started here; else by the first
    ``wait``. ``store``/``load`` copy a flat uint8 tensor in or out at a byte offset.
    """

    def __init__(self, nbytes: int, pinner: tuple[Pinner, Unpinner] | None, background: bool,
                 chunk_bytes: int = PIN_CHUNK_BYTES, steps: ActivityClock = DEVICE_WORK,
                 quiet_s: float | None = None) -> None:  # fmt: skip
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.nbytes = nbytes
        self.chunk_bytes = chunk_bytes
        self._pin, self._unpin = pinner if pinner is not None else (None, None)
        self._buffer: torch.Tensor | None = None  # set once all of it is made
        self._made: torch.Tensor | None = None  # kept alive while any of it is pinned
        self._pinned: list[int] = []  # addresses registered, to unregister at close
        self._error: BaseException | None = None
        self.prepare_s = 0.0  # how long making the memory took
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._steps = steps
        self._quiet_s = QUIET_S if quiet_s is None else quiet_s  # read now: a bench sets it per arm
        self._hurry = threading.Event()  # someone waits for the backup: pin without waiting for quiet
        if background:
            self._thread = threading.Thread(target=self._prepare, name="siesta-host-backup", daemon=True)
            _PINNING.add(self)
            self._thread.start()

    @property
    def pinned(self) -> bool:
        return self._pin is not None

    def settle(self) -> None:
        """Let background work finish, without making the memory if nobody started it."""
        if self._thread is not None:
            self._hurry.set()
            # The thread holds the backup while it runs, so its end may drop the last reference
            # and run the finalizer (close) in the thread itself, whose work is then done.
            if self._thread is not threading.current_thread():
                self._thread.join()
            self._thread = None

    def stop(self) -> None:
        """End background work at the next chunk (what it made stays, to be released)."""
        self._stop.set()
        self._hurry.set()  # a thread waiting for quiet wakes and sees the stop
        self.settle()

    @property
    def ready(self) -> bool:
        return self._buffer is not None and (self._thread is None or not self._thread.is_alive())

    def wait(self) -> float:
        """Make sure the memory exists; returns the seconds spent waiting for (or making) it."""
        t0 = time.perf_counter()
        if self._stop.is_set():
            raise RuntimeError("the host backup was closed")
        self.settle()
        if self._buffer is None or self._error is not None:
            if self._error is not None:  # pinning failed in the background: pin the way torch does
                logger.warning("the background host backup failed (%s); allocating it now", self._error)
                self._release()
                self._error = None
                self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
            else:
                self._prepare()
                if self._error is not None:
                    raise self._error
        return time.perf_counter() - t0

    def _prepare(self) -> None:
        t0 = time.perf_counter()
        try:
            buffer = self._made = torch.empty(self.nbytes, dtype=torch.uint8)
            for start in range(0, self.nbytes, self.chunk_bytes):
                self._wait_for_quiet()
                if self._stop.is_set():
                    raise _Stopped
                chunk = buffer[start : start + self.chunk_bytes]
                chunk.zero_()  # the pages exist before the driver is asked to pin them
                if self._pin is not None:
                    with CAPTURE_LOCK:
                        self._pin(chunk.data_ptr(), chunk.numel())
                    self._pinned.append(chunk.data_ptr())
            self._buffer = buffer
        except BaseException as e:  # noqa: BLE001 - reported by wait(), which falls back
            self._error = e
        self.prepare_s = time.perf_counter() - t0

    def _wait_for_quiet(self) -> None:
        """In the background thread: until the device has had no work for ``quiet_s``, or someone
        waits for the backup (or stops it)."""
        if threading.current_thread() is not self._thread:
            return  # the caller makes it itself: it waits for it now
        while not self._hurry.is_set():
            left = self._steps.quiet_in(self._quiet_s)
            if left <= 0:
                return
            self._hurry.wait(left)

    def _segments(self, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """(host offset, bytes) pieces of a copy, cut where chunks meet."""
        out = []
        end = offset + nbytes
        while offset < end:
            stop = min(end, (offset // self.chunk_bytes + 1) * self.chunk_bytes)
            out.append((offset, stop - offset))
            offset = stop
        return out

    def store(self, source: torch.Tensor, offset: int = 0, non_blocking: bool = False) -> None:
        """Copy the flat uint8 ``source`` into the backup at ``offset``."""
        self._check(source, offset)
        assert self._buffer is not None
        for host, n in self._segments(offset, source.numel()):
            self._buffer[host : host + n].copy_(source[host - offset : host - offset + n], non_blocking=non_blocking)

    def load(self, target: torch.Tensor, offset: int = 0, non_blocking: bool = False) -> None:
        """Copy the backup at ``offset`` into the flat uint8 ``target``."""
        self._check(target, offset)
        assert self._buffer is not None
        for host, n in self._segments(offset, target.numel()):
            target[host - offset : host - offset + n].copy_(self._buffer[host : host + n], non_blocking=non_blocking)

    def _check(self, tensor: torch.Tensor, offset: int) -> None:
        if self._buffer is None:
            raise RuntimeError("the host backup is not ready: wait() first")
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or offset < 0 or offset + tensor.numel() > self.nbytes:
            raise ValueError(f"a copy of {tensor.numel()} bytes at {offset} does not fit a {self.nbytes}-byte backup")

    def _release(self) -> None:
        if self._unpin is not None:
            for address in self._pinned:
                self._unpin(address)
        self._pinned.clear()
        self._buffer = self._made = None

    def close(self) -> None:
        """Unpin and free the memory (after any copy into or out of it has completed)."""
        try:
            self.stop()
        finally:
            self._release()  # memory freed while still registered would stay mapped for the device

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the runtime may already be gone
            self.close()


@atexit.register
def _stop_pinning() -> None:
    # Run after the non-daemon threads are joined, while the CUDA runtime is still whole.
    for backup in list(_PINNING):
        backup.stop()
