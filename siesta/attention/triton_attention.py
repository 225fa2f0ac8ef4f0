"""Paged attention in Triton: one launch for a mixed batch, split-KV where it is short of programs.

Four kernels (device code in ``triton_kernels``; tile shapes and split counts
in ``triton_tiles``), picked here from the step's metadata (host lists only, so
no kernel launch waits on the device):

* ``unified_kernel`` serves any batch (prefill chunks with or without a cached
  prefix, and decode rows) in one launch. A program owns one KV head and one
  query tile of one request. Query rows are (token, head-in-group) pairs, so a
  K/V tile loaded once feeds every query head that shares it (GQA). A program
  whose request has a single query token takes a decode branch with a narrow
  tile instead of wasting a prefill-sized matrix product on one row.
* ``decode_split_kernel`` serves decode rows: whole decode-only batches (the
  CUDA-graph path), and the decode rows of a mixed batch when their contexts are
  long enough to want splitting. It cuts each context into ``num_splits`` key
  ranges (flash-decoding) so a small batch with a long context still fills the
  GPU; ``reduce_splits_kernel`` merges the partials through their log-sum-exp
  (or, with ``FUSE_DECODE_MERGE``, the last of a row's split programs to finish does).
* ``prefill_split_kernel`` serves the prefill rows of a batch whose query tiles are
  too few to fill the GPU over a long context (a short extend of a long cached
  prefix, as on every resume from the KV tier): each tile's keys are cut into
  ``num_splits`` ranges, and ``reduce_splits_kernel`` merges them per token. The
  batch's decode rows then go to ``decode_split_kernel``.
* Long prefill-only batches with no cached prefix can go to torch's
  ``scaled_dot_product_attention`` on CUDA instead (see ``TritonAttention``).

Softmax is online (flash style) in base 2 with fp32 accumulators; the K/V dtype
sets the matrix-product dtype. An fp8 cache (``kv_quant``) is written quantized and read
dequantized in registers, the products then in the query's dtype; every prompt chunk reads its
own K/V back from the cache, as decode will (the SDPA route too), so the two agree.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from siesta import arrivals, host_ints, pdl
from siesta.attention import triton_kernels as kernels
from siesta.attention import triton_tiles as tiling
from siesta.attention.base import AttentionMetadata, KVCache
from siesta.attention.kv_quant import dequantize, is_quantized
from siesta.attention.triton_kv_write import quantization_grid, write_kv_triton

LOG2E = math.log2(math.e)
# The K and V scales of a cache that is not quantized (the kernels ignore them).
UNIT_SCALES = (1.0, 1.0)

# Mixed batches: decode rows that would get this many splits are worth two extra
# launches (split kernel + merge); fewer, and the single unified launch wins.
MIXED_DECODE_MIN_SPLITS: int | None = 4

# Fresh prefills at least this long go to torch SDPA on CUDA (None disables).
# H200, bf16, Llama-3-8B heads (TFLOP/s, Triton vs SDPA route): 1024 tokens 136 vs
# 104, 2048 258 vs 332, 8192 394 vs 538. Re-measure with siesta/bench/attention.py.
SDPA_PREFILL_MIN_TOKENS: int | None = 2048

# Decode-only steps: the split kernel stores the new token's K/V itself (the program whose key
# range holds it, before it reads it), one launch a layer fewer than the write kernel's (1.4 us
# and its gap in a Qwen3-30B-A3B batch-1 step, H200 run 63a): that step 1.02x (H100 run 64b, the
# moe bench's ``knobs`` arm ``kv_fused``), 1.00x at 16 and 64; the same cache bytes either way.
FUSE_DECODE_KV_WRITE = True

# Split decode steps: the last program of each (request, KV head) to finish merges the splits'
# partials itself (``siesta/arrivals.py``), instead of ``reduce_splits_kernel``'s
# launch a layer after the split kernel (2.4 us and its gap in a Qwen3-30B-A3B batch-1 step, H200
# run 63a). The same arithmetic, so the same bits (tested). Off until a card measures it: the moe
# bench's ``knobs`` arm ``fused_merge``.
FUSE_DECODE_MERGE = False


def _scratch(meta: AttentionMetadata, key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An fp32 buffer the step's layers share: they run one after another on one stream. Under
    CUDA-graph capture each layer takes its own from the graph's pool, since a buffer cached at
    the warm-up would be freed with its metadata while the graph still writes it."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(shape, dtype=torch.float32, device=device)
    return meta.once_a_step(("scratch", key, shape), lambda: torch.empty(shape, dtype=torch.float32, device=device))


def _merge_width(num_splits: int) -> int:
    """The merge's split tile: one width for every split count up to ``tiling.MAX_SPLITS``, so a
    batch with a new count does not compile a new variant mid-serving (H200: ~0.4 s)."""
    return max(host_ints.next_power_of_2(tiling.MAX_SPLITS), host_ints.next_power_of_2(num_splits))


def _merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata,
                  shapes: _Shapes, num_splits: int, per_token: bool) -> None:  # fmt: skip
    """Merge split partials into ``out``: per decode row, or per prefill token (``per_token``)."""
    rows = meta.query_start_loc_cpu[-1] if per_token else meta.num_reqs
    kernels.reduce_splits_kernel[(rows, shapes.num_q_heads)](
        part_out,
        part_lse,
        out,
        meta.query_start_loc,
        meta.num_reqs,
        num_splits,
        *out.stride()[:2],
        NUM_Q_HEADS=shapes.num_q_heads,
        HEAD_DIM=shapes.head_dim,
        BLOCK_S=_merge_width(num_splits),
        BLOCK_D=shapes.block_d,
        PER_TOKEN=per_token,
        **pdl.launch(out.device),
    )


def _compute_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The matrix products' dtype: the cache's, or the query's over an fp8 cache (dequantized to it)."""
    return q.dtype if is_quantized(k_cache.dtype) else k_cache.dtype


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches are for tests and CPU-sized work: keep them exact rather than tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class MixedPlan:
    """How a batch with prefill rows is served (``TritonAttention.mixed``)."""

    decode_splits: int  # key ranges a decode row's context is cut into; 0: no decode rows
    prefill_splits: int  # key ranges a prefill tile's; 1: the unified kernel serves the prefill rows
    split_decodes: bool  # beside a unified launch, the decode rows go to the split-KV kernel


@dataclass(frozen=True)
class _Shapes:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group: int
    block_d: int


def _shapes(q: torch.Tensor, k_cache: torch.Tensor) -> _Shapes:
    return _shapes_of(q.shape[1], q.shape[2], k_cache.shape[2])


@functools.cache
def _shapes_of(num_q_heads: int, head_dim: int, num_kv_heads: int) -> _Shapes:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not split into {num_kv_heads} KV heads")
    if head_dim > tiling.MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported: at most {tiling.MAX_HEAD_DIM}")
    block_d = max(tiling.MIN_DOT_DIM, host_ints.next_power_of_2(head_dim))
    return _Shapes(num_q_heads, num_kv_heads, head_dim, num_q_heads // num_kv_heads, block_d)


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    strides = k_cache.stride()
    if strides != v_cache.stride() or strides[-1] != 1:
        raise ValueError("K and V cache views must share strides with a contiguous head_dim (KVCache.layer)")
    return strides[0], strides[1], strides[2]


def _decode_block_h(group: int) -> int:
    return max(tiling.MIN_DOT_DIM, host_ints.next_power_of_2(group))


def _prefill_block_m(tiles: tiling.Tiles, group: int) -> int:
    # A tile holds at least one token's whole group of query heads.
    return max(tiles.block_m, host_ints.next_power_of_2(group))


def prefill_block_q(head_dim: int, group: int, dtype: torch.dtype) -> int:
    """Query tokens per prefill tile (each token brings its ``group`` query heads as rows)."""
    return _prefill_block_m(tiling.prefill_tiles(head_dim, dtype), group) // group


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
        scales = kv_cache.layer_scales(layer_idx)
        fused_write = FUSE_DECODE_KV_WRITE and meta.is_decode_only and meta.num_reqs > 0 and q.shape[0] > 0
        if not fused_write:
            write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping, scales)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
            raise ValueError("out must have q's shape and a contiguous head_dim")
        if meta.num_reqs == 0 or q.shape[0] == 0:
            return torch.empty_like(q) if out is None else out
        if self.uses_sdpa(q, meta):
            if kv_cache.quantized:  # what decode will read: the chunk as written, dequantized
                k, v = self._written(k_cache, v_cache, meta.slot_mapping, scales, q.dtype)
            return self.sdpa_prefill(q, k, v, meta, scale, out)
        out = torch.empty_like(q) if out is None else out
        if meta.is_decode_only:
            self.decode(q, k_cache, v_cache, meta, scale, out, scales=scales, new_kv=(k, v) if fused_write else None)
        else:
            self.mixed(q, k_cache, v_cache, meta, scale, out, scales=scales)
        return out

    @staticmethod
    def _written(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, scales: tuple[float, float],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The K/V the step just wrote at ``slots``, read back from an fp8 cache and dequantized."""
        page = k_cache.shape[1]
        block, offset = slots // page, slots % page  # the layer's view is strided: index, never reshape
        k, v = k_cache[block, offset], v_cache[block, offset]
        return dequantize(k, scales[0], dtype), dequantize(v, scales[1], dtype)

    def uses_sdpa(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this batch takes the SDPA path: CUDA, fresh prefills only, all long enough."""
        if self.sdpa_prefill_min_tokens is None or not q.is_cuda:
            return False
        return meta.once_a_step(("sdpa", self.sdpa_prefill_min_tokens), lambda: self._all_long_and_fresh(meta))

    def _all_long_and_fresh(self, meta: AttentionMetadata) -> bool:
        assert self.sdpa_prefill_min_tokens is not None
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
        decode_as_prefill: bool = False,
        scales: tuple[float, float] = UNIT_SCALES,
    ) -> None:
        """Any batch in one launch: prefill tiles and decode rows side by side.

        ``skip_decode`` leaves decode rows unwritten, for ``decode`` to fill;
        ``decode_as_prefill`` computes them with the prefill tile: the bits deterministic mode's
        decode rows must have (``siesta.bench.invariant_attention`` checks them against it).
        ``scales``: the layer's K and V scales, for an fp8 cache.
        """
        shapes = _shapes(q, k_cache)
        dtype = _compute_dtype(q, k_cache)
        tiles = tiling.prefill_tiles(shapes.head_dim, dtype)
        # The unified launch's decode rows keep the 64-key step over fp8 too: the 128-key fp8 step
        # was timed (run 51g) in the 4-warp split kernel only, not beside this launch's prefill tiles.
        decode_tiles = tiling.decode_tiles(shapes.head_dim, dtype)
        block_m = _prefill_block_m(tiles, shapes.group)
        block_q = block_m // shapes.group
        stride_block, stride_slot, stride_head = _cache_strides(k_cache, v_cache)
        kernels.unified_kernel[(_num_tiles(meta, block_q), shapes.num_kv_heads)](
            q,
            k_cache,
            v_cache,
            out,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.num_reqs,
            scale * LOG2E,
            float(scales[0]),
            float(scales[1]),
            *q.stride()[:2],
            *out.stride()[:2],
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
            DOT_PRECISION=_dot_precision(dtype),
            DECODE_MAX_Q=0 if decode_as_prefill else 1,
            KV_FP8=is_quantized(k_cache.dtype),
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
        scales: tuple[float, float] = UNIT_SCALES,
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
        key = ("mixed", self.decode_splits, self.mixed_decode_min_splits, self.prefill_splits, *q.shape[1:],
               k_cache.dtype, k_cache.shape[2])  # fmt: skip
        plan = meta.once_a_step(key, lambda: self.mixed_plan(q, k_cache, meta))
        if plan.prefill_splits > 1:
            # Decode rows first: the per-token merge skips them, so the order is free, and
            # this one lets the tests catch a merge that would clobber them.
            if plan.decode_splits:
                self.decode(q, k_cache, v_cache, meta, scale, out, num_splits=plan.decode_splits, scales=scales)
            self.split_prefill(q, k_cache, v_cache, meta, scale, out, plan.prefill_splits, scales=scales)
            return
        self.unified(q, k_cache, v_cache, meta, scale, out, skip_decode=plan.split_decodes, scales=scales)
        if plan.split_decodes:
            self.decode(q, k_cache, v_cache, meta, scale, out, num_splits=plan.decode_splits, scales=scales)

    def mixed_plan(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> MixedPlan:
        """How ``mixed`` serves this batch: a function of the host lists, so once a step."""
        starts = meta.query_start_loc_cpu
        decode_lens = [meta.seq_lens_cpu[i] for i in range(meta.num_reqs) if starts[i + 1] - starts[i] == 1]
        decode_splits = 0
        if decode_lens:
            decode_splits = self.num_splits(len(decode_lens), max(decode_lens), k_cache.shape[2], q.device)
        min_splits = self.mixed_decode_min_splits
        split_decodes = bool(decode_lens) and min_splits is not None and decode_splits >= min_splits
        return MixedPlan(decode_splits, self.prefill_num_splits(q, k_cache, meta), split_decodes)

    def prefill_num_splits(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> int:
        """Key-range splits per prefill tile for this batch (1: the unified kernel serves it)."""
        if self.prefill_splits is not None:
            return self.prefill_splits
        _, num_q_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        block_q = prefill_block_q(head_dim, num_q_heads // num_kv_heads, _compute_dtype(q, k_cache))
        starts = meta.query_start_loc_cpu
        q_lens = [starts[i + 1] - starts[i] for i in range(meta.num_reqs)]
        sm_count = tiling.device_sm_count(q.device)
        return tiling.choose_prefill_splits(q_lens, meta.seq_lens_cpu, block_q, num_kv_heads, sm_count)

    def split_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        num_splits: int,
        scales: tuple[float, float] = UNIT_SCALES,
        tiles: tiling.Tiles | None = None,
    ) -> None:
        """Prefill rows over ``num_splits`` key ranges per tile, merged per token. Decode rows are skipped.
        ``tiles``: other than the prefill table's (``bench split_prefill_tiles`` sweeps them)."""
        shapes = _shapes(q, k_cache)
        dtype = _compute_dtype(q, k_cache)
        if tiles is None:
            tiles = tiling.prefill_tiles(shapes.head_dim, dtype)
        block_m = _prefill_block_m(tiles, shapes.group)
        num_tokens = meta.query_start_loc_cpu[-1]
        # fp32 partials: the merge must not round what the split kernels accumulated.
        part_lse = _scratch(meta, "prefill_lse", (num_tokens, shapes.num_q_heads, num_splits), q.device)
        part_out = _scratch(meta, "prefill_out", (*part_lse.shape, shapes.head_dim), q.device)
        stride_block, stride_slot, stride_head = _cache_strides(k_cache, v_cache)
        block_q = block_m // shapes.group
        kernels.prefill_split_kernel[(_num_tiles(meta, block_q), shapes.num_kv_heads, num_splits)](
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
            float(scales[0]),
            float(scales[1]),
            *q.stride()[:2],
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
            DOT_PRECISION=_dot_precision(dtype),
            KV_FP8=is_quantized(k_cache.dtype),
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
        _merge_splits(part_out, part_lse, out, meta, shapes, num_splits, per_token=True)

    def num_splits(self, num_decodes: int, max_seq_len: int, num_kv_heads: int, device: torch.device) -> int:
        if self.decode_splits is not None:
            return self.decode_splits
        return tiling.choose_num_splits(num_decodes, num_kv_heads, max_seq_len, tiling.device_sm_count(device))

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        num_splits: int | None = None,
        scales: tuple[float, float] = UNIT_SCALES,
        tiles: tiling.Tiles | None = None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Decode rows (one query each): split-KV, then merge if split. Other rows are skipped.
        ``tiles``: other than the decode table's (deterministic mode's); ``block_m`` is then the
        fewest query-head rows a program holds. ``new_kv``: the rows' K and V, not yet in the
        cache, which the split kernel stores at ``meta.slot_mapping`` before it reads them."""
        shapes = _shapes(q, k_cache)
        dtype = _compute_dtype(q, k_cache)
        block_h = _decode_block_h(shapes.group)
        if tiles is None:
            tiles = tiling.decode_tiles(shapes.head_dim, dtype, is_quantized(k_cache.dtype))
        else:
            block_h = max(block_h, tiles.block_m)
        if num_splits is None:
            num_splits = self.num_splits(meta.num_reqs, meta.max_seq_len, shapes.num_kv_heads, q.device)
        splits = num_splits
        num_reqs = meta.num_reqs
        write_partials = splits > 1
        # fp32 partials: the merge must not round what the split kernels accumulated.
        part_shape = (num_reqs, shapes.num_q_heads, splits) if write_partials else (1, 1, 1)
        part_lse = _scratch(meta, "decode_lse", part_shape, q.device)
        part_out = _scratch(meta, "decode_out", (*part_shape, shapes.head_dim), q.device)
        stride_block, stride_slot, stride_head = _cache_strides(k_cache, v_cache)
        counters = None
        if write_partials and FUSE_DECODE_MERGE:
            counters = arrivals.counters(q.device, num_reqs * shapes.num_kv_heads)
        kernels.decode_split_kernel[(num_reqs, shapes.num_kv_heads, splits)](
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
            float(scales[0]),
            float(scales[1]),
            *q.stride()[:2],
            *out.stride()[:2],
            stride_block,
            stride_slot,
            stride_head,
            meta.block_tables.stride(0),
            *_fused_write_args(new_kv, q, meta.slot_mapping),
            meta.seq_lens if counters is None else counters,  # never read without FUSED_MERGE
            NUM_Q_HEADS=shapes.num_q_heads,
            HEAD_DIM=shapes.head_dim,
            BLOCK_D=shapes.block_d,
            GROUP=shapes.group,
            BLOCK_H=block_h,
            BLOCK_N=tiles.block_n,
            PAGE_SIZE=k_cache.shape[1],
            WRITE_PARTIALS=write_partials,
            DOT_PRECISION=_dot_precision(dtype),
            WRITE_KV=new_kv is not None,
            **_fp8_grid_args(k_cache.dtype),
            KV_FP8=is_quantized(k_cache.dtype),
            FUSED_MERGE=counters is not None,
            BLOCK_S=_merge_width(splits),
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            **pdl.launch(q.device),
        )
        if write_partials and counters is None:
            _merge_splits(part_out, part_lse, out, meta, shapes, splits, per_token=False)

    def sdpa_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fresh prefills through torch SDPA, one request at a time; the result ``[T, heads, D]``.

        SDPA's own GQA flag beat expanding K/V to the query heads on the H200 (its flash
        kernel reads each KV head once; expanding costs a copy), see siesta/bench/attention.py.
        With no ``out`` and one request, SDPA's own output is the result: its kernels lay it
        out as they were given q, tokens first, so it needs no copy (most likely the one 44 us
        device-to-device copy a layer in an H100 profile of an 8k prompt; not yet re-profiled).
        """
        starts = meta.query_start_loc_cpu
        if out is None and meta.num_reqs == 1:
            return self._sdpa_one(q, k, v, scale).contiguous()
        out = torch.empty_like(q) if out is None else out
        for i in range(meta.num_reqs):
            s, e = starts[i], starts[i + 1]
            out[s:e] = self._sdpa_one(q[s:e], k[s:e], v[s:e], scale)
        return out

    @staticmethod
    def _sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One prompt's causal attention ``[L, heads, D]`` (a view of SDPA's output)."""
        o = F.scaled_dot_product_attention(_heads_first(q), _heads_first(k.to(q.dtype)), _heads_first(v.to(q.dtype)),
                                           is_causal=True, scale=scale, enable_gqa=True)  # fmt: skip
        return o.squeeze(0).transpose(0, 1)


def _fused_write_args(new_kv: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor,
                      slots: torch.Tensor) -> tuple:  # fmt: skip
    """``decode_split_kernel``'s pointers and strides of the fused K/V write: the new rows', or,
    without a write (never read then), q's in their place."""
    k, v = (q, q) if new_kv is None else (x if x.stride(-1) == 1 else x.contiguous() for x in new_kv)
    return k, v, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1)


def _fp8_grid_args(cache_dtype: torch.dtype) -> dict[str, int | float]:
    """The cache's fp8 grid as the fused write's constexprs."""
    grid = quantization_grid(cache_dtype)
    return {"FP8_MANTISSA_BITS": grid.mantissa_bits, "FP8_MIN_EXPONENT": grid.min_exponent,
            "FP8_MAX_VALUE": grid.max_value}  # fmt: skip


class BatchInvariantTritonAttention(TritonAttention):
    """Deterministic mode: no split-KV and no SDPA. A query row walks its keys in the prefill
    tile's key steps, from key 0, whatever else is in its tile or its batch, and however its
    prompt was chunked: key tiles past its own position are wholly masked and leave its sums as
    they were (the rescale is exp2(0) = 1, the added terms 0). Prefill rows take the unified
    kernel's prefill tile; one-token rows (decode rows, and a one-token chunk) take the decode
    kernel unsplit, with that key step and a narrow tile (``tiling.invariant_decode_tiles``), so a
    token has the bits it would have in a chunk. The cost: long contexts at small batch get no
    split-KV."""

    name = "triton"

    def __init__(self) -> None:
        super().__init__(sdpa_prefill_min_tokens=None, decode_splits=1, mixed_decode_min_splits=None, prefill_splits=1)

    def forward(self, q, k, v, kv_cache, layer_idx, meta, scale, out=None):
        k_cache, v_cache = kv_cache.layer(layer_idx)
        scales = kv_cache.layer_scales(layer_idx)
        write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping, scales)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty_like(q)
        if not meta.num_reqs or not q.shape[0]:
            return out
        if not meta.is_decode_only:
            self.unified(q, k_cache, v_cache, meta, scale, out, skip_decode=True, scales=scales)
        starts = meta.query_start_loc_cpu
        if meta.is_decode_only or any(starts[i + 1] - starts[i] == 1 for i in range(meta.num_reqs)):
            programs = meta.num_reqs * k_cache.shape[2]
            tiles = tiling.invariant_decode_tiles(q.shape[-1], _compute_dtype(q, k_cache), programs,
                                                  tiling.device_sm_count(q.device), is_quantized(k_cache.dtype))
            self.decode(q, k_cache, v_cache, meta, scale, out, num_splits=1, scales=scales, tiles=tiles)
        return out


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, heads, D]`` -> ``[1, heads, L, D]`` (a view), SDPA's layout."""
    return x.transpose(0, 1).unsqueeze(0)
