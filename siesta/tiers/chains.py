"""Tier entries in least-recently-used order, with the chains they form: eviction that keeps
every kept entry reachable.

A tier entry is keyed by a prefix key, and a lookup walks a request's keys from its first
block and stops at the first miss. An entry evicted while later entries of its chain stay
strands them: they keep their space and are never found again. So both tiers evict chain
ends first (entries no kept entry follows), least recently used first; the host tier takes
an inner entry only when every end is held by a copy in flight.

Ends come off a heap ordered by last use, so an eviction costs O(log n) however many
chain starts are older than the oldest end (the disk tier holds tens of thousands of
entries and evicts from its writer thread, which shares the GIL with the step loop). An
entry used again, or followed by a new entry, leaves its old heap item behind; such stale
items are skipped when they come up and dropped when the heap is rebuilt.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, ItemsView, KeysView, ValuesView
from typing import Generic, Protocol, TypeVar

from siesta.kv.hashing import BlockHash

# The heap is rebuilt from the live ends once it holds this many items per entry (plus the
# slack, so a small index is not rebuilt on every use): stale items cost memory, not order.
STALE_FACTOR = 4
STALE_SLACK = 64


class ChainEntry(Protocol):
    parent: BlockHash | None  # the entry before it in its chain; None: the chain's first


E = TypeVar("E", bound=ChainEntry)
Evictable = Callable[[BlockHash, E], bool]


class ChainIndex(Generic[E]):
    """key -> entry, least recently used first, knowing which entries end a chain."""

    def __init__(self) -> None:
        self._entries: OrderedDict[BlockHash, E] = OrderedDict()
        self._last_use: dict[BlockHash, int] = {}
        # Keyed by the parent's key whether or not the parent is here: a parent stored again
        # after it was dropped is at once known not to be an end.
        self._children: dict[BlockHash, set[BlockHash]] = {}
        self._ends: list[tuple[int, BlockHash]] = []  # (last use, key), a heap
        self._clock = itertools.count()

    # -- a mapping -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: BlockHash) -> E:
        return self._entries[key]

    def get(self, key: BlockHash) -> E | None:
        return self._entries.get(key)

    def keys(self) -> KeysView[BlockHash]:
        return self._entries.keys()

    def values(self) -> ValuesView[E]:
        return self._entries.values()

    def items(self) -> ItemsView[BlockHash, E]:
        """Least recently used first."""
        return self._entries.items()

    # -- changes -------------------------------------------------------------------------

    def add(self, key: BlockHash, entry: E) -> None:
        """A new entry, most recently used."""
        if key in self._entries:
            raise KeyError(f"tier key {key.hex()} is already indexed")
        self._entries[key] = entry
        if entry.parent is not None:
            self._children.setdefault(entry.parent, set()).add(key)
        self._use(key)

    def touch(self, key: BlockHash) -> None:
        """Mark ``key`` most recently used."""
        self._entries.move_to_end(key)
        self._use(key)

    def pop(self, key: BlockHash) -> E | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        del self._last_use[key]
        parent = entry.parent
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(key)
            if not siblings:
                del self._children[parent]
                if parent in self._entries:
                    self._push_end(parent)  # its last follower left: it ends its chain now
        return entry

    def is_end(self, key: BlockHash) -> bool:
        """No entry here follows ``key`` in a chain."""
        return key not in self._children

    # -- eviction ------------------------------------------------------------------------

    def evict_end(self, evictable: Evictable) -> tuple[BlockHash, E] | None:
        """Remove and return the least recently used chain end that ``evictable`` allows."""
        passed_over: list[tuple[int, BlockHash]] = []
        victim = None
        while self._ends:
            item = heapq.heappop(self._ends)
            used, key = item
            if self._last_use.get(key) != used or not self.is_end(key):
                continue  # stale: gone, used since (a newer item stands for it), or followed now
            if evictable(key, self._entries[key]):
                victim = key
                break
            passed_over.append(item)  # held for now, still an end: it stays a candidate
        for item in passed_over:
            heapq.heappush(self._ends, item)
        return None if victim is None else (victim, self.pop(victim))

    def evict_any(self, evictable: Evictable) -> tuple[BlockHash, E] | None:
        """Remove and return the least recently used entry ``evictable`` allows, end or not
        (a scan: for when no end may go)."""
        for key, entry in self._entries.items():
            if evictable(key, entry):
                return key, self.pop(key)
        return None

    def _use(self, key: BlockHash) -> None:
        self._last_use[key] = next(self._clock)
        if self.is_end(key):
            self._push_end(key)

    def _push_end(self, key: BlockHash) -> None:
        heapq.heappush(self._ends, (self._last_use[key], key))
        if len(self._ends) > STALE_FACTOR * len(self._entries) + STALE_SLACK:
            self._ends = [(self._last_use[k], k) for k in self._entries if self.is_end(k)]
            heapq.heapify(self._ends)
