import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from siesta.tiers.host_tier import HostTier

SHAPE = (2, 3)  # an entry of 6 fp32 values: 24 bytes


def tier(entries: int) -> HostTier:
    return HostTier(entries * 24, SHAPE, torch.float32, pin_memory=False)


def test_capacity_from_bytes_and_refusal():
    assert tier(3).capacity == 3
    import pytest

    with pytest.raises(ValueError, match="holds no entry"):
        HostTier(10, SHAPE, torch.float32, pin_memory=False)


def test_lru_eviction_skips_pinned_and_unready():
    t = tier(2)
    a = t.reserve(b"a", "0")
    t.commit(b"a")
    t.reserve(b"b", "0")  # not ready: being copied in
    assert t.lookup(b"b") is None and t.contains(b"b")
    t.pin(b"a")
    assert t.reserve(b"c", "0") is None  # everything pinned or in flight
    t.unpin(b"a")
    c = t.reserve(b"c", "0")
    assert c.slot == a.slot and not t.contains(b"a")


def test_lookup_refreshes_recency():
    t = tier(2)
    for k in (b"a", b"b"):
        t.reserve(k, "0")
        t.commit(k)
    t.lookup(b"a")
    t.reserve(b"c", "0")
    assert t.contains(b"a") and not t.contains(b"b")


def test_evict_where_by_version():
    t = tier(3)
    for k, v in ((b"a", "0"), (b"b", "1"), (b"c", "0")):
        t.reserve(k, v)
        t.commit(k)
    assert t.evict_where(lambda k, e: e.version != "1") == 2
    assert [t.contains(k) for k in (b"a", b"b", b"c")] == [False, True, False]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "commit", "pin", "unpin", "lookup", "evict"]),
                          st.integers(0, 7)), max_size=60))  # fmt: skip
def test_budget_never_exceeded_and_slots_unique(ops):
    t = tier(4)
    pins: dict[bytes, int] = {}
    for op, i in ops:
        key = bytes([i])
        if op == "reserve" and not t.contains(key):
            t.reserve(key, str(i % 2))
        elif op == "commit" and t.contains(key):
            t.commit(key)
        elif op == "pin" and t.contains(key):
            t.pin(key)
            pins[key] = pins.get(key, 0) + 1
        elif op == "unpin" and pins.get(key):
            t.unpin(key)
            pins[key] -= 1
        elif op == "lookup":
            t.lookup(key)
        elif op == "evict":
            t.evict_where(lambda k, e: e.version == "1")
        slots = [e.slot for e in t._index.values()]
        assert len(slots) == len(set(slots)) <= t.capacity
        assert t.bytes_used <= 4 * 24
        # A pinned entry is never evicted.
        for k, n in pins.items():
            if n:
                assert t.contains(k)
