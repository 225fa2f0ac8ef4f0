"""KVCache on the CPU: its pages committed as written (or all at once), and its record of blocks
unset since a wake: which a step must zero first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from siesta.attention.base import KVCache
from memory import resident_bytes


def _cache(num_blocks: int = 6) -> KVCache:
    return KVCache.allocate(num_blocks, num_layers=1, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                            device=torch.device("cpu"))  # fmt: skip


def test_a_cache_never_slept_has_nothing_to_zero():
    kv = _cache()
    assert kv.unset is None and len(kv.claim_unset(np.array([0, 1]))) == 0


def test_blocks_are_claimed_once_and_loaded_ones_never():
    kv = _cache()
    kv.forget_contents()
    kv.overwritten([4, 5])  # a tier load writes them whole
    assert kv.claim_unset(np.array([3, 1, 3, 4])).tolist() == [1, 3]
    assert kv.claim_unset(np.array([1, 3, 5])).tolist() == [], "claimed already, or loaded"
    assert kv.unset is not None and np.flatnonzero(kv.unset).tolist() == [0, 2]
    assert kv.claim_unset(np.array([0, 2])).tolist() == [0, 2]
    assert kv.unset is None, "all claimed: the next steps skip the check"


@pytest.mark.parametrize("prefault", [False, True])
def test_the_pool_commits_pages_as_written_or_all_at_start_up(prefault):
    blocks, block_bytes = 128, 1 << 18  # 32 MiB in all
    kv = KVCache.allocate(blocks, num_layers=8, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32,
                          device=torch.device("cpu"), prefault=prefault)  # fmt: skip
    assert kv.block_bytes == block_bytes
    total = blocks * block_bytes
    resident = resident_bytes(kv.tensor.data_ptr())
    if prefault:
        assert resident == total
        assert not kv.tensor.any(), "committed, and still a zeroed cache"
    else:
        assert resident < total // 8, "nothing written yet: the pool holds (almost) nothing"
        kv.tensor[: blocks // 2].fill_(1.0)
        assert resident_bytes(kv.tensor.data_ptr()) >= total // 2
