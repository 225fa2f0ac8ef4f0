import pytest

from siesta.kv.block_pool import BlockPool
from siesta.tiers.transfer import block_runs


def test_allocate_free_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1 and all(b.ref_count == 1 for b in blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_freed_block_keeps_its_key_until_reused_lru():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"ka")
    pool.cache(b, b"kb")
    pool.free([b, a])  # tail first: b is reused before a
    pool.free([c])
    assert pool.lookup(b"ka") is a and pool.lookup(b"kb") is b
    (first,) = pool.allocate(1)
    assert first is b and pool.lookup(b"kb") is None and pool.lookup(b"ka") is a


def test_touch_takes_a_cached_free_block_back():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, b"k")
    pool.free([a])
    pool.touch([a])
    assert a.ref_count == 1 and pool.num_free_blocks == 1
    (other,) = pool.allocate(1)
    assert other is not a and pool.lookup(b"k") is a


def test_shared_block_is_free_only_when_every_owner_frees_it():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.touch([a])
    pool.free([a])
    assert pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.free([a])


def test_reset_drops_every_key_but_not_ownership():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"ka")
    pool.cache(b, b"kb")
    pool.free([b])
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup(b"ka") is None and pool.lookup(b"kb") is None
    assert a.ref_count == 1 and a.block_hash is None


def test_first_block_to_publish_a_key_keeps_it():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"k")
    pool.cache(b, b"k")
    assert pool.lookup(b"k") is a and b.block_hash is None


def test_blocks_freed_tail_first_come_back_in_ascending_runs():
    pool = BlockPool(64)
    first = pool.allocate(20)
    pool.free(reversed(first))  # as a finished request frees them
    assert [b.block_id for b in pool.allocate(20)] == list(range(20, 40)), "the least recently freed first"
    third = pool.allocate(20)
    pool.free(reversed(third))
    pool.free(reversed(pool.blocks[20:40]))
    # Free now: 60-63, then 19..0, 59..40 and 39..20, each run descending as it was freed.
    ids = [b.block_id for b in pool.allocate(40)]
    assert ids == list(range(0, 20)) + list(range(44, 64))
    assert block_runs(ids) == [(0, 0, 20), (20, 44, 20)], "two runs: a tier copy moves each in one piece"
