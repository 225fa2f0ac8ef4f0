"""Small host<->device copies of a step (its inputs, its sampled tokens) through pinned memory.

A pageable copy is staged by the driver and blocks the host while it does; a pinned
one is an ordinary asynchronous copy, ordered on the compute stream only, and the
sampled tokens' copy back waits for that stream alone, not for tier transfers on
their own streams.

The pinned memory is one ring allocated up front, not ``pin_memory()`` per copy: a
copy of a size the caching host allocator has not seen yet calls ``cudaHostAlloc``,
which takes a driver-wide lock (vLLM measured such calls stalling under load). On the
H200, resume replays had steps that waited 0.3-0.5 s until the tier's loads in flight
had landed; with the ring they became rarer but did not vanish, so this was at most
one of their causes.
"""

from __future__ import annotations

from collections import deque

import torch

RING_BYTES = 32 << 20  # a step of 256 requests at 2,048 blocks each stages ~2 MiB
ALIGN = 64


class PinnedRing:
    """A pinned buffer handed out in order; a region is reused once the copy that read it is done."""

    def __init__(self, capacity: int, pin: bool = True) -> None:
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self.head = 0
        self.inflight: deque[tuple[int, int, torch.cuda.Event]] = deque()  # (start, end, copy done)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """A free region of ``nbytes``, or None if the ring cannot hold it."""
        if nbytes > self.capacity:
            return None
        start = self.head if self.head + nbytes <= self.capacity else 0
        end = start + nbytes
        for s, e, done in self.inflight:
            if s < end and start < e:
                done.synchronize()  # a lap behind: long finished in practice
        while self.inflight and self.inflight[0][2].query():
            self.inflight.popleft()
        self.head = -(-end // ALIGN) * ALIGN
        return start, end

    def release_after(self, region: tuple[int, int], done: torch.cuda.Event) -> None:
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


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    host = host.contiguous()
    ring = reserve()
    region = ring.take(host.numel() * host.element_size())
    if region is None:  # larger than the ring: the caching host allocator's path
        return host.pin_memory().to(device, non_blocking=True)
    staged = ring.view(region, host)
    staged.copy_(host)
    out = staged.to(device, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    ring.release_after(region, done)
    return out


def to_host_list(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, waiting only for the compute stream's work up to here."""
    if not tensor.is_cuda:
        return tensor.tolist()
    ring = reserve()
    region = ring.take(tensor.numel() * tensor.element_size())
    host = (
        torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) if region is None else ring.view(region, tensor)
    )
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host.tolist()  # the region is free again: the copy is done
