"""Triton kernel that stores one layer's new K/V rows into their paged-cache slots.

One program moves one token: every KV head of its K row and its V row. A token's
heads sit next to each other in both the source (``[T, kv_heads, head_dim]``) and
the destination slot (``[kv_heads, head_dim]`` inside a block), so each program
reads and writes two short contiguous runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One warp per 256 elements: 32 threads x 8 half-precision elements, one 16-byte
# access each, so a token's heads are spread over just enough warps.
_ELEMENTS_PER_WARP = 256
_MAX_WARPS = 8


def row_num_warps(elements: int) -> int:
    """Warps for a program that moves one row of ``elements`` half-precision values."""
    return max(1, min(_MAX_WARPS, elements // _ELEMENTS_PER_WARP))


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Negative slots mark padding rows (e.g. CUDA-graph buckets): nothing to store.
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    token64 = token.to(tl.int64)
    k_src = k_ptr + token64 * stride_k_token + offs_h[:, None] * stride_k_head + offs_d[None, :]
    v_src = v_ptr + token64 * stride_v_token + offs_h[:, None] * stride_v_head + offs_d[None, :]
    slot_base = block * stride_cache_block + offset * stride_cache_slot
    dst = slot_base + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    k_row = tl.load(k_src, mask=mask)
    v_row = tl.load(v_src, mask=mask)
    tl.store(k_cache_ptr + dst, k_row.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v_row.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels index ``head_dim`` with unit stride (that is what lets loads vectorize)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k``/``v`` (``[T, kv_heads, head_dim]``) at ``slot_mapping`` in one layer's cache views.

    ``k_cache``/``v_cache`` are ``[num_blocks, page_size, kv_heads, head_dim]`` views with
    identical strides (``KVCache.layer``). Rows whose slot is negative are skipped.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("K and V cache views must share strides (KVCache.layer gives such views)")
    if k_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    num_warps = row_num_warps(block_h * block_d)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PAGE_SIZE=k_cache.shape[1],
        num_warps=num_warps,
    )
