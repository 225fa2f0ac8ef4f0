"""Torch reference backend: decode rows grouped by length and by bytes give one dense answer."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import siesta.attention.torch_ref as torch_ref
from siesta.attention.base import AttentionMetadata, KVCache

KV_HEADS, GROUP, HEAD_DIM, BLOCK, LAYERS, LAYER = 2, 3, 16, 4, 2, 1


def _decode_batch(lens: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in lens]
    cache = KVCache.allocate(sum(blocks) + 3, LAYERS, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
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
    q = torch.randn(len(lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    return q, cache, meta


def _dense(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    k_cache, v_cache = cache.layer(LAYER)
    rows = []
    for i, n in enumerate(meta.seq_lens_cpu):
        ids = meta.block_tables[i, : -(-n // BLOCK)].long()
        k = k_cache[ids].reshape(-1, KV_HEADS, HEAD_DIM)[:n].repeat_interleave(GROUP, 1)
        v = v_cache[ids].reshape(-1, KV_HEADS, HEAD_DIM)[:n].repeat_interleave(GROUP, 1)
        rows.append(F.scaled_dot_product_attention(q[i][:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale)[:, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("group_bytes", [1, 4 << 10, 1 << 40])  # one row a group, a few, all
def test_decode_groups_of_any_size_match_dense_attention(group_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    lens = [rng.randint(1, 60) for _ in range(13)]
    q, cache, meta = _decode_batch(lens)
    monkeypatch.setattr(torch_ref, "DECODE_GROUP_BYTES", group_bytes)
    out = torch.empty_like(q)
    torch_ref.TorchAttention()._decode(q, cache, LAYER, meta, HEAD_DIM**-0.5, list(range(len(lens))), out)
    torch.testing.assert_close(out, _dense(q, cache, meta, HEAD_DIM**-0.5), rtol=1e-5, atol=1e-5)


def test_byte_budget_splits_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of one length go out in groups no larger than the budget allows."""
    q, cache, meta = _decode_batch([40] * 10)
    token_bytes = 2 * KV_HEADS * HEAD_DIM * 4
    monkeypatch.setattr(torch_ref, "DECODE_GROUP_BYTES", 3 * 40 * token_bytes)
    sizes: list[int] = []
    backend = torch_ref.TorchAttention()
    plain = backend._decode_group

    def counting(q, kv_cache, layer_idx, meta, scale, rows, out) -> None:
        sizes.append(len(rows))
        plain(q, kv_cache, layer_idx, meta, scale, rows, out)

    monkeypatch.setattr(backend, "_decode_group", counting)
    backend._decode(q, cache, LAYER, meta, 1.0, list(range(10)), torch.empty_like(q))
    assert sizes == [3, 3, 3, 1]
