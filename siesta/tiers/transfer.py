"""Block copies between the device KV cache and host memory.

The cache is block-first, so a block is one contiguous region, and a run of
consecutive block ids is one contiguous region too: each run is a single DMA.
On CUDA the copies run on their own streams from pinned memory. A store waits
only for the forward that filled its blocks; a load is waited for only by the
request it belongs to.

Issuing costs the step loop little: with cuda-python, all of a job's copies go
to the driver in one ``cuMemcpyBatchAsync`` call; without it, a background
thread issues them one by one (a full copy queue then blocks only that thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from siesta.attention.base import KVCache

logger = logging.getLogger(__name__)

POLL_S = 2e-4  # how often a bounded wait looks at a copy in flight

# What a copy returns: None when it already happened (CPU); else an event that fires once
# the copy has landed (batched issue), or the future of one (issued by the thread).
CopyHandle = Future | torch.cuda.Event | None


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first_block, count)`` for each run of consecutive ids, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            index, first, count = runs[-1]
            runs[-1] = (index, first, count + 1)
        else:
            runs.append((i, b, 1))
    return runs


class BlockCopier:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._store_stream = torch.cuda.Stream(device) if self.cuda else None
        self._load_stream = torch.cuda.Stream(device) if self.cuda else None
        self._batch = BatchedCopies.create() if self.cuda else None
        # One thread: copies are issued in submission order, so a stream sees them in that order.
        self._issuer = None
        if self.cuda and self._batch is None:
            self._issuer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="siesta-copy")

    @property
    def batched(self) -> bool:
        """Whether a job's copies go to the driver in one call."""
        return self._batch is not None

    def store(self, kv: KVCache, block_ids: Sequence[int], dst: torch.Tensor) -> CopyHandle:
        """Copy device blocks into ``dst[i]``."""
        return self.store_parts([(dst, block_ids)], kv)

    def store_parts(
        self,
        pieces: Sequence[tuple[torch.Tensor, Sequence[int]]],
        kv: KVCache,
        after: torch.cuda.Event | None = None,
    ) -> CopyHandle:
        """Copy device block ``block_ids[i]`` into each piece's ``dst[i]``; one handle for them all.

        ``after`` as for ``load``.
        """
        return self._submit(self._store_stream, [(kv.tensor, ids, dst, "out") for dst, ids in pieces], after)

    def load(
        self,
        pieces: Sequence[tuple[torch.Tensor, Sequence[int]]],
        kv: KVCache,
        after: torch.cuda.Event | None = None,
    ) -> CopyHandle:
        """Copy each piece's ``src[i]`` into device block ``block_ids[i]``; one handle for them all.

        ``after``: the compute the copies wait for (default: all queued so far on the
        caller's current stream), for callers on another thread than the step loop's.
        """
        return self._submit(self._load_stream, [(kv.tensor, ids, src, "in") for src, ids in pieces], after)

    def compute_mark(self) -> torch.cuda.Event:
        """Everything queued so far on the caller's compute stream: the forward that filled the
        blocks (stores), or the last one that read them before they were reassigned (loads)."""
        mark = torch.cuda.Event()
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def _submit(self, stream, jobs: list[tuple[torch.Tensor, Sequence[int], torch.Tensor, str]],
                after: torch.cuda.Event | None = None) -> CopyHandle:  # fmt: skip
        if not self.cuda:
            for cache, ids, host, direction in jobs:
                _copy_runs(cache, ids, host, direction)
            return None
        if after is None:
            after = self.compute_mark()
        if self._batch is not None:
            stream.wait_event(after)
            self._batch.issue([part for job in jobs for part in _run_parts(*job)], stream)
            done = torch.cuda.Event()
            done.record(stream)
            return done
        return self._issuer.submit(self._issue_each, stream, after, jobs)

    def _issue_each(self, stream, ready: torch.cuda.Event, jobs) -> torch.cuda.Event:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            for cache, ids, host, direction in jobs:
                _copy_runs(cache, ids, host, direction)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    @staticmethod
    def _event(handle: CopyHandle) -> torch.cuda.Event | None:
        return handle.result() if isinstance(handle, Future) else handle

    @staticmethod
    def ready_event(handle: CopyHandle) -> torch.cuda.Event | None:
        """The event the copy's landing records, without waiting: None on CPU, and for a copy
        the issuing thread has not issued yet."""
        if isinstance(handle, Future):
            return handle.result() if handle.done() else None
        return handle

    @classmethod
    def done(cls, handle: CopyHandle) -> bool:
        if isinstance(handle, Future) and not handle.done():
            return False
        event = cls._event(handle)
        return event is None or event.query()

    @classmethod
    def wait(cls, handle: CopyHandle) -> None:
        event = cls._event(handle)
        if event is not None:
            event.synchronize()

    @staticmethod
    def wait_for(handle: CopyHandle, timeout_s: float) -> None:
        """``wait`` for at most ``timeout_s``, releasing the GIL (a thread may be issuing copies)."""
        deadline = time.perf_counter() + timeout_s
        if isinstance(handle, Future):
            try:
                handle = handle.result(timeout=timeout_s)
            except TimeoutError:
                return
        while handle is not None and not handle.query() and time.perf_counter() < deadline:
            time.sleep(POLL_S)


def _run_parts(cache: torch.Tensor, ids: Sequence[int], host: torch.Tensor, direction: str):
    """(destination, source) tensor pairs, one per run of consecutive block ids."""
    for index, first, count in block_runs(ids):
        device_part, host_part = cache[first : first + count], host[index : index + count]
        yield (host_part, device_part) if direction == "out" else (device_part, host_part)


class BatchedCopies:
    """Many copies in one driver call (``cuMemcpyBatchAsync``, CUDA 12.8+ through cuda-python)."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.attrs = driver.CUmemcpyAttributes()
        self.attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self.attrs.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE.value

    @classmethod
    def create(cls) -> BatchedCopies | None:
        try:
            from cuda.bindings import driver

            if not hasattr(driver, "cuMemcpyBatchAsync"):
                return None
            return cls(driver)
        except Exception as e:  # noqa: BLE001 - any trouble here means: copy one by one
            logger.info("batched copies unavailable (%s): issuing copies one by one", e)
            return None

    def issue(self, parts: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream) -> None:
        drv = self.driver
        if not parts:
            return
        dsts = [drv.CUdeviceptr(dst.data_ptr()) for dst, _ in parts]
        srcs = [drv.CUdeviceptr(src.data_ptr()) for _, src in parts]
        sizes = [dst.numel() * dst.element_size() for dst, _ in parts]
        result = drv.cuMemcpyBatchAsync(dsts, srcs, sizes, len(parts), [self.attrs], [0], 1, drv.CUstream(stream.cuda_stream))
        err = result[0] if isinstance(result, tuple) else result
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: {err}")


def _copy_runs(cache: torch.Tensor, ids: Sequence[int], host: torch.Tensor, direction: str) -> None:
    non_blocking = cache.device.type == "cuda"
    for dst, src in _run_parts(cache, ids, host, direction):
        dst.copy_(src, non_blocking=non_blocking)
