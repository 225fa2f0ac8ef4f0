"""Sleep for device memory: release the weights' and the KV cache's memory, restore it later.

Two ways, one interface. ``ArenaMemory`` (CUDA with cuda-python): weights and KV
live in virtual-memory arenas whose pages are unmapped and re-mapped at the same
addresses, so captured CUDA graphs stay valid (``keeps_addresses``).
``SleepableMemory`` (CPU, or CUDA without cuda-python): the tensors' storages are
resized to nothing and back; tensors keep their identity but not their
addresses, so graphs are recaptured after a wake.

Level 1 backs the weights up to host memory first (pinned on CUDA, for DMA at
link speed); level 2 releases them without a backup. The backup's memory is a
``HostBackup``: with ``background_backup`` it is made and pinned in a thread from
construction on (after the engine captured its graphs), so the first sleep finds it
ready; otherwise the first level-1 sleep makes it.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass

import torch

from siesta.attention.base import KVCache
from siesta.core.host_backup import HostBackup
from siesta.core.vmm import VirtualArena
from siesta.pinned import cuda_pinner


@dataclass
class MemoryReport:
    """What one release or restore moved."""

    bytes: int = 0
    seconds: float = 0.0
    waited_s: float = 0.0  # of ``seconds``: waiting for the host backup's memory to be made

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def make_backup(nbytes: int, device: torch.device, background: bool) -> HostBackup:
    """Pinned on CUDA (DMA at link speed), plain host memory on the CPU."""
    return HostBackup(nbytes, cuda_pinner(device) if device.type == "cuda" else None, background)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _unique_storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


class SleepableMemory:
    keeps_addresses = False

    def __init__(self, weights: list[torch.Tensor], kv_cache: KVCache, device: torch.device,
                 background_backup: bool = False) -> None:  # fmt: skip
        self.device = device
        self._weights = _unique_storages(weights)
        self._weight_sizes = [s.nbytes() for s in self._weights]
        self._offsets = [sum(self._weight_sizes[:i]) for i in range(len(self._weight_sizes))]
        self._kv = kv_cache.tensor.untyped_storage()
        self._kv_size = self._kv.nbytes()
        # A CPU cache in an anonymous mapping keeps its address: its pages are dropped instead
        # (they read as zeros afterwards, which is what a restored cache must hold).
        self._kv_map = kv_cache.host_map
        self.backup = make_backup(self.weight_bytes, device, background_backup)
        self._has_backup = False  # the backup holds the current weights
        self.weights_released = False
        self.kv_released = False

    @property
    def weight_bytes(self) -> int:
        return sum(self._weight_sizes)

    @property
    def kv_bytes(self) -> int:
        return self._kv_size

    def release_weights(self, backup: bool) -> MemoryReport:
        if self.weights_released:
            return MemoryReport()
        t0 = time.perf_counter()
        waited = 0.0
        self.backup.settle()  # a wake-up may recapture graphs: no pinning may run by then
        if backup:
            waited = self.backup.wait()
            for offset, storage in zip(self._offsets, self._weights):
                self.backup.store(_bytes_of(storage), offset, non_blocking=self.device.type == "cuda")
            self._has_backup = True
            self._sync()
        for storage in self._weights:
            storage.resize_(0)
        self.weights_released = True
        self._return_to_device()
        return MemoryReport(self.weight_bytes, time.perf_counter() - t0, waited)

    def restore_weights(self) -> tuple[MemoryReport, bool]:
        """Re-allocate weight storage; returns whether its contents were restored from a backup."""
        if not self.weights_released:
            return MemoryReport(), True
        t0 = time.perf_counter()
        for storage, size in zip(self._weights, self._weight_sizes):
            storage.resize_(size)
        restored = self._has_backup
        if restored:
            for offset, storage in zip(self._offsets, self._weights):
                self.backup.load(_bytes_of(storage), offset, non_blocking=True)
            self._sync()
            self._has_backup = False
        self.weights_released = False
        return MemoryReport(self.weight_bytes, time.perf_counter() - t0), restored

    def release_kv_cache(self) -> MemoryReport:
        if self.kv_released:
            return MemoryReport()
        t0 = time.perf_counter()
        self.backup.settle()
        if self._kv_map is not None:
            self._kv_map.madvise(mmap.MADV_DONTNEED)
        else:
            self._kv.resize_(0)
        self.kv_released = True
        self._return_to_device()
        return MemoryReport(self._kv_size, time.perf_counter() - t0)

    def restore_kv_cache(self) -> MemoryReport:
        if not self.kv_released:
            return MemoryReport()
        t0 = time.perf_counter()
        if self._kv_map is None:
            self._kv.resize_(self._kv_size)  # unzeroed: the engine has its blocks zeroed as first used
        self.kv_released = False
        return MemoryReport(self._kv_size, time.perf_counter() - t0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _return_to_device(self) -> None:
        # Freed blocks go back to torch's caching allocator; hand them to the driver too.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class ArenaMemory:
    """Weights and KV cache in two ``VirtualArena``s: one DMA each way per sleep and wake."""

    keeps_addresses = True

    def __init__(self, weights: VirtualArena, kv_cache: VirtualArena, background_backup: bool = False) -> None:
        self.device = weights.device
        self._weights, self._kv = weights, kv_cache
        self.backup = make_backup(weights.nbytes, self.device, background_backup)
        self._has_backup = False

    @property
    def weight_bytes(self) -> int:
        return self._weights.nbytes

    @property
    def kv_bytes(self) -> int:
        return self._kv.nbytes

    @property
    def weights_released(self) -> bool:
        return not self._weights.mapped

    @property
    def kv_released(self) -> bool:
        return not self._kv.mapped

    def release_weights(self, backup: bool) -> MemoryReport:
        if self.weights_released:
            return MemoryReport()
        t0 = time.perf_counter()
        waited = 0.0
        self.backup.settle()
        if backup:
            waited = self.backup.wait()
            self.backup.store(self._weights.tensor, non_blocking=True)
            self._has_backup = True
        self._weights.unmap()  # synchronizes first, so the backup copy has landed
        return MemoryReport(self.weight_bytes, time.perf_counter() - t0, waited)

    def restore_weights(self) -> tuple[MemoryReport, bool]:
        if not self.weights_released:
            return MemoryReport(), True
        t0 = time.perf_counter()
        self._weights.map()
        restored = self._has_backup
        if restored:
            self.backup.load(self._weights.tensor, non_blocking=True)
            torch.cuda.synchronize(self.device)
            self._has_backup = False
        return MemoryReport(self.weight_bytes, time.perf_counter() - t0), restored

    def release_kv_cache(self) -> MemoryReport:
        if self.kv_released:
            return MemoryReport()
        t0 = time.perf_counter()
        self.backup.settle()
        self._kv.unmap()
        return MemoryReport(self.kv_bytes, time.perf_counter() - t0)

    def restore_kv_cache(self) -> MemoryReport:
        if not self.kv_released:
            return MemoryReport()
        t0 = time.perf_counter()
        self._kv.map()  # unzeroed: the engine has its blocks zeroed as first used
        return MemoryReport(self.kv_bytes, time.perf_counter() - t0)
