"""Paged attention in plain torch: the CPU path and the oracle for the GPU kernels.

Decode rows (one query each) are attended together in one padded batch; rows with
longer queries (prefill chunks) are attended one request at a time.

An fp8 cache (``kv_quant``) is quantized as it is written and dequantized as it is read, in the
query's dtype. A prompt chunk then reads its own K/V back from the cache too, not the values it
was handed: it attends to exactly what decode will read, so the two agree (vLLM issue 54035).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.kv_quant import dequantize, quantize

# Decode rows whose contexts differ by more than this factor are attended in separate groups.
DECODE_GROUP_SPREAD = 1.25
# A decode group's gathered K/V at most: small enough to still be in cache when SDPA reads
# it (2-core EPYC, SmolLM2 heads, 64 rows at context 600-1,100: 63 ms a layer in one
# group, 12 ms in groups of ~4 MiB).
DECODE_GROUP_BYTES = 4 << 20


def _causal_lower_right(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """Query i sees keys up to ``ctx_len - q_len + i``: the mask ``torch.nn.attention.bias``'s
    lower-right causal bias builds off CUDA. Built here because importing that module imports
    torch._dynamo, ~1.2 s of every engine process's start."""
    return torch.ones(q_len, ctx_len, dtype=torch.bool, device=device).tril(diagonal=ctx_len - q_len)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer_idx: int, slot_mapping: torch.Tensor) -> None:
    k_cache, v_cache = kv_cache.layer(layer_idx)
    block = slot_mapping // kv_cache.block_size
    offset = slot_mapping % kv_cache.block_size
    if kv_cache.quantized:
        k_scale, v_scale = kv_cache.layer_scales(layer_idx)
        k_cache[block, offset] = quantize(k, k_scale, k_cache.dtype)
        v_cache[block, offset] = quantize(v, v_scale, v_cache.dtype)
        return
    k_cache[block, offset] = k.to(k_cache.dtype)
    v_cache[block, offset] = v.to(v_cache.dtype)


def gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens held by ``block_ids``: ``[length, kv_heads, head_dim]``."""
    # index_select beats advanced indexing ~4x on the strided per-layer view (CPU).
    blocks = cache.index_select(0, block_ids)  # [n, block_size, H, D]
    return blocks.reshape(-1, *blocks.shape[2:])[:length]


class TorchAttention:
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        layer_idx: int,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._write_kv(k, v, kv_cache, layer_idx, meta.slot_mapping)
        if out is None:
            out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        decode_rows = [i for i in range(meta.num_reqs) if starts[i + 1] - starts[i] == 1]
        if decode_rows:
            self._decode(q, kv_cache, layer_idx, meta, scale, decode_rows, out)
        prefill_rows = [i for i in range(meta.num_reqs) if starts[i + 1] - starts[i] > 1]
        if prefill_rows:
            self._prefill_rows(q, k, v, kv_cache, layer_idx, meta, scale, prefill_rows, out)
        return out

    def _prefill_rows(self, q, k, v, kv_cache, layer_idx, meta, scale, rows: list[int], out: torch.Tensor) -> None:
        """Requests ``rows`` (each with more than one new token), one at a time."""
        starts = meta.query_start_loc_cpu
        for i in rows:
            s, e = starts[i], starts[i + 1]
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], kv_cache, layer_idx, meta, i, scale)

    def _write_kv(self, k, v, kv_cache: KVCache, layer_idx: int, slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, kv_cache, layer_idx, slot_mapping)

    def _prefill(self, q, k, v, kv_cache, layer_idx, meta, i, scale) -> torch.Tensor:
        q_len, ctx_len = q.shape[0], meta.seq_lens_cpu[i]
        if ctx_len == q_len and not kv_cache.quantized:
            # No cached prefix: the new K/V are the whole context, no gather needed.
            ctx_k, ctx_v = k, v
        else:
            k_cache, v_cache = kv_cache.layer(layer_idx)
            n_blocks = -(-ctx_len // kv_cache.block_size)
            ids = meta.block_tables[i, :n_blocks]
            ctx_k = gather_context(k_cache, ids, ctx_len)
            ctx_v = gather_context(v_cache, ids, ctx_len)
            if kv_cache.quantized:  # the chunk's own K/V as decode will read them: written, read back
                k_scale, v_scale = kv_cache.layer_scales(layer_idx)
                ctx_k, ctx_v = dequantize(ctx_k, k_scale, q.dtype), dequantize(ctx_v, v_scale, q.dtype)
        # Query j sits at position ctx_len - q_len + j: causal, aligned to the bottom right.
        mask = None if ctx_len == q_len else _causal_lower_right(q_len, ctx_len, q.device)
        # [1, heads, tokens, dim] views; enable_gqa shares each KV head without copying it.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].to(ctx_k.dtype),
            ctx_k.transpose(0, 1)[None],
            ctx_v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != ctx_k.shape[1],
        )
        return o[0].transpose(0, 1)

    def _decode(self, q, kv_cache, layer_idx, meta, scale, rows: list[int], out: torch.Tensor) -> None:
        # Rows padded to a common length waste work on the short ones: attend in groups of
        # similar context length (sorted; a new group past the spread or the byte budget).
        rows = sorted(rows, key=lambda i: meta.seq_lens_cpu[i])
        k_cache = kv_cache.layer(layer_idx)[0]
        # K and V of one position, as SDPA reads them (an fp8 cache's dequantized into q's dtype).
        element_bytes = q.element_size() if kv_cache.quantized else k_cache.element_size()
        token_bytes = 2 * k_cache[0, 0].numel() * element_bytes
        group: list[int] = []
        for i in rows:
            too_far = group and meta.seq_lens_cpu[i] > DECODE_GROUP_SPREAD * meta.seq_lens_cpu[group[0]]
            too_big = group and (len(group) + 1) * meta.seq_lens_cpu[i] * token_bytes > DECODE_GROUP_BYTES
            if too_far or too_big:
                self._decode_group(q, kv_cache, layer_idx, meta, scale, group, out)
                group = []
            group.append(i)
        self._decode_group(q, kv_cache, layer_idx, meta, scale, group, out)

    def _decode_group(self, q, kv_cache, layer_idx, meta, scale, rows: list[int], out: torch.Tensor) -> None:
        k_cache, v_cache = kv_cache.layer(layer_idx)
        bs = kv_cache.block_size
        lens = [meta.seq_lens_cpu[i] for i in rows]
        n_blocks = -(-max(lens) // bs)
        tables = meta.block_tables[torch.tensor(rows, device=q.device), :n_blocks]  # [B, n]
        b = len(rows)
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        groups = q.shape[1] // kv_heads
        flat = tables.reshape(-1)
        ctx_k = k_cache.index_select(0, flat).view(b, n_blocks * bs, kv_heads, head_dim).transpose(1, 2)
        ctx_v = v_cache.index_select(0, flat).view(b, n_blocks * bs, kv_heads, head_dim).transpose(1, 2)
        if kv_cache.quantized:
            k_scale, v_scale = kv_cache.layer_scales(layer_idx)
            ctx_k, ctx_v = dequantize(ctx_k, k_scale, q.dtype), dequantize(ctx_v, v_scale, q.dtype)
        valid = torch.arange(n_blocks * bs, device=q.device)[None, :] < torch.tensor(lens, device=q.device)[:, None]
        # Query heads that share a KV head become that head's query rows: no K/V copies for GQA.
        tokens = torch.tensor([meta.query_start_loc_cpu[i] for i in rows], device=q.device)
        qd = q[tokens].view(b, kv_heads, groups, head_dim).to(ctx_k.dtype)
        o = F.scaled_dot_product_attention(qd, ctx_k, ctx_v, attn_mask=valid[:, None, None, :], scale=scale)
        out[tokens] = o.reshape(b, kv_heads * groups, head_dim).to(out.dtype)
