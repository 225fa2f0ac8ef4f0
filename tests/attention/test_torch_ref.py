"""Torch reference backend: decode rows grouped by length and by bytes give one dense answer."""

from __future__ import annotations

import random

import pytest
import torch

from paged_batch import HEAD_DIM, KV_HEADS, LAYER, decode_batch, dense_decode

import siesta.attention.torch_ref as torch_ref


@pytest.mark.parametrize("group_bytes", [1, 4 << 10, 1 << 40])  # one row a group, a few, all
def test_decode_groups_of_any_size_match_dense_attention(group_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    lens = [rng.randint(1, 60) for _ in range(13)]
    q, cache, meta = decode_batch(lens)
    monkeypatch.setattr(torch_ref, "DECODE_GROUP_BYTES", group_bytes)
    out = torch.empty_like(q)
    torch_ref.TorchAttention()._decode(q, cache, LAYER, meta, HEAD_DIM**-0.5, list(range(len(lens))), out)
    torch.testing.assert_close(out, dense_decode(q, cache, meta, HEAD_DIM**-0.5), rtol=1e-5, atol=1e-5)


def test_byte_budget_splits_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of one length go out in groups no larger than the budget allows."""
    q, cache, meta = decode_batch([40] * 10)
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
