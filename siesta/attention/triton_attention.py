"""Paged attention in Triton: one launch for a mixed batch, split-KV where it is short of programs.

Four kernels, picked by the host from the step's metadata (host lists only, so
no kernel launch waits on the device):

* ``_unified_kernel`` serves any batch (prefill chunks with or without a cached
  prefix, and decode rows) in one launch. A program owns one KV head and one
  query tile of one request. Query rows are (token, head-in-group) pairs, so a
  K/V tile loaded once feeds every query head that shares it (GQA). A program
  whose request has a single query token takes a decode branch with a narrow
  tile instead of wasting a prefill-sized matrix product on one row.
* ``_decode_split_kernel`` serves decode rows: whole decode-only batches (the
  CUDA-graph path), and the decode rows of a mixed batch when their contexts are
  long enough to want splitting. It cuts each context into ``num_splits`` key
  ranges (flash-decoding) so a small batch with a long context still fills the
  GPU; ``_reduce_splits_kernel`` merges the partials through their log-sum-exp.
* ``_prefill_split_kernel`` serves the prefill rows of a batch whose query tiles are
  too few to fill the GPU over a long context (a short extend of a long cached
  prefix, as on every resume from the KV tier): each tile's keys are cut into
  ``num_splits`` ranges, and ``_reduce_splits_kernel`` merges them per token. The
  batch's decode rows then go to ``_decode_split_kernel``.
* Long prefill-only batches with no cached prefix can go to torch's
  ``scaled_dot_product_attention`` on CUDA instead (see ``TritonAttention``).

Softmax is online (flash style) in base 2 with fp32 accumulators; the K/V dtype
sets the matrix-product dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.triton_kv_write import write_kv_triton

LOG2E = math.log2(math.e)

# tl.dot needs every operand dimension to be at least this.
_MIN_DOT_DIM = 16
# Head dims above this would need tiles that no longer fit in shared memory.
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Tiles:
    """One kernel's tile shape and launch knobs."""

    block_m: int  # query rows per program (prefill: tokens x heads of one KV group)
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int  # software-pipelining depth of the K/V loads


# Keyed by the padded head dim. Prefill tiles are compute tiles: 128 query rows
# amortize each K/V tile; the key step shrinks as head_dim grows so the K/V
# stages still fit in shared memory. Retune with `siesta.bench.attention --sweep`.
_PREFILL_TILES: dict[int, Tiles] = {
    64: Tiles(block_m=128, block_n=64, num_warps=4, num_stages=3),
    # H200, bf16, 8k causal: 396 TFLOP/s; 128x64 gave 340, 256x64 406 but spills.
    128: Tiles(block_m=128, block_n=128, num_warps=8, num_stages=3),
    256: Tiles(block_m=64, block_n=32, num_warps=8, num_stages=2),
}
# 4-byte (fp32) caches: the half-precision tiles would overflow shared memory.
# fp32 is for tests and small CPU-sized runs, so these only need to fit.
_WIDE_PREFILL_TILES: dict[int, Tiles] = {
    64: Tiles(block_m=64, block_n=64, num_warps=4, num_stages=2),
    128: Tiles(block_m=64, block_n=32, num_warps=4, num_stages=2),
    256: Tiles(block_m=32, block_n=32, num_warps=4, num_stages=1),
}
# Decode tiles are bandwidth tiles: few query rows, long key steps so enough
# bytes are in flight per program.
_DECODE_TILES: dict[int, Tiles] = {
    64: Tiles(block_m=_MIN_DOT_DIM, block_n=128, num_warps=4, num_stages=3),
    128: Tiles(block_m=_MIN_DOT_DIM, block_n=64, num_warps=4, num_stages=3),
    256: Tiles(block_m=_MIN_DOT_DIM, block_n=32, num_warps=4, num_stages=3),
}
_WIDE_DECODE_TILES: dict[int, Tiles] = {
    64: Tiles(block_m=_MIN_DOT_DIM, block_n=64, num_warps=4, num_stages=2),
    128: Tiles(block_m=_MIN_DOT_DIM, block_n=32, num_warps=4, num_stages=2),
    256: Tiles(block_m=_MIN_DOT_DIM, block_n=16, num_warps=4, num_stages=2),
}
_HALF_BYTES = 2

# Split-KV: aim for this many resident programs per SM so HBM sees enough loads in flight.
_TARGET_PROGRAMS_PER_SM = 4
# A split shorter than this spends more on its partial write and the merge than it saves.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
# What the heuristic assumes when there is no CUDA device to ask (the interpreter).
_FALLBACK_SM_COUNT = 132

# Mixed batches: decode rows that would get this many splits are worth two extra
# launches (split kernel + merge); fewer, and the single unified launch wins.
MIXED_DECODE_MIN_SPLITS: int | None = 4

# Fresh prefills at least this long go to torch SDPA on CUDA (None disables).
# H200, bf16, Llama-3-8B heads (TFLOP/s, Triton vs SDPA route): 1024 tokens 136 vs
# 104, 2048 258 vs 332, 8192 394 vs 538. Re-measure with siesta/bench/attention.py.
SDPA_PREFILL_MIN_TOKENS: int | None = 2048


def _prefill_tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    wide = dtype.itemsize > _HALF_BYTES
    return _tiles_for(_WIDE_PREFILL_TILES if wide else _PREFILL_TILES, head_dim)


def _decode_tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    wide = dtype.itemsize > _HALF_BYTES
    return _tiles_for(_WIDE_DECODE_TILES if wide else _DECODE_TILES, head_dim)


def _tiles_for(table: dict[int, Tiles], head_dim: int) -> Tiles:
    padded = max(_MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    for dim in sorted(table):
        if padded <= dim:
            return table[dim]
    raise ValueError(f"head_dim {head_dim} is not supported: at most {MAX_HEAD_DIM}")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _FALLBACK_SM_COUNT
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Key-range splits per decode row (or prefill tile): enough programs to fill the GPU, none too short.

    A power of two, so the few values it takes compile few kernel variants. It only
    reads host integers; a CUDA graph captured with one value stays correct for any
    context length, because each program sizes its key range from ``seq_lens`` on device.
    """
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(sm_count * _TARGET_PROGRAMS_PER_SM, programs)
    useful = triton.cdiv(max_seq_len, _MIN_KEYS_PER_SPLIT)
    splits = max(1, min(wanted, useful, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def choose_prefill_splits(
    q_lens: Sequence[int], seq_lens: Sequence[int], block_q: int, num_kv_heads: int, sm_count: int
) -> int:
    """Key-range splits per prefill tile of a batch: more than 1 only when its prefill
    tiles are too few to fill the GPU and its contexts are long.

    One program per (query tile, KV head) walks its whole context: 44 new tokens over a
    19,456-token prefix (Llama-3-8B heads, 32-token tiles) gave 16 programs on 132 SMs.
    Each tile counts as a sequence of the longest prefill context in
    ``choose_num_splits``. Decode rows (q_len 1) are left out: they have their own
    split-KV path.
    """
    num_tiles = 0
    longest = 0
    for q_len, seq_len in zip(q_lens, seq_lens):
        if q_len > 1:
            num_tiles += triton.cdiv(q_len, block_q)
            longest = max(longest, seq_len)
    if num_tiles == 0:
        return 1
    return choose_num_splits(num_tiles, num_kv_heads, longest, sm_count)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The request owning query tile ``tile``.

    Request ``i``'s tiles start at ``query_start_loc[i] // BLOCK_Q + i``: monotonic in
    ``i`` and at least ``cdiv(q_len_i, BLOCK_Q)`` apart, so a binary search over the
    start offsets finds the owner without a host-built tile map.
    """
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _kv_offsets(
    table_row_ptr,
    key_pos,
    kv_head,
    offs_d,
    key_mask,
    stride_block,
    stride_slot,
    stride_head,
    PAGE_SIZE: tl.constexpr,
    MASK_KEYS: tl.constexpr,
):
    """Element offsets ``[BLOCK_N, BLOCK_D]`` of keys ``key_pos`` of one KV head, through the block table."""
    if MASK_KEYS:
        block = tl.load(table_row_ptr + key_pos // PAGE_SIZE, mask=key_mask, other=0)
    else:
        block = tl.load(table_row_ptr + key_pos // PAGE_SIZE)
    # int64: block index times block stride overflows 32 bits on large caches.
    row = block.to(tl.int64) * stride_block + (key_pos % PAGE_SIZE) * stride_slot + kv_head * stride_head
    return row[:, None] + offs_d[None, :]


@triton.jit
def _load_tile(ptr, offsets, key_mask, d_mask, MASK_KEYS: tl.constexpr, EVEN_D: tl.constexpr):
    if MASK_KEYS:
        return tl.load(ptr + offsets, mask=key_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptr + offsets)
    else:
        return tl.load(ptr + offsets, mask=d_mask[None, :], other=0.0)


@triton.jit
def _attend_tile(
    q,
    k_cache_ptr,
    v_cache_ptr,
    offsets,
    key_mask,
    d_mask,
    visible,
    acc,
    m_i,
    l_i,
    scale_log2,
    MASK_KEYS: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a K/V tile; ``visible`` masks scores when MASK_KEYS."""
    k = _load_tile(k_cache_ptr, offsets, key_mask, d_mask, MASK_KEYS, EVEN_D)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASK_KEYS:
        scores = tl.where(visible, scores, float("-inf"))
    # m_i is kept in scaled (log2) units; scaling the row max rather than every score
    # lets the exponent below be one fused multiply-add per score.
    m_new = tl.maximum(m_i, tl.max(scores, 1) * scale_log2)
    # Every row sees at least one key in the first tile it visits, so m_new is finite
    # and alpha is exp2(-inf) = 0 on that first step rather than NaN.
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(v_cache_ptr, offsets, key_mask, d_mask, MASK_KEYS, EVEN_D)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _normalize(acc, l_i):
    # Rows with no keys (padding requests of length 0) give zeros, not NaN.
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit
def _decode_range(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    token,
    kv_head,
    key_start,
    key_end,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_block,
    stride_slot,
    stride_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Unnormalized attention of one decode token's GROUP heads over keys [key_start, key_end)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    head_mask = offs_h < GROUP
    q_rows = token.to(tl.int64) * stride_q_token + (kv_head * GROUP + offs_h) * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=head_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(key_start, key_end, BLOCK_N):
        key_pos = start + offs_n
        key_mask = key_pos < key_end
        offsets = _kv_offsets(
            table_row_ptr, key_pos, kv_head, offs_d, key_mask, stride_block, stride_slot, stride_head, PAGE_SIZE, True
        )
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, offsets, key_mask, d_mask, key_mask[None, :],
            acc, m_i, l_i, scale_log2, True, HEAD_DIM == BLOCK_D, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _store_heads(
    out_ptr,
    token,
    kv_head,
    values,
    stride_o_token,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Write one token's GROUP query heads of KV head ``kv_head``."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    rows = token.to(tl.int64) * stride_o_token + (kv_head * GROUP + offs_h) * stride_o_head
    mask = (offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(out_ptr + rows[:, None] + offs_d[None, :], values.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefill_rows(q_tile, kv_head, q_len, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """A prefill tile's query rows: token within the request, query head, and whether the row is real."""
    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_tile * BLOCK_Q + offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    # BLOCK_M need not be a multiple of GROUP: its last rows are padding, as are the
    # rows past q_len in a request's last tile.
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    return q_tok, q_head, row_valid


@triton.jit
def _prefill_span(seq_len, q_len, q_tile, BLOCK_Q: tl.constexpr):
    """Context position of a tile's first query, and the end of the keys its rows see."""
    cached = seq_len - q_len
    first_pos = cached + q_tile * BLOCK_Q
    kv_end = cached + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    return first_pos, kv_end


@triton.jit
def _prefill_tile(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    q_start,
    q_len,
    seq_len,
    q_tile,
    kv_head,
    key_lo,
    key_hi,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_block,
    stride_slot,
    stride_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Unnormalized causal attention of BLOCK_Q query tokens (x GROUP heads) over keys [key_lo, key_hi).

    ``key_lo`` must be a multiple of BLOCK_N, and the first key tile must hold a key
    every row sees (key_lo at or before the tile's first query): ``_attend_tile``
    relies on it to keep the running max finite.
    """
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    q_tok, q_head, row_valid = _prefill_rows(q_tile, kv_head, q_len, GROUP, BLOCK_M, BLOCK_Q)
    first_pos, _ = _prefill_span(seq_len, q_len, q_tile, BLOCK_Q)
    row_pos = seq_len - q_len + q_tok

    q_rows = (q_start + q_tok).to(tl.int64) * stride_q_token + q_head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Key tiles wholly at or before the tile's first query are visible to every row:
    # no masks there, masks only on the diagonal tiles after (and on a ragged key_hi).
    unmasked_end = tl.minimum((first_pos + 1) // BLOCK_N, key_hi // BLOCK_N) * BLOCK_N
    for start in range(key_lo, unmasked_end, BLOCK_N):
        key_pos = start + offs_n
        offsets = _kv_offsets(
            table_row_ptr, key_pos, kv_head, offs_d, None, stride_block, stride_slot, stride_head, PAGE_SIZE, False
        )
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, offsets, None, d_mask, None,
            acc, m_i, l_i, scale_log2, False, EVEN_D, DOT_PRECISION,
        )  # fmt: skip
    for start in range(tl.maximum(key_lo, unmasked_end), key_hi, BLOCK_N):
        key_pos = start + offs_n
        key_mask = key_pos < key_hi
        visible = key_mask[None, :] & (key_pos[None, :] <= row_pos[:, None])
        offsets = _kv_offsets(
            table_row_ptr, key_pos, kv_head, offs_d, key_mask, stride_block, stride_slot, stride_head, PAGE_SIZE, True
        )
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, offsets, key_mask, d_mask, visible,
            acc, m_i, l_i, scale_log2, True, EVEN_D, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _store_partials(part_out_ptr, part_lse_ptr, part_row, acc, m_i, l_i, row_mask,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """One split's normalized rows (fp32) and their base-2 log-sum-exp, at partial rows ``part_row``.

    An empty split (l = 0, m = -inf) writes a zero partial with lse = -inf, which
    the merge weighs as nothing.
    """
    offs_d = tl.arange(0, BLOCK_D)
    lse = m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))
    tl.store(part_lse_ptr + part_row, tl.where(l_i > 0.0, lse, float("-inf")), mask=row_mask)
    tl.store(
        part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
        _normalize(acc, l_i),
        mask=row_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


# Batch-shape arguments are not specialized on (==1, %16): each new batch shape would
# otherwise compile a kernel variant mid-serving, seconds each.
@triton.jit(do_not_specialize=["num_reqs", "stride_table"])
def _unified_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_reqs,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_block,
    stride_slot,
    stride_head,
    stride_table,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE_BLOCK_H: tl.constexpr,
    DECODE_BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Last tiles first: in causal attention they see the most keys, so the long
    # programs start early and the short ones fill in behind them.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:
        return  # the tile-count bound over-provisions by up to one tile per request
    seq_len = tl.load(seq_lens_ptr + req)
    table_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_table
    if q_len == 1:
        # SKIP_DECODE: the split-KV kernel serves this batch's decode rows.
        if not SKIP_DECODE:
            acc, m_i, l_i = _decode_range(
                q_ptr, k_cache_ptr, v_cache_ptr, table_row_ptr, q_start, kv_head, 0, seq_len, scale_log2,
                stride_q_token, stride_q_head, stride_block, stride_slot, stride_head,
                HEAD_DIM, BLOCK_D, GROUP, DECODE_BLOCK_H, DECODE_BLOCK_N, PAGE_SIZE, DOT_PRECISION,
            )  # fmt: skip
            _store_heads(out_ptr, q_start, kv_head, _normalize(acc, l_i), stride_o_token, stride_o_head,
                         HEAD_DIM, BLOCK_D, GROUP, DECODE_BLOCK_H)  # fmt: skip
    else:
        # Names apart from the decode branch's: compiled Triton wants one type per name.
        _, kv_end = _prefill_span(seq_len, q_len, q_tile, BLOCK_Q)
        tile_acc, _, tile_l = _prefill_tile(
            q_ptr, k_cache_ptr, v_cache_ptr, table_row_ptr, q_start, q_len, seq_len, q_tile, kv_head, 0, kv_end,
            scale_log2, stride_q_token, stride_q_head, stride_block, stride_slot, stride_head,
            HEAD_DIM, BLOCK_D, GROUP, BLOCK_M, BLOCK_Q, BLOCK_N, PAGE_SIZE, DOT_PRECISION,
        )  # fmt: skip
        q_tok, q_head, row_valid = _prefill_rows(q_tile, kv_head, q_len, GROUP, BLOCK_M, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        o_rows = (q_start + q_tok).to(tl.int64) * stride_o_token + q_head * stride_o_head
        tl.store(
            out_ptr + o_rows[:, None] + offs_d[None, :],
            _normalize(tile_acc, tile_l).to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :],
        )


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_table"])
def _prefill_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_reqs,
    num_splits,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_block,
    stride_slot,
    stride_head,
    stride_table,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key range of one prefill tile: fp32 partials for ``_reduce_splits_kernel`` to merge per token."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + req)
    if q_len == 1:
        return  # a decode row: TritonAttention.decode serves it
    if q_tile * BLOCK_Q >= q_len:
        return  # the tile-count bound over-provisions by up to one tile per request
    seq_len = tl.load(seq_lens_ptr + req)
    first_pos, kv_end = _prefill_span(seq_len, q_len, q_tile, BLOCK_Q)
    # Split boundaries cut only keys [0, first_pos], which every row of the tile sees,
    # so each split's first key tile is visible to all its rows (a split starting past
    # a row's position would leave that row's running max at -inf, and exp2 at NaN).
    # The split holding first_pos takes the diagonal keys up to kv_end; later ones are
    # empty. Whole key tiles per split, as in the decode split kernel.
    keys_per_split = tl.cdiv(tl.cdiv(first_pos + 1, num_splits), BLOCK_N) * BLOCK_N
    owner = first_pos // keys_per_split
    key_lo = split * keys_per_split
    key_hi = tl.where(split < owner, key_lo + keys_per_split, tl.where(split == owner, kv_end, key_lo))
    table_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_table
    acc, m_i, l_i = _prefill_tile(
        q_ptr, k_cache_ptr, v_cache_ptr, table_row_ptr, q_start, q_len, seq_len, q_tile, kv_head, key_lo, key_hi,
        scale_log2, stride_q_token, stride_q_head, stride_block, stride_slot, stride_head,
        HEAD_DIM, BLOCK_D, GROUP, BLOCK_M, BLOCK_Q, BLOCK_N, PAGE_SIZE, DOT_PRECISION,
    )  # fmt: skip
    q_tok, q_head, row_valid = _prefill_rows(q_tile, kv_head, q_len, GROUP, BLOCK_M, BLOCK_Q)
    # Partials are [num_tokens, NUM_Q_HEADS, num_splits, HEAD_DIM]; lse drops the last dim.
    part_row = ((q_start + q_tok).to(tl.int64) * NUM_Q_HEADS + q_head) * num_splits + split
    _store_partials(part_out_ptr, part_lse_ptr, part_row, acc, m_i, l_i, row_valid, HEAD_DIM, BLOCK_D)


@triton.jit(do_not_specialize=["num_splits", "stride_table"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_splits,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_block,
    stride_slot,
    stride_head,
    stride_table,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - token != 1:
        return  # a prefill row of a mixed batch: the unified or prefill split kernel serves it
    seq_len = tl.load(seq_lens_ptr + req)
    # Whole key tiles per split, so only a context's last tile is ragged.
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    key_start = split * keys_per_split
    key_end = tl.minimum(key_start + keys_per_split, seq_len)
    table_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_table
    acc, m_i, l_i = _decode_range(
        q_ptr, k_cache_ptr, v_cache_ptr, table_row_ptr, token, kv_head, key_start, key_end, scale_log2,
        stride_q_token, stride_q_head, stride_block, stride_slot, stride_head,
        HEAD_DIM, BLOCK_D, GROUP, BLOCK_H, BLOCK_N, PAGE_SIZE, DOT_PRECISION,
    )  # fmt: skip
    if WRITE_PARTIALS:
        offs_h = tl.arange(0, BLOCK_H)
        # Partials are [num_reqs, NUM_Q_HEADS, num_splits, HEAD_DIM]; lse drops the last dim.
        part_row = (req * NUM_Q_HEADS + kv_head * GROUP + offs_h).to(tl.int64) * num_splits + split
        _store_partials(part_out_ptr, part_lse_ptr, part_row, acc, m_i, l_i, offs_h < GROUP, HEAD_DIM, BLOCK_D)
    else:
        _store_heads(out_ptr, token, kv_head, _normalize(acc, l_i), stride_o_token, stride_o_head,
                     HEAD_DIM, BLOCK_D, GROUP, BLOCK_H)  # fmt: skip


@triton.jit
def _find_token_request(query_start_loc_ptr, num_reqs, token):
    """The request owning query row ``token``: the last one starting at or before it."""
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _reduce_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_splits,
    stride_o_token,
    stride_o_head,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    """Merge split partials through their log-sum-exp into ``out``.

    PER_TOKEN=False: program ``i`` merges decode request ``i`` (partial rows per
    request) and skips prefill requests. PER_TOKEN=True: program ``i`` merges query
    token ``i`` of a prefill request (partial rows per token) and skips decode tokens,
    whose partial rows the prefill split kernel never writes; so the two paths may run
    in either order without clobbering each other.
    """
    row = tl.program_id(0)
    head = tl.program_id(1)
    if PER_TOKEN:
        req = _find_token_request(query_start_loc_ptr, num_reqs, row)
        is_decode = tl.load(query_start_loc_ptr + req + 1) - tl.load(query_start_loc_ptr + req) == 1
        if is_decode:
            return
        token = row
    else:
        token = tl.load(query_start_loc_ptr + row)
        if tl.load(query_start_loc_ptr + row + 1) - token != 1:
            return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part_row = (row.to(tl.int64) * NUM_Q_HEADS + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part_row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # All splits empty only for a zero-length padding row; keep its weights finite.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    parts = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    total = tl.sum(weights, 0)
    merged = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    dst = out_ptr + token.to(tl.int64) * stride_o_token + head * stride_o_head + offs_d
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=d_mask)


# --------------------------------------------------------------------------- host side


def _merge_width(num_splits: int) -> int:
    """The merge's split tile: one width for every split count up to ``_MAX_SPLITS``, so a
    batch with a new count does not compile a new variant mid-serving (H200: ~0.4 s)."""
    return max(triton.next_power_of_2(_MAX_SPLITS), triton.next_power_of_2(num_splits))


def _merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
                  shapes: _Shapes, num_splits: int, per_token: bool) -> None:  # fmt: skip
    """Merge split partials into ``out``: per decode row, or per prefill token (``per_token``)."""
    rows = meta.query_start_loc_cpu[-1] if per_token else meta.num_reqs
    _reduce_splits_kernel[(rows, shapes.num_q_heads)](
        part_out,
        part_lse,
        out,
        meta.query_start_loc,
        meta.num_reqs,
        num_splits,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=shapes.num_q_heads,
        HEAD_DIM=shapes.head_dim,
        BLOCK_S=_merge_width(num_splits),
        BLOCK_D=shapes.block_d,
        PER_TOKEN=per_token,
    )


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches are for tests and CPU-sized work: keep them exact rather than tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class _Shapes:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group: int
    block_d: int


def _shapes(q: torch.Tensor, k_cache: torch.Tensor) -> _Shapes:
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV heads")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported: at most {MAX_HEAD_DIM}")
    block_d = max(_MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    return _Shapes(num_q_heads, num_kv_heads, head_dim, num_q_heads // num_kv_heads, block_d)


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V cache views must share strides with a contiguous head_dim (KVCache.layer)")
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def _decode_block_h(group: int) -> int:
    return max(_MIN_DOT_DIM, triton.next_power_of_2(group))


def _prefill_block_m(tiles: Tiles, group: int) -> int:
    # A tile holds at least one token's whole group of query heads.
    return max(tiles.block_m, triton.next_power_of_2(group))


def prefill_block_q(head_dim: int, group: int, dtype: torch.dtype) -> int:
    """Query tokens per prefill tile (each token brings its ``group`` query heads as rows)."""
    return _prefill_block_m(_prefill_tiles(head_dim, dtype), group) // group


def _num_tiles(meta: AttentionMetadata, block_q: int) -> int:
    # Request i's tiles start at query_start_loc[i] // block_q + i (see _find_request).
    return meta.query_start_loc_cpu[-1] // block_q + meta.num_reqs


class TritonAttention:
    """Paged attention through Triton kernels; fresh long prefills may take torch SDPA.

    ``sdpa_prefill_min_tokens``: on CUDA, a batch of prefills with no cached prefix,
    each at least this long, runs through ``scaled_dot_product_attention`` (None: never).
    ``decode_splits``: fixes the split-KV count of decode rows (None: chosen per batch
    by ``choose_num_splits``); fix it when capturing CUDA graphs across contexts.
    ``mixed_decode_min_splits``: in a batch with prefill rows, decode rows leave the
    unified launch for the split-KV kernel when they would get at least this many
    splits (None: never).
    ``prefill_splits``: fixes the split-KV count of prefill tiles in batches with prefill
    rows (None: chosen per batch by ``choose_prefill_splits``; 1: always the unified
    kernel). With more than one split, decode rows go through ``decode``.
    """

    name = "triton"

    def __init__(
        self,
        sdpa_prefill_min_tokens: int | None = SDPA_PREFILL_MIN_TOKENS,
        decode_splits: int | None = None,
        mixed_decode_min_splits: int | None = MIXED_DECODE_MIN_SPLITS,
        prefill_splits: int | None = None,
    ) -> None:
        self.sdpa_prefill_min_tokens = sdpa_prefill_min_tokens
        self.decode_splits = decode_splits
        self.mixed_decode_min_splits = mixed_decode_min_splits
        self.prefill_splits = prefill_splits

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
        """See ``AttentionBackend.forward``; ``out`` (q's shape) receives the result if given."""
        k_cache, v_cache = kv_cache.layer(layer_idx)
        write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.stride(-1) != 1:
            raise ValueError("out must have q's shape and a contiguous head_dim")
        if meta.num_reqs == 0 or q.shape[0] == 0:
            return out
        if self.uses_sdpa(q, meta):
            self.sdpa_prefill(q, k, v, meta, scale, out)
        elif meta.is_decode_only:
            self.decode(q, k_cache, v_cache, meta, scale, out)
        else:
            self.mixed(q, k_cache, v_cache, meta, scale, out)
        return out

    def uses_sdpa(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this batch takes the SDPA path: CUDA, fresh prefills only, all long enough."""
        if self.sdpa_prefill_min_tokens is None or not q.is_cuda:
            return False
        starts = meta.query_start_loc_cpu
        q_lens = [starts[i + 1] - starts[i] for i in range(meta.num_reqs)]
        fresh = all(q_len == seq_len for q_len, seq_len in zip(q_lens, meta.seq_lens_cpu))
        return fresh and min(q_lens) >= self.sdpa_prefill_min_tokens

    def unified(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        skip_decode: bool = False,
    ) -> None:
        """Any batch in one launch: prefill tiles and decode rows side by side.

        ``skip_decode`` leaves decode rows unwritten, for ``decode`` to fill.
        """
        shapes = _shapes(q, k_cache)
        tiles = _prefill_tiles(shapes.head_dim, k_cache.dtype)
        decode_tiles = _decode_tiles(shapes.head_dim, k_cache.dtype)
        block_m = _prefill_block_m(tiles, shapes.group)
        block_q = block_m // shapes.group
        stride_block, stride_slot, stride_head = _cache_strides(k_cache, v_cache)
        _unified_kernel[(_num_tiles(meta, block_q), shapes.num_kv_heads)](
            q,
            k_cache,
            v_cache,
            out,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.num_reqs,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            stride_block,
            stride_slot,
            stride_head,
            meta.block_tables.stride(0),
            HEAD_DIM=shapes.head_dim,
            BLOCK_D=shapes.block_d,
            GROUP=shapes.group,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=tiles.block_n,
            DECODE_BLOCK_H=_decode_block_h(shapes.group),
            DECODE_BLOCK_N=decode_tiles.block_n,
            PAGE_SIZE=k_cache.shape[1],
            SKIP_DECODE=skip_decode,
            DOT_PRECISION=_dot_precision(k_cache.dtype),
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )

    def mixed(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """A batch with prefill rows: one unified launch, unless some rows want splitting.

        Prefill rows: a short extend of a long cached prefix (every resume from the KV
        tier) has a handful of query tiles, each walking the whole context; with too few
        tiles to fill the GPU (see ``prefill_num_splits``) they go to the prefill
        split-KV kernel and decode rows to ``decode``, and no unified launch is needed.

        Decode rows: the unified kernel gives each one program per KV head that walks the
        whole context; a few long decode rows next to a short chunk then finish last by
        far (H200: 4 decodes at 32k beside a 512-token chunk took 0.83 ms in one launch,
        0.18 ms with the decode rows split out). When the split heuristic asks for
        at least ``mixed_decode_min_splits`` splits, decode rows go to the split-KV kernel.
        """
        starts = meta.query_start_loc_cpu
        decode_lens = [meta.seq_lens_cpu[i] for i in range(meta.num_reqs) if starts[i + 1] - starts[i] == 1]
        num_kv_heads = k_cache.shape[2]
        decode_splits = 0
        if decode_lens:
            decode_splits = self.num_splits(len(decode_lens), max(decode_lens), num_kv_heads, q.device)
        prefill_splits = self.prefill_num_splits(q, k_cache, meta)
        if prefill_splits > 1:
            # Decode rows first: the per-token merge skips them, so the order is free, and
            # this one lets the tests catch a merge that would clobber them.
            if decode_lens:
                self.decode(q, k_cache, v_cache, meta, scale, out, num_splits=decode_splits)
            self.split_prefill(q, k_cache, v_cache, meta, scale, out, prefill_splits)
            return
        min_splits = self.mixed_decode_min_splits
        split_decodes = bool(decode_lens) and min_splits is not None and decode_splits >= min_splits
        self.unified(q, k_cache, v_cache, meta, scale, out, skip_decode=split_decodes)
        if split_decodes:
            self.decode(q, k_cache, v_cache, meta, scale, out, num_splits=decode_splits)

    def prefill_num_splits(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> int:
        """Key-range splits per prefill tile for this batch (1: the unified kernel serves it)."""
        if self.prefill_splits is not None:
            return self.prefill_splits
        _, num_q_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        block_q = prefill_block_q(head_dim, num_q_heads // num_kv_heads, k_cache.dtype)
        starts = meta.query_start_loc_cpu
        q_lens = [starts[i + 1] - starts[i] for i in range(meta.num_reqs)]
        return choose_prefill_splits(q_lens, meta.seq_lens_cpu, block_q, num_kv_heads, _device_sm_count(q.device))

    def split_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        num_splits: int,
    ) -> None:
        """Prefill rows over ``num_splits`` key ranges per tile, merged per token. Decode rows are skipped."""
        shapes = _shapes(q, k_cache)
        tiles = _prefill_tiles(shapes.head_dim, k_cache.dtype)
        block_m = _prefill_block_m(tiles, shapes.group)
        num_tokens = meta.query_start_loc_cpu[-1]
        # fp32 partials: the merge must not round what the split kernels accumulated.
        part_lse = torch.empty((num_tokens, shapes.num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        part_out = torch.empty((*part_lse.shape, shapes.head_dim), dtype=torch.float32, device=q.device)
        stride_block, stride_slot, stride_head = _cache_strides(k_cache, v_cache)
        block_q = block_m // shapes.group
        _prefill_split_kernel[(_num_tiles(meta, block_q), shapes.num_kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            part_out,
            part_lse,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.num_reqs,
            num_splits,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            stride_block,
            stride_slot,
            stride_head,
            meta.block_tables.stride(0),
            NUM_Q_HEADS=shapes.num_q_heads,
            HEAD_DIM=shapes.head_dim,
            BLOCK_D=shapes.block_d,
            GROUP=shapes.group,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=tiles.block_n,
            PAGE_SIZE=k_cache.shape[1],
            DOT_PRECISION=_dot_precision(k_cache.dtype),
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
        _merge_splits(part_out, part_lse, out, meta, shapes, num_splits, per_token=True)

    def num_splits(self, num_decodes: int, max_seq_len: int, num_kv_heads: int, device: torch.device) -> int:
        if self.decode_splits is not None:
            return self.decode_splits
        return choose_num_splits(num_decodes, num_kv_heads, max_seq_len, _device_sm_count(device))

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        num_splits: int | None = None,
    ) -> None:
        """Decode rows (one query each): split-KV, then merge if split. Other rows are skipped."""
        shapes = _shapes(q, k_cache)
        tiles = _decode_tiles(shapes.head_dim, k_cache.dtype)
        if num_splits is None:
            num_splits = self.num_splits(meta.num_reqs, meta.max_seq_len, shapes.num_kv_heads, q.device)
        splits = num_splits
        num_reqs = meta.num_reqs
        write_partials = splits > 1
        # fp32 partials: the merge must not round what the split kernels accumulated.
        part_shape = (num_reqs, shapes.num_q_heads, splits) if write_partials else (1, 1, 1)
        part_lse = torch.empty(part_shape, dtype=torch.float32, device=q.device)
        part_out = torch.empty((*part_shape, shapes.head_dim), dtype=torch.float32, device=q.device)
        stride_block, stride_slot, stride_head = _cache_strides(k_cache, v_cache)
        _decode_split_kernel[(num_reqs, shapes.num_kv_heads, splits)](
            q,
            k_cache,
            v_cache,
            out,
            part_out,
            part_lse,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            splits,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            stride_block,
            stride_slot,
            stride_head,
            meta.block_tables.stride(0),
            NUM_Q_HEADS=shapes.num_q_heads,
            HEAD_DIM=shapes.head_dim,
            BLOCK_D=shapes.block_d,
            GROUP=shapes.group,
            BLOCK_H=_decode_block_h(shapes.group),
            BLOCK_N=tiles.block_n,
            PAGE_SIZE=k_cache.shape[1],
            WRITE_PARTIALS=write_partials,
            DOT_PRECISION=_dot_precision(k_cache.dtype),
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
        if write_partials:
            _merge_splits(part_out, part_lse, out, meta, shapes, splits, per_token=False)

    def sdpa_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Fresh prefills through torch SDPA, one request at a time.

        SDPA's own GQA flag beat expanding K/V to the query heads on the H200 (its flash
        kernel reads each KV head once; expanding costs a copy), see siesta/bench/attention.py.
        """
        starts = meta.query_start_loc_cpu
        for i in range(meta.num_reqs):
            s, e = starts[i], starts[i + 1]
            o = F.scaled_dot_product_attention(
                _heads_first(q[s:e]),
                _heads_first(k[s:e].to(q.dtype)),
                _heads_first(v[s:e].to(q.dtype)),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[s:e] = o.squeeze(0).transpose(0, 1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, heads, D]`` -> ``[1, heads, L, D]`` (a view), SDPA's layout."""
    return x.transpose(0, 1).unsqueeze(0)
