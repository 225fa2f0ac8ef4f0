from siesta.kv.hashing import ExtraKeys
from siesta.kv.kv_manager import KVManager
from siesta.request import Request
from siesta.sampling import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], version: str = "0") -> Request:
    r = Request(rid, tokens, SamplingParams(), frozenset())
    r.hash_extra = ExtraKeys("m", version).encode()
    return r


def test_prefix_hit_stops_before_the_last_token():
    kv = KVManager(16, BS, True)
    a = make_request("a", list(range(8)))
    kv.allocate(a, 8)
    # Same 8 tokens: only the first block may be reused, the last token is always computed.
    b = make_request("b", list(range(8)))
    assert len(kv.find_cached_prefix(b)) == 1
    c = make_request("c", list(range(9)))
    assert len(kv.find_cached_prefix(c)) == 2


def test_hits_survive_free_and_are_shared():
    kv = KVManager(8, BS, True)
    a = make_request("a", list(range(12)))
    kv.allocate(a, 12)
    ids_a = kv.block_ids("a")
    kv.free(a)
    b = make_request("b", list(range(12)) + [99])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == ids_a
    kv.allocate(b, 13, hits)
    assert kv.block_ids("b")[:3] == ids_a and len(kv.block_ids("b")) == 4


def test_allocate_refuses_without_side_effects():
    kv = KVManager(2, BS, True)
    a = make_request("a", list(range(12)))
    assert kv.allocate(a, 12) is None
    assert kv.pool.num_free_blocks == 2 and kv.block_ids("a") == []


def test_other_weight_version_never_hits():
    kv = KVManager(8, BS, True)
    kv.allocate(make_request("a", list(range(9))), 9)
    assert kv.find_cached_prefix(make_request("b", list(range(9)), version="1")) == []


def test_disabled_prefix_caching_publishes_nothing():
    kv = KVManager(8, BS, False)
    kv.allocate(make_request("a", list(range(9))), 9)
    assert kv.find_cached_prefix(make_request("b", list(range(9)))) == []


def test_reclaiming_cached_free_blocks_counts_against_free_space():
    kv = KVManager(3, BS, True)
    a = make_request("a", list(range(8)))
    kv.allocate(a, 8)
    kv.free(a)
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5])
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    # 13 tokens need 4 blocks: 2 reused + 2 new, but only 1 block is free besides the reused ones.
    assert kv.allocate(b, 13, hits) is None
    assert kv.pool.num_free_blocks == 3


def test_block_ids_follow_the_blocks_through_growth_hits_and_free():
    kv = KVManager(16, BS, True)
    a = make_request("a", list(range(12)))
    kv.allocate(a, 5)
    kv.allocate(a, 12)  # grows by a block
    b = make_request("b", list(range(12)) + [7, 8])
    kv.allocate(b, 14, kv.find_cached_prefix(b))  # two cached blocks, then new ones
    for rid in ("a", "b"):
        assert kv.block_ids(rid) == [blk.block_id for blk in kv.blocks(rid)]
    ids = kv.block_ids("a")
    ids.append(99)  # a copy: the caller may keep or change it
    assert kv.block_ids("a") == [blk.block_id for blk in kv.blocks("a")]
    kv.free(a)
    assert kv.block_ids("a") == []
