"""``siesta.pinned``: host memory locked at exactly the size asked for, unlocked when the last
tensor over it dies. The oracle is counted bytes: what the pinner was asked to lock, against the
tensor's own size, and (on a card) the process's locked-resident memory."""

from __future__ import annotations

import gc

import pytest
import torch

from siesta.pinned import cuda_pinner, map_shared_file, pinned_empty, pinned_host_empty


class Recorder:
    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self.unpinned: list[int] = []

    def pin(self, address: int, nbytes: int) -> None:
        self.pinned[address] = nbytes

    def unpin(self, address: int) -> None:
        self.unpinned.append(address)


def test_locks_exactly_the_tensors_bytes_and_unlocks_when_the_last_view_dies() -> None:
    rec = Recorder()
    # 3 GiB-ish shapes would round to 4 GiB in torch's pinned allocator; the bytes here are odd.
    t = pinned_empty((7, 3, 5), torch.bfloat16, (rec.pin, rec.unpin))
    assert t.shape == (7, 3, 5) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert rec.pinned == {t.data_ptr(): 7 * 3 * 5 * 2}
    assert t.data_ptr() % 4096 == 0  # a mapping of its own: page-aligned for the driver
    t.fill_(1.5)
    view = t[2]
    del t
    gc.collect()
    assert rec.unpinned == []  # a view still reads the memory
    assert view.sum().item() == 15 * 1.5
    address = view.data_ptr() - 2 * 15 * 2
    del view
    gc.collect()
    assert rec.unpinned == [address]


def test_a_pinner_that_fails_leaves_nothing_locked() -> None:
    rec = Recorder()

    def refuse(address: int, nbytes: int) -> None:
        raise RuntimeError("cudaHostRegister failed")

    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pinned_empty((4, 4), torch.float32, (refuse, rec.unpin))
    gc.collect()
    assert rec.unpinned == []


def test_a_shared_file_is_one_memory_for_every_mapping_and_unlocks_with_its_last_view(tmp_path) -> None:
    path = tmp_path / "tier"
    path.write_bytes(bytes(3 * 4096 + 100))  # not a page multiple: the mapping takes it as it is
    nbytes = path.stat().st_size
    rec = Recorder()
    locked = map_shared_file(str(path), nbytes, (rec.pin, rec.unpin))
    plain = map_shared_file(str(path), nbytes, None)  # another rank's view, unlocked
    assert locked.shape == plain.shape == (nbytes,) and rec.pinned == {locked.data_ptr(): nbytes}
    locked[nbytes - 1] = 7
    assert plain[nbytes - 1].item() == 7 and path.read_bytes()[-1] == 7
    address = locked.data_ptr()
    tail = locked[4096:]
    del locked
    gc.collect()
    assert rec.unpinned == []
    del tail
    gc.collect()
    assert rec.unpinned == [address]


def test_empty_shapes_and_the_cpu_take_plain_memory() -> None:
    rec = Recorder()
    assert pinned_empty((0, 8), torch.float32, (rec.pin, rec.unpin)).shape == (0, 8) and rec.pinned == {}
    plain = pinned_host_empty((2, 3), torch.float16, torch.device("cpu"))
    assert plain.shape == (2, 3) and plain.dtype == torch.float16 and not plain.is_pinned()


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_card_the_lock_is_the_size_asked_and_copies_run_from_it() -> None:
    device = torch.device("cuda")
    nbytes = 3 << 30  # torch's pinned allocator would lock 4 GiB for this
    torch.empty(1, device=device)  # the context's own memory (~100 MB resident) before counting
    cuda_pinner(device)
    before = _resident_kib()
    t = pinned_empty((nbytes // 2,), torch.bfloat16, cuda_pinner(device))
    grown = (_resident_kib() - before) << 10
    assert t.is_pinned()
    # Resident now (the lock faults every page in), and no more than asked plus slack for the
    # runtime's bookkeeping: far under the 4 GiB a power-of-two rounding would lock.
    assert nbytes * 0.98 <= grown <= nbytes + (128 << 20)
    src = torch.arange(1 << 20, device=device, dtype=torch.bfloat16)
    t[: 1 << 20].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t[: 1 << 20].to(device), src)
    del t
    gc.collect()
    assert _resident_kib() - before < (64 << 10)  # unlocked and unmapped: the memory is back
