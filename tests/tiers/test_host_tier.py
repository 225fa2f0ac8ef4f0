import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from siesta.tiers.host_tier import HostTier

SHAPE = (2, 3)  # an entry of 6 fp32 values: 24 bytes


def tier(entries: int) -> HostTier:
    return HostTier(entries * 24, SHAPE, torch.float32, torch.device("cpu"))


def test_capacity_from_bytes_and_refusal():
    assert tier(3).capacity == 3
    import pytest

    with pytest.raises(ValueError, match="holds no entry"):
        HostTier(10, SHAPE, torch.float32, torch.device("cpu"))


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


def _chain(t: HostTier, keys: list[bytes]) -> None:
    parent = None
    for key in keys:
        t.reserve(key, "0", parent)
        t.commit(key)
        parent = key


def _reachable(t: HostTier, keys: list[bytes]) -> int:
    """What a lookup finds: entries from the chain's start up to the first missing one."""
    found = 0
    for key in keys:
        if t.lookup(key) is None:
            break
        found += 1
    return found


def test_eviction_takes_chain_ends_first_so_no_prefix_is_stranded():
    t = tier(5)
    a, b = [b"a1", b"a2", b"a3"], [b"b1", b"b2"]
    _chain(t, a)
    _chain(t, b)
    _chain(t, [b"c1"])  # full: evicts the least recently used end (a3), not a1
    assert _reachable(t, a) == 2 and not t.contains(b"a3")
    _chain(t, [b"d1", b"d2"])  # then b2 and a2 (ends as they become ends), never a chain's start first
    stranded = [k for k in (*a, *b) if t.contains(k) and t._index[k].parent and not t.contains(t._index[k].parent)]
    assert not stranded
    assert _reachable(t, a) + _reachable(t, b) == sum(t.contains(k) for k in (*a, *b))


def test_with_every_end_pinned_an_inner_entry_still_makes_room():
    t = tier(2)
    _chain(t, [b"x1", b"x2"])
    t.pin(b"x2")
    assert t.reserve(b"y", "0") is not None and not t.contains(b"x1")  # no store dropped for a chain's sake


def test_the_buffer_is_locked_at_its_own_size_for_the_engines_device(monkeypatch):
    """Not torch's pinned allocator, which rounds a 48 GiB tier up to 64 GiB (siesta/pinned.py)."""
    from siesta.tiers import host_tier

    asked = []

    def pinned_host_empty(shape, dtype, device):
        asked.append((shape, dtype, device))
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(host_tier, "pinned_host_empty", pinned_host_empty)
    cuda = torch.device("cuda")
    t = HostTier(5 * 24 + 7, SHAPE, torch.float32, cuda)
    assert asked == [((5, *SHAPE), torch.float32, cuda)] and t.buffer.shape == (5, *SHAPE)
