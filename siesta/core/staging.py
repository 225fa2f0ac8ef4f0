"""Small host<->device copies of a step (its inputs, its sampled tokens) through pinned memory.

The bytes are moved by a kernel that reads (or writes) the pinned buffer over the
link itself, not by the copy engines. Tier transfers keep the copy engines busy
with gigabytes, and a step's own small copy queued there can wait behind all of
them: on the H200, resume replays had steps whose input copy landed 0.26-0.45 s
late, when the tier's loads in flight had drained (``resume_trace`` in
``siesta/bench/gpu.py``, device time per phase), and a 4 KiB copy back did not
land within 0.1 s while stores streamed out (``step_io``). A kernel's loads and
stores go over the link beside that traffic (H200: 25-100 us under load).

The pinned memory is one ring allocated up front, not ``pin_memory()`` per copy: a
copy of a size the caching host allocator has not seen yet calls ``cudaHostAlloc``,
which takes a driver-wide lock (vLLM measured such calls stalling under load).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Protocol

import torch
import triton
import triton.language as tl

RING_BYTES = 32 << 20  # a step of 256 requests at 2,048 blocks each stages ~2 MiB
ALIGN = 64
COPY_BLOCK = 256  # words a program of the copy kernel moves: many small reads in flight over a busy link
KERNEL_COPIES = True  # False: the copy engines move them (the bench's other arm)


class CopyDone(Protocol):
    """What the ring waits on before a region is reused: a CUDA event, or a copy back until read."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class PinnedRing:
    """A pinned buffer handed out in order; a region is reused once the copy that read it is done."""

    def __init__(self, capacity: int, pin: bool = True) -> None:
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self.head = 0
        self.inflight: deque[tuple[int, int, CopyDone]] = deque()  # (start, end, copy done)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """A free region of ``nbytes``, or None if the ring cannot hold it."""
        if nbytes > self.capacity:
            return None
        start = self.head if self.head + nbytes <= self.capacity else 0
        end = start + nbytes
        # Every finished copy leaves the list, wherever it stands. Popped from the front only,
        # one copy back dropped unread (a failed step's) would keep every later copy listed for
        # the process's life, and each take would walk the growing list.
        pending: deque[tuple[int, int, CopyDone]] = deque()
        for s, e, done in self.inflight:
            if s < end and start < e:
                done.synchronize()  # a lap behind: long finished in practice
            elif not done.query():
                pending.append((s, e, done))
        self.inflight = pending
        self.head = -(-end // ALIGN) * ALIGN
        return start, end

    def release_after(self, region: tuple[int, int], done: CopyDone) -> None:
        self.inflight.append((*region, done))

    def view(self, region: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        return self.buffer[region[0] : region[1]].view(like.dtype).view(like.shape)


_ring: PinnedRing | None = None


def reserve() -> PinnedRing:
    """The process's ring, allocated on first use (call it at start-up to pin it then)."""
    global _ring
    if _ring is None:
        _ring = PinnedRing(RING_BYTES)
    return _ring


def warm_up(device: torch.device) -> None:
    """Pin the ring and compile the copy kernel."""
    reserve()
    to_host_list(to_device(torch.zeros(1, dtype=torch.int32), device))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return to_device_many([host], device)[0]


def to_device_many(hosts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``to_device`` of each, staged side by side and moved by one kernel launch (a step's
    inputs: a launch costs more host time than the bytes take to move)."""
    if device.type == "cpu":
        return hosts
    hosts = [h.contiguous() for h in hosts]
    offsets, total = [], 0
    for h in hosts:
        offsets.append(total)
        total = -(-(total + h.numel() * h.element_size()) // ALIGN) * ALIGN
    ring = reserve()
    region = ring.take(total)
    if region is None:  # larger than the ring: the caching host allocator's path
        return [h.pin_memory().to(device, non_blocking=True) for h in hosts]
    staged = ring.buffer[region[0] : region[1]]
    for h, off in zip(hosts, offsets):
        staged[off : off + h.numel() * h.element_size()].view(h.dtype).copy_(h.reshape(-1))
    out = torch.empty(total, dtype=torch.uint8, device=device)
    _move(staged, out)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    ring.release_after(region, done)
    return [out[off : off + h.numel() * h.element_size()].view(h.dtype).view(h.shape) for h, off in zip(hosts, offsets)]


def to_host_list(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, waiting only for the compute stream's work up to here."""
    return HostCopy(tensor).wait()


class HostCopy:
    """A device tensor on its way to the host: ``wait`` returns it as a list, waiting for the
    work queued before the copy and nothing queued after it (the next step's, say).

    The ring region it lands in is held until it has been read: the copy stands in the
    ring's list of copies in flight (``UntilRead``), done once read, or once landed if it was
    dropped unread, and a lap that reaches the region reads it first.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._values: list | None = None
        if not tensor.is_cuda:
            self._values = tensor.tolist()
            return
        tensor = tensor.contiguous()
        ring = reserve()
        self._region = ring.take(tensor.numel() * tensor.element_size())
        if self._region is None:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
        else:
            self._host = ring.view(self._region, tensor)
            _move(tensor, self._host)
        self._landed = torch.cuda.Event()
        self._landed.record(torch.cuda.current_stream(tensor.device))
        if self._region is not None:
            ring.release_after(self._region, UntilRead(self, self._landed))

    @property
    def read(self) -> bool:
        return self._values is not None

    def wait(self) -> list:
        if self._values is None:
            self._landed.synchronize()
            self._values = self._host.tolist()
        return self._values


class UntilRead:
    """The ring's view of a copy back: its region is in use until the copy is read, or, once
    the copy is dropped unread (a step failed or aborted), until it has landed."""

    def __init__(self, copy: HostCopy, landed: torch.cuda.Event) -> None:
        self._copy = weakref.ref(copy)
        self._landed = landed

    def query(self) -> bool:
        copy = self._copy()
        return copy.read if copy is not None else self._landed.query()

    def synchronize(self) -> None:
        copy = self._copy()
        if copy is not None:
            copy.wait()  # read it now: the region is about to be overwritten
        else:
            self._landed.synchronize()


def _move(src: torch.Tensor, dst: torch.Tensor) -> None:
    if KERNEL_COPIES:
        copy_words(src, dst)
    else:
        dst.copy_(src, non_blocking=True)


def copy_words(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy contiguous ``src`` into ``dst`` (same size in bytes) with a kernel; either side may
    be pinned host memory, which the kernel reaches through its device address."""
    nbytes = src.numel() * src.element_size()
    if nbytes != dst.numel() * dst.element_size():
        raise ValueError(f"copy of {nbytes} bytes into {dst.numel() * dst.element_size()}")
    if nbytes == 0:
        return
    word = torch.int32 if nbytes % 4 == 0 else torch.uint8
    src_words, dst_words = src.reshape(-1).view(word), dst.reshape(-1).view(word)
    n = src_words.numel()
    _copy_kernel[(triton.cdiv(n, COPY_BLOCK),)](src_words, dst_words, n, BLOCK=COPY_BLOCK)


@triton.jit(do_not_specialize=["n"])
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
