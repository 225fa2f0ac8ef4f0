import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from siesta.tiers.disk_tier import SUFFIX, DiskTier

ENTRY = 1000


def payload(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * ENTRY)


def files_bytes(tier: DiskTier) -> int:
    return sum(p.stat().st_size for p in tier.dir.iterdir())


def test_round_trip_and_restart_reuses(tmp_path):
    t = DiskTier(tmp_path, "model-a", 10 * ENTRY, ENTRY)
    assert t.write(b"k1", "0", payload(1)) > ENTRY
    assert t.read(b"k1") == bytes(payload(1))
    again = DiskTier(tmp_path, "model-a", 10 * ENTRY, ENTRY)
    assert again.read(b"k1") == bytes(payload(1))
    # Another model's directory is a different tier.
    assert DiskTier(tmp_path, "model-b", 10 * ENTRY, ENTRY).read(b"k1") is None


def test_entry_cut_off_mid_write_is_never_served(tmp_path):
    t = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)
    t.write(b"k1", "0", payload(1))
    path = next(t.dir.glob(f"*{SUFFIX}"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])  # the tail never reached the disk
    assert DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY).read(b"k1") is None
    assert not path.exists()
    # And a half-written temporary file from a killed writer is cleaned up, not indexed.
    (t.dir / "deadbeef.kv.123.tmp").write_bytes(b"partial")
    fresh = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)
    assert len(fresh) == 0 and not list(fresh.dir.glob("*.tmp"))


def test_corrupted_payload_is_deleted_not_served(tmp_path):
    t = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)
    t.write(b"k1", "0", payload(1))
    path = next(t.dir.glob(f"*{SUFFIX}"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert t.read(b"k1") is None and not t.contains(b"k1") and not path.exists()


def test_entry_of_another_key_is_not_served(tmp_path):
    t = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)
    t.write(b"k1", "0", payload(1))
    t.write(b"k2", "0", payload(2))
    p1, p2 = (t.dir / f"{k.hex()}{SUFFIX}" for k in (b"k1", b"k2"))
    os.replace(p2, p1)  # k1's name, k2's contents
    assert t.read(b"k1") is None


@pytest.mark.parametrize("capacity_entries", [1, 3])
def test_lru_eviction_keeps_the_budget(tmp_path, capacity_entries):
    t = DiskTier(tmp_path, "m", capacity_entries * (ENTRY + 200), ENTRY)
    for i in range(6):
        t.write(bytes([i]), "0", payload(i))
        assert files_bytes(t) <= t.capacity and t.bytes_used == files_bytes(t)
    assert len(t) == capacity_entries and t.contains(bytes([5]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "read", "evict", "restart"]), st.integers(0, 9)), max_size=40),
       st.integers(1, 5))  # fmt: skip
def test_budget_never_exceeded_under_random_workloads(tmp_path_factory, ops, capacity_entries):
    root = tmp_path_factory.mktemp("disk")
    cap = capacity_entries * (ENTRY + 200)
    t = DiskTier(root, "m", cap, ENTRY)
    written: dict[bytes, bytes] = {}
    for op, i in ops:
        key = bytes([i])
        if op == "write":
            if t.write(key, str(i % 2), payload(i)):
                written[key] = bytes(payload(i))
        elif op == "read":
            data = t.read(key)
            assert data is None or data == written[key]
        elif op == "evict":
            t.evict_where(lambda k, e: e.version == "1")
        else:
            t = DiskTier(root, "m", cap, ENTRY)
        assert files_bytes(t) <= cap
        assert t.bytes_used == files_bytes(t)
