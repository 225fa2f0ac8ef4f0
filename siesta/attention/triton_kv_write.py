"""Triton kernel that stores one layer's new K/V rows into their paged-cache slots.

One program moves one token: every KV head of its K row and its V row. A token's
heads sit next to each other in both the source (``[T, kv_heads, head_dim]``) and
the destination slot (``[kv_heads, head_dim]`` inside a block), so each program
reads and writes two short contiguous runs.

An fp8 cache stores ``x / scale`` saturated to the format's largest value and rounded to
nearest, ties to even (``kv_quant``): rounded onto the format's grid by hand in fp32, so the
cast that follows is exact on every target (the interpreter's own fp32 -> fp8 cast is not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from siesta import host_ints, pdl
from siesta.attention.kv_quant import FP8_GRIDS, Fp8Grid, is_quantized

# One warp per 256 elements: 32 threads x 8 half-precision elements, one 16-byte
# access each, so a token's heads are spread over just enough warps.
_ELEMENTS_PER_WARP = 256
_MAX_WARPS = 8


def row_num_warps(elements: int) -> int:
    """Warps for a program that moves one row of ``elements`` half-precision values."""
    return max(1, min(_MAX_WARPS, elements // _ELEMENTS_PER_WARP))


# fp32's layout: what the rounding below takes apart.
_FP32_MANTISSA_BITS = tl.constexpr(23)
_FP32_MANTISSA_MASK = tl.constexpr((1 << 23) - 1)
_FP32_IMPLICIT_ONE = tl.constexpr(1 << 23)
_FP32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
_FP32_EXPONENT_BIAS = tl.constexpr(127)
# Dropping more bits than the significand has (24) rounds to zero whatever the shift beyond.
_MAX_DROPPED_BITS = tl.constexpr(25)


@triton.jit
def round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX_VALUE: tl.constexpr):
    """fp32 ``x`` saturated to +-MAX_VALUE and rounded to nearest (ties to even) onto the grid of
    an fp8 format with MANTISSA_BITS and normal exponents from MIN_EXPONENT: a value it holds
    exactly. Integer arithmetic on the bits, so no compiler setting can change the rounding."""
    clamped = tl.minimum(tl.maximum(x, -MAX_VALUE), MAX_VALUE)
    bits = clamped.to(tl.int32, bitcast=True)
    magnitude = bits & _FP32_ABS_MASK
    exponent = (magnitude >> _FP32_MANTISSA_BITS) - _FP32_EXPONENT_BIAS
    # Below the normal range the grid's spacing stays that of MIN_EXPONENT (subnormals).
    grid_exponent = tl.maximum(exponent, MIN_EXPONENT)
    drop = tl.minimum(_FP32_MANTISSA_BITS - MANTISSA_BITS + grid_exponent - exponent, _MAX_DROPPED_BITS)
    significand = (magnitude & _FP32_MANTISSA_MASK) | _FP32_IMPLICIT_ONE
    # Round half to even: add just under half, plus one when the kept part is odd.
    kept = (significand + ((1 << (drop - 1)) - 1) + ((significand >> drop) & 1)) >> drop
    spacing_bits = (grid_exponent - MANTISSA_BITS + _FP32_EXPONENT_BIAS) << _FP32_MANTISSA_BITS
    spacing = spacing_bits.to(tl.float32, bitcast=True)
    value = kept.to(tl.float32) * spacing  # exact: a few bits times a power of two
    value = tl.where(bits < 0, -value, value)
    return tl.where(x != x, x, value)  # NaN stays NaN


@triton.jit
def _quantize(x, scale, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX_VALUE: tl.constexpr):
    # div_rn: the correctly rounded division torch makes (Triton's ``/`` may approximate).
    return round_to_fp8_grid(tl.math.div_rn(x.to(tl.float32), scale), MANTISSA_BITS, MIN_EXPONENT, MAX_VALUE)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
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
    QUANTIZE: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.wait_for_previous_grid(USE_PDL)
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
    if QUANTIZE:
        k_row = _quantize(k_row, k_scale, MANTISSA_BITS, MIN_EXPONENT, MAX_VALUE)
        v_row = _quantize(v_row, v_scale, MANTISSA_BITS, MIN_EXPONENT, MAX_VALUE)
    tl.store(k_cache_ptr + dst, k_row.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v_row.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_token_head(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, token, kv_head, k_scale, v_scale,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head, stride_cache_block, stride_cache_slot,
    stride_cache_head, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX_VALUE: tl.constexpr,
):  # fmt: skip
    """One head of one token's K and V into its cache slot (nothing for a negative slot): the
    bytes ``_write_kv_kernel`` stores for that head, through the same quantization. For a kernel
    that writes the token it is about to read (``decode_split_kernel``'s fused write)."""
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs_d = tl.arange(0, BLOCK_D)
        mask = offs_d < HEAD_DIM
        row = token.to(tl.int64)
        k_row = tl.load(k_ptr + row * stride_k_token + kv_head * stride_k_head + offs_d, mask=mask)
        v_row = tl.load(v_ptr + row * stride_v_token + kv_head * stride_v_head + offs_d, mask=mask)
        if QUANTIZE:
            k_row = _quantize(k_row, k_scale, MANTISSA_BITS, MIN_EXPONENT, MAX_VALUE)
            v_row = _quantize(v_row, v_scale, MANTISSA_BITS, MIN_EXPONENT, MAX_VALUE)
        dst = (slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_slot
        dst += kv_head * stride_cache_head + offs_d
        tl.store(k_cache_ptr + dst, k_row.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v_row.to(v_cache_ptr.dtype.element_ty), mask=mask)


def quantization_grid(cache_dtype: torch.dtype) -> Fp8Grid:
    """The fp8 grid a cache of ``cache_dtype`` is written on; e4m3's for a cache that is not fp8
    (the kernels' grid constexprs need values, which they then never read)."""
    return FP8_GRIDS[cache_dtype] if is_quantized(cache_dtype) else FP8_GRIDS[torch.float8_e4m3fn]


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels index ``head_dim`` with unit stride (that is what lets loads vectorize)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Store ``k``/``v`` (``[T, kv_heads, head_dim]``) at ``slot_mapping`` in one layer's cache views.

    ``k_cache``/``v_cache`` are ``[num_blocks, page_size, kv_heads, head_dim]`` views with
    identical strides (``KVCache.layer``). Rows whose slot is negative are skipped. An fp8
    cache stores them quantized under ``scales`` (the layer's K and V scale).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    cache_strides = k_cache.stride()
    if cache_strides != v_cache.stride():
        raise ValueError("K and V cache views must share strides (KVCache.layer gives such views)")
    if cache_strides[-1] != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    block_h = host_ints.next_power_of_2(num_kv_heads)
    block_d = host_ints.next_power_of_2(head_dim)
    num_warps = row_num_warps(block_h * block_d)
    quantized = is_quantized(k_cache.dtype)
    grid = quantization_grid(k_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        float(scales[0]),
        float(scales[1]),
        *k.stride()[:2],
        *v.stride()[:2],
        *cache_strides[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PAGE_SIZE=k_cache.shape[1],
        QUANTIZE=quantized,
        MANTISSA_BITS=grid.mantissa_bits,
        MIN_EXPONENT=grid.min_exponent,
        MAX_VALUE=grid.max_value,
        num_warps=num_warps,
        **pdl.launch(k_cache.device),
    )
