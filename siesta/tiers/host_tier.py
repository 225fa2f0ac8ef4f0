"""The host tier: a fixed pool of entries in (pinned) host memory, reused least recently used first.

An entry holds one tier block: ``blocks_per_entry`` consecutive device blocks,
laid out exactly as on the device, so each device block moves in one copy.
Entries being written, or pinned by a load or a disk write, are never evicted, nor to make room
are entries that waiting requests will load; and chain ends go before the entries they
follow (``chains``), so what the tier keeps stays reachable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from siesta.kv.hashing import BlockHash
from siesta.pinned import pinned_host_empty
from siesta.tiers.base import TierRanks
from siesta.tiers.chains import ChainIndex


@dataclass
class HostEntry:
    slot: int
    version: str
    ready: bool = False  # False while its data is being copied in
    pins: int = 0
    # Requests waiting to be looked up that will load it: eviction to make room passes it by
    # (a reset or a version change still drops it: wants never keep stale KV).
    wants: int = 0
    parent: BlockHash | None = None  # the entry before it in its chain (None: the chain's first)


class HostTier:
    """``entry_shape`` is one rank's part; with ``ranks`` an entry holds every rank's part side by
    side (``[ranks, *entry_shape]``), in memory the ranks share, and the capacity is their total."""

    def __init__(self, capacity_bytes: int, entry_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 ranks: TierRanks | None = None) -> None:  # fmt: skip
        if ranks is not None:
            entry_shape = (ranks.size, *entry_shape)
        entry_bytes = torch.empty(entry_shape, dtype=dtype, device="meta").numel() * torch.empty((), dtype=dtype).element_size()
        self.capacity = capacity_bytes // entry_bytes
        if self.capacity < 1:
            raise ValueError(f"cpu_bytes_to_use={capacity_bytes} holds no entry of {entry_bytes} bytes")
        self.entry_bytes = entry_bytes
        self.sharded = ranks is not None
        if ranks is None:
            # Locked for ``device``'s copy engines, at exactly its size (``siesta.pinned``).
            self.buffer = pinned_host_empty((self.capacity, *entry_shape), dtype, device)
        else:
            self.buffer = ranks.host_buffer((self.capacity, *entry_shape), dtype)
        self._index: ChainIndex[HostEntry] = ChainIndex()
        self._free_slots = list(range(self.capacity - 1, -1, -1))
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._index)

    @property
    def bytes_used(self) -> int:
        return len(self._index) * self.entry_bytes

    def lookup(self, key: BlockHash) -> HostEntry | None:
        """A ready entry, marked most recently used; None on a miss."""
        entry = self._index.get(key)
        if entry is None or not entry.ready:
            return None
        self._index.touch(key)
        return entry

    def contains(self, key: BlockHash) -> bool:
        """Present or on its way in."""
        return key in self._index

    def reserve(self, key: BlockHash, version: str, parent: BlockHash | None = None) -> HostEntry | None:
        """A slot for a new entry (not ready until ``commit``); evicts if needed. None if all are pinned."""
        if not self._free_slots and not self._evict_one():
            return None
        entry = HostEntry(self._free_slots.pop(), version, parent=parent)
        self._index.add(key, entry)
        return entry

    def commit(self, key: BlockHash) -> None:
        self._index[key].ready = True

    def pin(self, key: BlockHash) -> None:
        self._index[key].pins += 1

    def unpin(self, key: BlockHash) -> None:
        entry = self._index.get(key)
        if entry is not None:
            entry.pins -= 1

    def want(self, key: BlockHash) -> bool:
        """Mark a ready entry wanted by a waiting request; False if it is absent or not ready."""
        entry = self._index.get(key)
        if entry is None or not entry.ready:
            return False
        entry.wants += 1
        return True

    def unwant(self, key: BlockHash) -> None:
        entry = self._index.get(key)
        if entry is not None and entry.wants:
            entry.wants -= 1

    def drop(self, key: BlockHash) -> None:
        entry = self._index.pop(key)
        if entry is not None:
            self._free_slots.append(entry.slot)

    def evict_where(self, predicate) -> int:
        """Drop unpinned ready entries matching ``predicate(key, entry)``; returns how many."""
        doomed = [k for k, e in self._index.items() if e.ready and e.pins == 0 and predicate(k, e)]
        for key in doomed:
            self.drop(key)
        self.evictions += len(doomed)
        return len(doomed)

    def data(self, entry: HostEntry) -> torch.Tensor:
        """The whole entry (every rank's part): what the disk tier reads and writes."""
        return self.buffer[entry.slot]

    def part(self, entry: HostEntry) -> torch.Tensor:
        """This rank's part of the entry: what its device blocks copy to and from."""
        return self.buffer[entry.slot, 0] if self.sharded else self.buffer[entry.slot]

    def _evict_one(self) -> bool:
        """The least recently used chain end; any entry if every end is pinned or being written
        (a store is not dropped for a chain's sake: with a disk tier below, the rest of the
        chain is still found there)."""
        victim = self._index.evict_end(_evictable) or self._index.evict_any(_evictable)
        if victim is None:
            return False
        self._free_slots.append(victim[1].slot)
        self.evictions += 1
        return True


def _evictable(key: BlockHash, entry: HostEntry) -> bool:
    return entry.ready and entry.pins == 0 and entry.wants == 0
