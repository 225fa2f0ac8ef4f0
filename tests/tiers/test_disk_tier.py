import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from siesta.tiers.base import DropReason
from siesta.tiers.disk_tier import SUFFIX, DiskTier, DiskWrite

ENTRY = 1000


def payload(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * ENTRY)


def files_bytes(tier: DiskTier) -> int:
    return sum(p.stat().st_size for p in tier.dir.iterdir())


def test_round_trip_and_restart_reuses(tmp_path):
    t = DiskTier(tmp_path, "model-a", 10 * ENTRY, ENTRY)
    assert t.write(b"k1", "0", payload(1)).nbytes > ENTRY
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
            if t.write(key, str(i % 2), payload(i)).nbytes:
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


# -- chains: what the tier keeps stays reachable -------------------------------------------


def entries_fitting(root, n: int) -> int:
    """A budget of exactly ``n`` entries' files (headers included)."""
    probe = DiskTier(root / "probe", "m", 1 << 20, ENTRY)
    size = probe.write(b"\x00" * 16, "0", payload(0), parent=None).nbytes
    return n * size + size // 2


def chain_keys(chain: int, length: int) -> list[bytes]:
    return [bytes([chain, i]) * 8 for i in range(length)]  # 16 bytes, as real keys


def reachable(t: DiskTier, keys: list[bytes]) -> list[bytes]:
    """What a lookup finds: the chain's entries from its start up to the first missing one."""
    found = []
    for k in keys:
        if not t.contains(k):
            break
        found.append(k)
    return found


CHAINS = st.lists(st.integers(1, 7), min_size=2, max_size=6)  # chain lengths
SCHEDULE = st.lists(st.tuples(st.sampled_from(["write", "write", "write", "read", "restart"]), st.integers(0, 5)),
                    max_size=60)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(CHAINS, SCHEDULE, st.integers(2, 6))
def test_every_kept_entry_is_reachable_and_the_evicted_are_chain_tails(tmp_path_factory, lengths, schedule, room):
    """Chains written a block at a time, interleaved, read back and the tier restarted, into
    a tier of ``room`` entries: checked after every step against a brute-force oracle."""
    root = tmp_path_factory.mktemp("disk")
    cap = entries_fitting(root, room)
    t = DiskTier(root, "m", cap, ENTRY)
    chains = [chain_keys(c, n) for c, n in enumerate(lengths)]
    written = [0] * len(chains)  # blocks of each chain offered to the tier so far
    for op, i in schedule:
        c = i % len(chains)
        keys = chains[c]
        if op == "write" and written[c] < len(keys):
            j = written[c]
            t.write(keys[j], "0", payload(j), parent=keys[j - 1] if j else None)
            written[c] += 1
        elif op == "read":
            for k in reachable(t, keys):  # as a lookup reads: from the start
                assert t.read(k) is not None
        elif op == "restart":
            t = DiskTier(root, "m", cap, ENTRY)
        stored = [k for keys in chains for k in keys if t.contains(k)]
        assert len(stored) == len(t) <= room
        assert sorted(stored) == sorted(k for keys in chains for k in reachable(t, keys))
        for keys, n in zip(chains, written, strict=True):
            kept = len(reachable(t, keys))
            assert not any(t.contains(k) for k in keys[kept:n])  # what went is the chain's tail


def test_a_chain_longer_than_the_tier_keeps_its_start(tmp_path):
    """Making room for a chain's next entry by evicting the one before it would strand the new
    one: the start of the chain is kept and the rest refused as no_space (then parent_missing)."""
    t = DiskTier(tmp_path, "m", entries_fitting(tmp_path, 3), ENTRY)
    keys = chain_keys(0, 5)
    results = [t.write(k, "0", payload(j), parent=keys[j - 1] if j else None) for j, k in enumerate(keys)]
    assert [r.dropped for r in results] == [None, None, None, DropReason.NO_SPACE, DropReason.PARENT_MISSING]
    assert reachable(t, keys) == keys[:3] and len(t) == 3 and t.evictions == 0
    # Another chain's entry then takes the room of this chain's end, not of its start.
    assert t.write(b"\x09" * 16, "0", payload(9)).dropped is None
    assert reachable(t, keys) == keys[:2] and t.evictions == 1


def test_an_entry_larger_than_the_budget_is_refused_as_no_space(tmp_path):
    t = DiskTier(tmp_path, "m", ENTRY // 2, ENTRY)
    assert t.write(b"k1", "0", payload(1)) == DiskWrite(0, DropReason.NO_SPACE)
    assert len(t) == 0 and t.bytes_used == 0


def test_a_directory_that_cannot_be_written_is_an_io_error(tmp_path):
    t = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)
    assert t.write(b"k1", "0", payload(1)).dropped is None
    used = t.bytes_used
    # A file where the directory was: no one can create files in it, root included (a chmod
    # would not stop root, which runs these tests in some containers).
    shutil.rmtree(t.dir)
    t.dir.write_bytes(b"")
    assert t.write(b"k2", "0", payload(2)) == DiskWrite(0, DropReason.IO_ERROR)
    assert t.bytes_used == used and not t.contains(b"k2")  # the budget is not leaked


def _rewrite_header(path, edit) -> None:
    """The file with its JSON header replaced by ``edit(header)`` (still valid JSON), payload kept."""
    import json
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<I", raw[4:8])
    header = json.loads(raw[8 : 8 + n])
    body = json.dumps(edit(header)).encode()
    path.write_bytes(raw[:4] + struct.pack("<I", len(body)) + body + raw[8 + n :])


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h | {"key": "g" + h["key"][1:]},  # not hex
        lambda h: h | {"key": 5},
        lambda h: h | {"data_bytes": "x"},
        lambda h: h | {"data_bytes": True},
        lambda h: h | {"data_bytes": -1},
        lambda h: h | {"crc32": "0"},
        lambda h: h | {"version": ["0"]},
        lambda h: h | {"parent": "zz"},
        lambda h: [h],  # a list, not an object
        lambda h: "header",
        lambda h: None,
        lambda h: {k: v for k, v in h.items() if k != "key"},
    ],
    ids=["key-not-hex", "key-int", "bytes-str", "bytes-bool", "bytes-negative", "crc-str", "version-list",
         "parent-not-hex", "list", "string", "null", "no-key"],
)  # fmt: skip
def test_a_header_of_wrong_types_is_skipped_counted_and_deleted_at_start(tmp_path, edit):
    t = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)
    t.write(b"k1", "0", payload(1))
    t.write(b"k2", "0", payload(2))
    bad = t.dir / f"{b'k1'.hex()}{SUFFIX}"
    _rewrite_header(bad, edit)
    fresh = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)  # used to raise (the server exited with 3)
    assert fresh.damaged == 1 and not bad.exists()
    assert fresh.read(b"k1") is None and fresh.read(b"k2") == bytes(payload(2))


def test_a_header_damaged_after_start_is_deleted_and_counted_on_read(tmp_path):
    t = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)
    t.write(b"k1", "0", payload(1))
    _rewrite_header(t.dir / f"{b'k1'.hex()}{SUFFIX}", lambda h: h | {"data_bytes": "x"})
    assert t.read(b"k1") is None and t.damaged == 1 and not t.contains(b"k1")


def test_garbage_and_deep_json_files_never_stop_the_tier(tmp_path):
    t = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)
    (t.dir / f"{'ab' * 8}{SUFFIX}").write_bytes(b"SKV1" + (4000).to_bytes(4, "little") + b"[" * 4000)
    (t.dir / f"{'cd' * 8}{SUFFIX}").write_bytes(b"SKV1" + (2**32 - 1).to_bytes(4, "little"))
    (t.dir / f"{'ef' * 8}{SUFFIX}").write_bytes(b"")
    fresh = DiskTier(tmp_path, "m", 10 * ENTRY, ENTRY)
    assert fresh.damaged == 3 and len(fresh) == 0 and not list(fresh.dir.iterdir())


def test_the_tier_folder_is_private_and_a_folder_others_may_write_is_warned_of(tmp_path, caplog):
    t = DiskTier(tmp_path / "tier", "m", 10 * ENTRY, ENTRY)
    assert t.dir.stat().st_mode & 0o077 == 0
    t.dir.chmod(0o777)
    with caplog.at_level("WARNING", logger="siesta.tiers.disk_tier"):
        DiskTier(tmp_path / "tier", "m", 10 * ENTRY, ENTRY)
    assert "writable by other users" in caplog.text
