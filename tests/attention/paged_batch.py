"""Decode batches over a shuffled paged cache, and the dense answer they must give (CPU attention tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from siesta.attention.base import AttentionMetadata, KVCache

KV_HEADS, GROUP, HEAD_DIM, BLOCK, LAYERS, LAYER = 2, 3, 16, 4, 2, 1


def decode_batch(lens: list[int], seed: int = 0, group: int = GROUP, head_dim: int = HEAD_DIM, block: int = BLOCK):
    """Decode rows of the given context lengths over shuffled blocks: q, cache, metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block) for n in lens]
    cache = KVCache.allocate(sum(blocks) + 3, LAYERS, block, KV_HEADS, head_dim, torch.float32, torch.device("cpu"))
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=gen))
    perm = torch.randperm(cache.num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(perm[used : used + n])
        used += n
    starts = list(range(len(lens) + 1))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.full((len(lens),), -1, dtype=torch.int64), max_query_len=1,
        max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )  # fmt: skip
    q = torch.randn(len(lens), KV_HEADS * group, head_dim, generator=gen)
    return q, cache, meta


def dense_decode(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Each row attended alone over its context, K/V repeated per query head: the truth."""
    k_cache, v_cache = cache.layer(LAYER)
    block, kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // kv_heads
    rows = []
    for i, n in enumerate(meta.seq_lens_cpu):
        ids = meta.block_tables[i, : -(-n // block)].long()
        k = k_cache[ids].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(group, 1)
        v = v_cache[ids].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(group, 1)
        rows.append(F.scaled_dot_product_attention(q[i][:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale)[:, 0])
    return torch.stack(rows)
