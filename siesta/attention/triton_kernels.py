"""The Triton paged-attention kernels (device code); ``triton_attention`` picks and launches them.

Shared pieces (``_attend_tile``, ``_decode_range``, ``_prefill_tile``) are
inlined into four launchable kernels: ``unified_kernel`` (any batch),
``prefill_split_kernel`` and ``decode_split_kernel`` (split-KV), and
``reduce_splits_kernel`` (the log-sum-exp merge of split partials).

An fp8 cache (``KV_FP8``) is read raw: each K/V tile's e4m3 values widen exactly to fp16 (one
conversion instruction a pair of values; to bf16 it takes four a value, through fp32), and the
query goes to fp16 times a power of two (``_fp8_query``). K's scale and that power fold into the
softmax scale, V's scale multiplies the accumulator once after the key loop: q.k is exact, and
the probabilities round to fp16 (finer than bf16). Against dequantizing each tile
(``x.to(fp32) * scale`` to bf16, as vLLM's Triton attention does; shipped until run 56): the
split-KV decode 5-17 % faster, the prefill tile 6-7 % slower, the kept fp8 resume's p50 2 %
lower, inside its noise (H100 run 56b,
``python -m siesta.bench.invariant_attention``; H200 run 56c, ``bench/gpu.sh --sections resume
--kv-cache-dtype fp8``). Widening to bf16 instead (runs 51g-52a) slowed every wgmma tile 12-27 %.
"""

import triton
import triton.language as tl

from siesta import arrivals, pdl
from siesta.attention.triton_kv_write import store_token_head


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
def _table_blocks(table_row_ptr, key_pos, key_mask, PAGE_SIZE: tl.constexpr):
    """The cache block holding each of keys ``key_pos`` (0 where ``key_mask`` is off), read from the
    request's block-table row."""
    return tl.load(table_row_ptr + key_pos // PAGE_SIZE, mask=key_mask, other=0)


@triton.jit
def _block_offsets(block, key_pos, kv_head, offs_d, stride_block, stride_slot, stride_head, PAGE_SIZE: tl.constexpr):
    """Element offsets ``[BLOCK_N, BLOCK_D]`` of keys ``key_pos`` of one KV head, held in cache blocks ``block``."""
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
    KV_FP8: tl.constexpr,
):
    """One online-softmax step over a K/V tile; ``visible`` masks scores when MASK_KEYS.

    Over an fp8 cache ``q`` and ``scale_log2`` are ``_fp8_query``'s: the raw e4m3 values widen
    to the query's dtype (exactly: fp16 or fp32) and the scales apply outside the tile."""
    k = _load_tile(k_cache_ptr, offsets, key_mask, d_mask, MASK_KEYS, EVEN_D)
    if KV_FP8:
        k = k.to(q.dtype)
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
    if KV_FP8:
        v = v.to(q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fp8_query(q, scale_log2, k_scale):
    """The query tile for products with raw e4m3 keys, and the score scale that undoes what it
    folds in. A 16-bit query goes to fp16, whose one conversion instruction widens two e4m3
    values exactly (to bf16 it takes four a value, through fp32), times a power of two that puts
    the tile's largest magnitude in [2^14, 2^15): inside fp16's range, and every bf16 value that
    matters (down to 2^-24 of the largest) converts exactly. An fp32 query stays fp32."""
    # One return, after a compile-time branch: Triton compiles every return it reaches.
    if q.dtype == tl.float32:
        scale_log2 = scale_log2 * k_scale
    else:
        wide = q.to(tl.float32)
        top = tl.max(tl.max(tl.abs(wide), 1), 0)
        shift = tl.where(top > 0.0, 14.0 - tl.floor(tl.log2(top)), 0.0)
        q = (wide * tl.exp2(shift)).to(tl.float16)
        scale_log2 = scale_log2 * k_scale * tl.exp2(-shift)
    return q, scale_log2


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
    k_scale,
    v_scale,
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
    KV_FP8: tl.constexpr,
):
    """Unnormalized attention of one decode token's GROUP heads over keys [key_start, key_end)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    head_mask = offs_h < GROUP
    q_rows = token.to(tl.int64) * stride_q_token + (kv_head * GROUP + offs_h) * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=head_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:
        q, scale_log2 = _fp8_query(q, scale_log2, k_scale)
    else:  # the products run in the cache's dtype
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # Each step reads the next step's block-table entries, so a K/V tile's address does not wait on
    # a load of its own step. Triton's pipeliner then gives the K/V copies num_stages - 1 buffers
    # and keeps the next tile in flight over this one's products; with the table read inside the
    # step it gave them one buffer, copied after the products and awaited at once (TTGIR, Triton
    # 3.6 and 3.9, sm_90): no overlap within a program at any num_stages.
    block = _table_blocks(table_row_ptr, key_start + offs_n, key_start + offs_n < key_end, PAGE_SIZE)
    for start in range(key_start, key_end, BLOCK_N):
        key_pos = start + offs_n
        key_mask = key_pos < key_end
        offsets = _block_offsets(block, key_pos, kv_head, offs_d, stride_block, stride_slot, stride_head, PAGE_SIZE)
        block = _table_blocks(table_row_ptr, key_pos + BLOCK_N, key_pos + BLOCK_N < key_end, PAGE_SIZE)
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, offsets, key_mask, d_mask, key_mask[None, :],
            acc, m_i, l_i, scale_log2, True, HEAD_DIM == BLOCK_D, DOT_PRECISION, KV_FP8,
        )  # fmt: skip
    if KV_FP8:  # the values' scale, outside the tiles: the sum is linear in them
        acc = acc * v_scale
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
    k_scale,
    v_scale,
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
    KV_FP8: tl.constexpr,
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
    if KV_FP8:
        q, scale_log2 = _fp8_query(q, scale_log2, k_scale)
    else:  # the products run in the cache's dtype
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Key tiles wholly at or before the tile's first query are visible to every row:
    # no masks there, masks only on the diagonal tiles after (and on a ragged key_hi).
    unmasked_end = tl.minimum((first_pos + 1) // BLOCK_N, key_hi // BLOCK_N) * BLOCK_N
    # As in ``_decode_range``, each step reads the next step's block-table entries. The next
    # tile's entries may lie past the unmasked range, so that read is masked to the keys' end.
    block = _table_blocks(table_row_ptr, key_lo + offs_n, key_lo + offs_n < key_hi, PAGE_SIZE)
    for start in range(key_lo, unmasked_end, BLOCK_N):
        key_pos = start + offs_n
        offsets = _block_offsets(block, key_pos, kv_head, offs_d, stride_block, stride_slot, stride_head, PAGE_SIZE)
        block = _table_blocks(table_row_ptr, key_pos + BLOCK_N, key_pos + BLOCK_N < key_hi, PAGE_SIZE)
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, offsets, None, d_mask, None,
            acc, m_i, l_i, scale_log2, False, EVEN_D, DOT_PRECISION, KV_FP8,
        )  # fmt: skip
    masked_start = tl.maximum(key_lo, unmasked_end)
    block = _table_blocks(table_row_ptr, masked_start + offs_n, masked_start + offs_n < key_hi, PAGE_SIZE)
    for start in range(masked_start, key_hi, BLOCK_N):
        key_pos = start + offs_n
        key_mask = key_pos < key_hi
        visible = key_mask[None, :] & (key_pos[None, :] <= row_pos[:, None])
        offsets = _block_offsets(block, key_pos, kv_head, offs_d, stride_block, stride_slot, stride_head, PAGE_SIZE)
        block = _table_blocks(table_row_ptr, key_pos + BLOCK_N, key_pos + BLOCK_N < key_hi, PAGE_SIZE)
        acc, m_i, l_i = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, offsets, key_mask, d_mask, visible,
            acc, m_i, l_i, scale_log2, True, EVEN_D, DOT_PRECISION, KV_FP8,
        )  # fmt: skip
    if KV_FP8:
        acc = acc * v_scale
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
def unified_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_reqs,
    scale_log2,
    k_scale,
    v_scale,
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
    DECODE_MAX_Q: tl.constexpr = 1,
    KV_FP8: tl.constexpr = False,
):
    """Requests of at most ``DECODE_MAX_Q`` tokens take the decode branch; 0 sends one-token
    requests through the prefill tile too: the bits deterministic mode's decode rows must have
    whichever kernel computes them (``siesta.bench.invariant_attention`` compares them)."""
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
    if q_len <= DECODE_MAX_Q:
        # SKIP_DECODE: the split-KV kernel serves this batch's decode rows.
        if not SKIP_DECODE:
            acc, m_i, l_i = _decode_range(
                q_ptr, k_cache_ptr, v_cache_ptr, table_row_ptr, q_start, kv_head, 0, seq_len, scale_log2,
                k_scale, v_scale, stride_q_token, stride_q_head, stride_block, stride_slot, stride_head,
                HEAD_DIM, BLOCK_D, GROUP, DECODE_BLOCK_H, DECODE_BLOCK_N, PAGE_SIZE, DOT_PRECISION, KV_FP8,
            )  # fmt: skip
            _store_heads(out_ptr, q_start, kv_head, _normalize(acc, l_i), stride_o_token, stride_o_head,
                         HEAD_DIM, BLOCK_D, GROUP, DECODE_BLOCK_H)  # fmt: skip
    else:
        # Names apart from the decode branch's: compiled Triton wants one type per name.
        _, kv_end = _prefill_span(seq_len, q_len, q_tile, BLOCK_Q)
        tile_acc, _, tile_l = _prefill_tile(
            q_ptr, k_cache_ptr, v_cache_ptr, table_row_ptr, q_start, q_len, seq_len, q_tile, kv_head, 0, kv_end,
            scale_log2, k_scale, v_scale, stride_q_token, stride_q_head, stride_block, stride_slot, stride_head,
            HEAD_DIM, BLOCK_D, GROUP, BLOCK_M, BLOCK_Q, BLOCK_N, PAGE_SIZE, DOT_PRECISION, KV_FP8,
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
def prefill_split_kernel(
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
    k_scale,
    v_scale,
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
    KV_FP8: tl.constexpr = False,
):
    """One key range of one prefill tile: fp32 partials for ``reduce_splits_kernel`` to merge per token."""
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
        scale_log2, k_scale, v_scale, stride_q_token, stride_q_head, stride_block, stride_slot, stride_head,
        HEAD_DIM, BLOCK_D, GROUP, BLOCK_M, BLOCK_Q, BLOCK_N, PAGE_SIZE, DOT_PRECISION, KV_FP8,
    )  # fmt: skip
    q_tok, q_head, row_valid = _prefill_rows(q_tile, kv_head, q_len, GROUP, BLOCK_M, BLOCK_Q)
    # Partials are [num_tokens, NUM_Q_HEADS, num_splits, HEAD_DIM]; lse drops the last dim.
    part_row = ((q_start + q_tok).to(tl.int64) * NUM_Q_HEADS + q_head) * num_splits + split
    _store_partials(part_out_ptr, part_lse_ptr, part_row, acc, m_i, l_i, row_valid, HEAD_DIM, BLOCK_D)


@triton.jit(do_not_specialize=["num_splits", "stride_table"])
def decode_split_kernel(
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
    k_scale,
    v_scale,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_block,
    stride_slot,
    stride_head,
    stride_table,
    # The fused write (read only under WRITE_KV): the step's new K/V rows and their slots.
    k_new_ptr,
    v_new_ptr,
    slot_mapping_ptr,
    stride_k_new_token,
    stride_k_new_head,
    stride_v_new_token,
    stride_v_new_head,
    # The fused merge (read only under FUSED_MERGE): a zeroed int32 counter a (request, KV head).
    merge_counter_ptr,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WRITE_KV: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,  # the cache's fp8 grid, for the fused write's quantization
    FP8_MIN_EXPONENT: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
    KV_FP8: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 1,  # the fused merge's split tile (``reduce_splits_kernel``'s)
    USE_PDL: tl.constexpr = False,
):
    pdl.wait_for_previous_grid(USE_PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - token != 1:
        return  # a prefill row of a mixed batch: the unified or prefill split kernel serves it
    seq_len = tl.load(seq_lens_ptr + req)
    # Whole key tiles per split, so only a context's last tile is ragged.
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    if WRITE_KV:
        # The program whose range holds the new token stores its K/V for this head, then reads
        # it back with the rest: no other program reads that slot in this step (a block being
        # filled belongs to its request alone). The barrier makes every thread's store visible
        # to the loads after it.
        if split == (seq_len - 1) // tl.maximum(keys_per_split, 1):
            store_token_head(
                k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, token, kv_head, k_scale, v_scale,
                stride_k_new_token, stride_k_new_head, stride_v_new_token, stride_v_new_head,
                stride_block, stride_slot, stride_head, HEAD_DIM, BLOCK_D, PAGE_SIZE, KV_FP8,
                FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_MAX_VALUE,
            )  # fmt: skip
            tl.debug_barrier()
    key_start = split * keys_per_split
    key_end = tl.minimum(key_start + keys_per_split, seq_len)
    table_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_table
    acc, m_i, l_i = _decode_range(
        q_ptr, k_cache_ptr, v_cache_ptr, table_row_ptr, token, kv_head, key_start, key_end, scale_log2,
        k_scale, v_scale, stride_q_token, stride_q_head, stride_block, stride_slot, stride_head,
        HEAD_DIM, BLOCK_D, GROUP, BLOCK_H, BLOCK_N, PAGE_SIZE, DOT_PRECISION, KV_FP8,
    )  # fmt: skip
    if WRITE_PARTIALS:
        offs_h = tl.arange(0, BLOCK_H)
        # Partials are [num_reqs, NUM_Q_HEADS, num_splits, HEAD_DIM]; lse drops the last dim.
        part_row = (req * NUM_Q_HEADS + kv_head * GROUP + offs_h).to(tl.int64) * num_splits + split
        _store_partials(part_out_ptr, part_lse_ptr, part_row, acc, m_i, l_i, offs_h < GROUP, HEAD_DIM, BLOCK_D)
        if FUSED_MERGE:
            _merge_if_last(part_out_ptr, part_lse_ptr, out_ptr, merge_counter_ptr, req, token, kv_head, num_splits,
                           stride_o_token, stride_o_head, NUM_Q_HEADS, HEAD_DIM, BLOCK_D, GROUP, BLOCK_S)  # fmt: skip
    else:
        _store_heads(out_ptr, token, kv_head, _normalize(acc, l_i), stride_o_token, stride_o_head,
                     HEAD_DIM, BLOCK_D, GROUP, BLOCK_H)  # fmt: skip


@triton.jit
def _merge_if_last(part_out_ptr, part_lse_ptr, out_ptr, merge_counter_ptr, req, token, kv_head, num_splits,
                   stride_o_token, stride_o_head, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """The fused merge: each split's program counts itself in on its (request, KV head); the
    last of them merges the GROUP heads' partials as ``reduce_splits_kernel`` does (one head at
    a time, the same arithmetic) and sets the count back to zero for the next launch.

    (``siesta/arrivals.py`` says why the last one sees every split's partials.)"""
    counter = merge_counter_ptr + req * (NUM_Q_HEADS // GROUP) + kv_head
    if arrivals.arrive(counter) == num_splits - 1:
        for h in tl.static_range(GROUP):
            head = kv_head * GROUP + h
            dst = out_ptr + token.to(tl.int64) * stride_o_token + head * stride_o_head
            _merge_row(part_out_ptr, part_lse_ptr, (req.to(tl.int64) * NUM_Q_HEADS + head) * num_splits, num_splits,
                       dst, HEAD_DIM, BLOCK_S, BLOCK_D, True)  # fmt: skip
        arrivals.reset(counter)


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
def reduce_splits_kernel(
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
    USE_PDL: tl.constexpr,
):
    """Merge split partials through their log-sum-exp into ``out``.

    PER_TOKEN=False: program ``i`` merges decode request ``i`` (partial rows per
    request) and skips prefill requests. PER_TOKEN=True: program ``i`` merges query
    token ``i`` of a prefill request (partial rows per token) and skips decode tokens,
    whose partial rows the prefill split kernel never writes; so the two paths may run
    in either order without clobbering each other.
    """
    pdl.wait_for_previous_grid(USE_PDL)
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
    dst = out_ptr + token.to(tl.int64) * stride_o_token + head * stride_o_head
    _merge_row(part_out_ptr, part_lse_ptr, (row.to(tl.int64) * NUM_Q_HEADS + head) * num_splits, num_splits, dst,
               HEAD_DIM, BLOCK_S, BLOCK_D, False)  # fmt: skip


@triton.jit
def _merge_row(part_out_ptr, part_lse_ptr, first_part, num_splits, dst_ptr, HEAD_DIM: tl.constexpr,
               BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PAST_L1: tl.constexpr):  # fmt: skip
    """One head's ``num_splits`` partials (rows ``first_part`` on) merged through their
    log-sum-exp and stored at ``dst_ptr``. ``PAST_L1``: read them from L2, where other SMs'
    programs wrote them in this launch (this SM's L1 may hold an earlier layer's lines)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part_row = first_part + offs_s
    lse_ptrs = part_lse_ptr + part_row
    out_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :]
    out_mask = s_mask[:, None] & d_mask[None, :]
    if PAST_L1:
        lse = tl.load(lse_ptrs, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(out_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
    else:
        lse = tl.load(lse_ptrs, mask=s_mask, other=float("-inf"))
        parts = tl.load(out_ptrs, mask=out_mask, other=0.0)
    lse_max = tl.max(lse, 0)
    # All splits empty only for a zero-length padding row; keep its weights finite.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, 0)
    merged = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(dst_ptr + offs_d, merged.to(dst_ptr.dtype.element_ty), mask=d_mask)
