"""Decode batches over a shuffled paged cache, and the dense answer they must give (CPU attention tests)."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from siesta.attention.base import AttentionMetadata, KVCache

KV_HEADS, GROUP, HEAD_DIM, BLOCK, LAYERS, LAYER = 2, 3, 16, 4, 2, 1


def require_kernel(load: Callable[[], object]) -> None:
    """Skip on a GPU host without a C compiler (CPU attention is not what runs there); elsewhere
    the kernel ``load`` returns must have built."""
    has_compiler = any(shutil.which(cc) for cc in ("gcc", "cc"))
    if torch.cuda.is_available() and not has_compiler:
        pytest.skip("a GPU host without a C compiler: CPU attention is not what runs there")
    assert load() is not None, "the CPU machines (CI's too) have a C compiler: the kernel must build"


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


def prefill_batch(chunks: list[tuple[int, int]], seed: int = 0, group: int = GROUP, head_dim: int = 64,
                  block: int = 16, kv_heads: int = KV_HEADS, int_range: int | None = None):  # fmt: skip
    """Requests of ``(new tokens, context)`` over shuffled blocks: each context's first
    ``context - new`` K/V already cached, the new ones passed to be written. Returns q, k, v
    (views of one fused projection, as the model gives them), the cache, the metadata and
    every request's whole K/V (``[context, kv_heads, head_dim]`` each) for the oracle.
    Values are normal, or integers in ``[-int_range, int_range]``."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        if int_range is None:
            return torch.randn(shape, generator=gen)
        return torch.randint(-int_range, int_range + 1, shape, generator=gen).float()

    blocks = [-(-ctx // block) for _, ctx in chunks]
    cache = KVCache.allocate(sum(blocks) + 3, LAYERS, block, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    cache.tensor.copy_(draw(*cache.tensor.shape))
    perm = torch.randperm(cache.num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(chunks), max(blocks), dtype=torch.int32)
    tokens = sum(n for n, _ in chunks)
    q_heads = kv_heads * group
    fused = draw(tokens, (q_heads + 2 * kv_heads) * head_dim)
    q = fused[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = fused[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = fused[:, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    k_cache, v_cache = cache.layer(LAYER)
    slots, whole, starts, used = [], [], [0], 0
    for i, ((n, ctx), nb) in enumerate(zip(chunks, blocks)):
        tables[i, :nb] = torch.tensor(perm[used : used + nb])
        used += nb
        positions = torch.arange(ctx)
        at = tables[i, positions // block].long() * block + positions % block
        s = starts[-1]
        ctx_k = torch.cat([k_cache.reshape(-1, kv_heads, head_dim)[at[: ctx - n]], k[s : s + n]])
        ctx_v = torch.cat([v_cache.reshape(-1, kv_heads, head_dim)[at[: ctx - n]], v[s : s + n]])
        whole.append((ctx_k, ctx_v))
        slots.append(at[ctx - n :])
        starts.append(s + n)
    lens = [ctx for _, ctx in chunks]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables, slot_mapping=torch.cat(slots), max_query_len=max(n for n, _ in chunks),
        max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )  # fmt: skip
    return q, k, v, cache, meta, whole


def dense_prefill(q: torch.Tensor, meta: AttentionMetadata, whole, scale: float) -> torch.Tensor:
    """Each request's new tokens attended alone, in float64, over their whole context: query j of
    a chunk sits at position context - new + j and sees the keys up to it."""
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = meta.query_start_loc_cpu
    for i, (ctx_k, ctx_v) in enumerate(whole):
        s, e = starts[i], starts[i + 1]
        group = q.shape[1] // ctx_k.shape[1]
        kk = ctx_k.double().repeat_interleave(group, 1).transpose(0, 1)
        vv = ctx_v.double().repeat_interleave(group, 1).transpose(0, 1)
        scores = q[s:e].double().transpose(0, 1) @ kk.transpose(1, 2) * scale  # [heads, new, ctx]
        seen = torch.arange(ctx_k.shape[0])[None, :] <= torch.arange(ctx_k.shape[0] - (e - s), ctx_k.shape[0])[:, None]
        out[s:e] = (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
    return out
