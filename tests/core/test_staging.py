"""The pinned staging ring: regions in order, wrap-around, and no region reused under a copy in flight."""

from __future__ import annotations

import pytest
import torch

from siesta.core import staging
from siesta.core.staging import ALIGN, PinnedRing, UntilRead


class FakeCopyDone:
    """Stands in for a CUDA event: done once ``synchronize`` is called (or from the start)."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_regions_are_handed_out_in_order_and_aligned() -> None:
    ring = PinnedRing(1024, pin=False)
    a = ring.take(10)
    b = ring.take(100)
    assert a == (0, 10)
    assert b == (ALIGN, ALIGN + 100)


def test_a_wrapped_region_waits_only_for_the_copies_it_overlaps() -> None:
    ring = PinnedRing(4 * ALIGN, pin=False)
    first, second = FakeCopyDone(), FakeCopyDone()
    ring.release_after(ring.take(ALIGN), first)  # [0, 64)
    ring.release_after(ring.take(2 * ALIGN), second)  # [64, 192)
    assert ring.take(2 * ALIGN) == (0, 2 * ALIGN)  # wraps: [0, 128) overlaps both
    assert first.waited and second.waited


def test_a_region_clear_of_copies_in_flight_does_not_wait() -> None:
    ring = PinnedRing(4 * ALIGN, pin=False)
    busy = FakeCopyDone()
    ring.release_after(ring.take(ALIGN), busy)  # [0, 64)
    assert ring.take(ALIGN) == (ALIGN, 2 * ALIGN)
    assert not busy.waited
    assert list(ring.inflight) == [(0, ALIGN, busy)]  # still in flight: kept


def test_finished_copies_are_forgotten() -> None:
    ring = PinnedRing(4 * ALIGN, pin=False)
    ring.release_after(ring.take(ALIGN), FakeCopyDone(done=True))
    ring.take(ALIGN)
    assert not ring.inflight


def test_a_copy_in_flight_does_not_keep_the_finished_ones_after_it_listed() -> None:
    """A copy back read late (or never) stood first in the list and kept every later one there:
    the list grew by two a step and each take walked it all (ms a step after thousands)."""
    ring = PinnedRing(1 << 20, pin=False)
    unread = FakeCopyDone()
    ring.release_after(ring.take(ALIGN), unread)
    for _ in range(100):
        ring.release_after(ring.take(ALIGN), FakeCopyDone(done=True))
    ring.take(ALIGN)
    assert [done for _, _, done in ring.inflight] == [unread] and not unread.waited


class FakeHostCopy:
    """Stands in for ``HostCopy`` (which needs a GPU): read once waited on."""

    def __init__(self) -> None:
        self.read = False

    def wait(self) -> list:
        self.read = True
        return []


def test_a_copy_back_holds_its_region_until_read_or_until_dropped_and_landed() -> None:
    copy, landed = FakeHostCopy(), FakeCopyDone()
    done = UntilRead(copy, landed)
    assert not done.query()
    done.synchronize()  # a lap reached the region: the copy is read first
    assert copy.read and done.query() and not landed.waited
    dropped = UntilRead(FakeHostCopy(), landed)  # its copy is gone at once, unread
    assert not dropped.query()  # not landed yet: the device may still write the region
    dropped.synchronize()
    assert landed.waited and dropped.query()


def test_too_large_a_copy_is_refused() -> None:
    assert PinnedRing(ALIGN, pin=False).take(ALIGN + 1) is None


def test_a_view_holds_the_tensor_shape_and_dtype() -> None:
    ring = PinnedRing(1024, pin=False)
    like = torch.arange(12, dtype=torch.int32).view(3, 4)
    view = ring.view(ring.take(like.numel() * 4), like)
    view.copy_(like)
    assert view.shape == (3, 4) and view.dtype == torch.int32 and torch.equal(view, like)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a GPU")
def test_staged_copies_round_trip_through_the_ring() -> None:
    device = torch.device("cuda")
    values = [torch.arange(n, dtype=torch.int64) * 3 for n in (1, 7, 1000, 100_000)]
    on_device = [staging.to_device(v, device) for v in values]
    assert [staging.to_host_list(d) for d in on_device] == [v.tolist() for v in values]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float64, torch.uint8])
@pytest.mark.parametrize("n", [1, 5, 1023, 1025, 3001])
def test_the_copy_kernel_moves_every_byte(dtype: torch.dtype, n: int) -> None:
    # Bytes not a multiple of 4 (uint8 at odd n) take the byte-wide kernel, the rest the word-wide one.
    src = (torch.arange(n, dtype=torch.int64) * 7919 % 251).to(dtype)
    if torch.cuda.is_available():  # pinned host -> device -> pinned host, the kernel both ways
        src = src.pin_memory()
        on_device = torch.full_like(src, 13, device="cuda")
        staging.copy_words(src, on_device)
        back = torch.full_like(src, 17).pin_memory()
        staging.copy_words(on_device, back)
        torch.cuda.synchronize()
        assert torch.equal(back, src)
        return
    dst = torch.full_like(src, 13)  # the interpreter: host memory on both sides
    staging.copy_words(src, dst)
    assert torch.equal(dst, src)


def test_the_copy_kernel_refuses_a_size_mismatch_and_skips_empty_copies() -> None:
    with pytest.raises(ValueError, match="copy of 16 bytes into 12"):
        staging.copy_words(torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    staging.copy_words(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a GPU")
def test_a_step_s_inputs_travel_together_and_keep_their_dtypes_and_shapes() -> None:
    device = torch.device("cuda")
    hosts = [torch.arange(5, dtype=torch.int32), torch.arange(12, dtype=torch.int32).view(3, 4) * 7,
             torch.arange(3, dtype=torch.int64) - 2**40, torch.zeros(0, dtype=torch.int64),
             torch.tensor([0.5, -1.25], dtype=torch.float32)]  # fmt: skip
    moved = staging.to_device_many(hosts, device)
    assert [m.device.type for m in moved] == ["cuda"] * len(hosts)
    for m, h in zip(moved, hosts):
        assert m.dtype == h.dtype and m.shape == h.shape and torch.equal(m.cpu(), h)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a GPU")
def test_copies_back_keep_their_region_until_read_even_when_the_ring_laps(monkeypatch) -> None:
    monkeypatch.setattr(staging, "_ring", PinnedRing(4 * 1024))  # four 1 KiB copies per lap
    values = [torch.full((256,), i, dtype=torch.int32, device="cuda") for i in range(10)]
    copies = [staging.HostCopy(v) for v in values]  # laps twice before any is read
    assert [c.wait() for c in copies] == [[i] * 256 for i in range(10)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a GPU")
def test_step_copies_go_through_the_copy_kernel_not_the_copy_engines(monkeypatch) -> None:
    calls = []
    real = staging.copy_words
    monkeypatch.setattr(staging, "copy_words", lambda src, dst: calls.append(src.device.type) or real(src, dst))
    moved = staging.to_device_many([torch.arange(3), torch.arange(4, dtype=torch.int32)], torch.device("cuda"))
    assert staging.to_host_list(moved[0]) == [0, 1, 2]
    assert calls == ["cpu", "cuda"]  # one launch in (from pinned memory), one out
