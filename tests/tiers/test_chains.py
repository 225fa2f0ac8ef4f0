"""The chain index both tiers evict through, against a brute-force oracle of recency and ends."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from siesta.tiers.chains import ChainIndex

KEYS = 12  # few keys, so parents are often present, dropped and stored again


@dataclass
class Entry:
    parent: bytes | None
    held: bool = False  # stands for a pin: not evictable


def key(i: int) -> bytes:
    return bytes([i])


class Oracle:
    """Recency as a plain list, ends by scanning every entry."""

    def __init__(self) -> None:
        self.order: list[bytes] = []  # least recently used first
        self.entries: dict[bytes, Entry] = {}

    def add(self, k: bytes, entry: Entry) -> None:
        self.entries[k] = entry
        self.order.append(k)

    def touch(self, k: bytes) -> None:
        self.order.remove(k)
        self.order.append(k)

    def pop(self, k: bytes) -> None:
        self.order.remove(k)
        del self.entries[k]

    def is_end(self, k: bytes) -> bool:
        return not any(e.parent == k for e in self.entries.values())

    def victim(self, ends_only: bool) -> bytes | None:
        for k in self.order:
            if not self.entries[k].held and (self.is_end(k) or not ends_only):
                return k
        return None


OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "touch", "pop", "hold", "evict_end", "evict_any"]),
                         st.integers(0, KEYS - 1), st.integers(-1, KEYS - 1)), max_size=80)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_evictions_take_the_least_recently_used_allowed_end(ops):
    index: ChainIndex[Entry] = ChainIndex()
    oracle = Oracle()
    for op, i, j in ops:
        k = key(i)
        if op == "add" and k not in oracle.entries:
            entry = Entry(None if j < 0 or j == i else key(j))
            index.add(k, entry)
            oracle.add(k, entry)
        elif op == "touch" and k in oracle.entries:
            index.touch(k)
            oracle.touch(k)
        elif op == "pop" and k in oracle.entries:
            assert index.pop(k) is oracle.entries[k]
            oracle.pop(k)
        elif op == "hold" and k in oracle.entries:
            oracle.entries[k].held = not oracle.entries[k].held
        elif op in ("evict_end", "evict_any"):
            expected = oracle.victim(ends_only=op == "evict_end")
            evict = index.evict_end if op == "evict_end" else index.evict_any
            got = evict(lambda _k, e: not e.held)
            assert (got[0] if got else None) == expected
            if expected is not None:
                oracle.pop(expected)
        assert list(index.keys()) == oracle.order
        assert all(index.is_end(k) == oracle.is_end(k) for k in oracle.entries)


def test_a_long_run_of_uses_keeps_the_heap_bounded():
    index: ChainIndex[Entry] = ChainIndex()
    index.add(b"a", Entry(None))
    index.add(b"b", Entry(b"a"))
    for _ in range(10_000):
        index.touch(b"b")
    assert len(index._ends) < 100  # stale items are dropped, not kept for ever
    assert index.evict_end(lambda k, e: True)[0] == b"b"
    assert index.evict_end(lambda k, e: True)[0] == b"a"
    assert index.evict_end(lambda k, e: True) is None
