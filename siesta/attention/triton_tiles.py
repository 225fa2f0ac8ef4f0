"""Tile shapes and split-KV counts for the Triton paged-attention kernels.

Host-side choices only: the tile table for a head size and cache dtype, and how
many key ranges a batch's decode rows or prefill tiles are cut into. They read
host integers, so choosing never waits on the device. ``siesta.bench.attention
--sweep`` swaps the tables' entries to time alternatives.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from siesta import host_ints

# tl.dot needs every operand dimension to be at least this.
MIN_DOT_DIM = 16
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
PREFILL_TILES: dict[int, Tiles] = {
    64: Tiles(block_m=128, block_n=64, num_warps=4, num_stages=3),
    # H200, bf16, 8k causal: 396 TFLOP/s; 128x64 gave 340, 256x64 406 but spills.
    128: Tiles(block_m=128, block_n=128, num_warps=8, num_stages=3),
    256: Tiles(block_m=64, block_n=32, num_warps=8, num_stages=2),
}
# 4-byte (fp32) caches: the half-precision tiles would overflow shared memory.
# fp32 is for tests and small CPU-sized runs, so these only need to fit.
WIDE_PREFILL_TILES: dict[int, Tiles] = {
    64: Tiles(block_m=64, block_n=64, num_warps=4, num_stages=2),
    128: Tiles(block_m=64, block_n=32, num_warps=4, num_stages=2),
    256: Tiles(block_m=32, block_n=32, num_warps=4, num_stages=1),
}
# Decode tiles are bandwidth tiles: few query rows, long key steps so enough
# bytes are in flight per program.
# 128-wide heads over bf16 take two stages, one K/V buffer: H100 run 53a (``python -m
# siesta.bench.fp8_decode``) timed three stages (two buffers, the next tile in flight) 1.01-1.10x
# slower from batch 1 at 32k keys to batch 256 at 512; the loads in flight of other programs on the
# SM hide as much, and one buffer leaves room for more programs.
DECODE_TILES: dict[int, Tiles] = {
    64: Tiles(block_m=MIN_DOT_DIM, block_n=128, num_warps=4, num_stages=3),
    128: Tiles(block_m=MIN_DOT_DIM, block_n=64, num_warps=4, num_stages=2),
    256: Tiles(block_m=MIN_DOT_DIM, block_n=32, num_warps=4, num_stages=3),
}
# Over an fp8 cache a key step of the bf16 tiles holds half the bytes: 128 keys a step for
# 128-wide heads (H100 run 51g, ``python -m siesta.bench.fp8_decode``: 0.87-0.92x the 64-key
# step's time from batch 1 at 32k keys to batch 256 at 512; 8 warps or 256 keys were slower).
# Three stages: run 53a, the next tile in flight, 0.84x two stages' time at batch 16 over 19.5k
# keys (the seed's resume), 0.93x at batch 1, 1.02-1.08x at batch 64 and 256; four were slower.
FP8_DECODE_TILES: dict[int, Tiles] = {
    **DECODE_TILES,
    128: Tiles(block_m=MIN_DOT_DIM, block_n=128, num_warps=4, num_stages=3),
}
WIDE_DECODE_TILES: dict[int, Tiles] = {
    64: Tiles(block_m=MIN_DOT_DIM, block_n=64, num_warps=4, num_stages=2),
    128: Tiles(block_m=MIN_DOT_DIM, block_n=32, num_warps=4, num_stages=2),
    256: Tiles(block_m=MIN_DOT_DIM, block_n=16, num_warps=4, num_stages=2),
}
# Deterministic mode's decode rows (``BatchInvariantTritonAttention``): a row's bits depend on
# its key step and on how the card computes and sums each score tile. These keep the prefill
# tile's key step (``block_n``, checked by the suite) and take 64 rows and one warpgroup where
# the prefill tile has 128 rows and two: on Hopper both issue the same 64-row wgmma for a row,
# and H100 runs 49b-c (``python -m siesta.bench.invariant_attention``) found their bits equal for
# every head shape, batch, context and KV dtype tried. A 16-row tile (mma.sync, as the
# default decode kernel) was 14 % faster at batch 256 but gave other bits in some rows.
INVARIANT_DECODE_TILES: dict[int, Tiles] = {
    64: Tiles(block_m=64, block_n=64, num_warps=4, num_stages=2),
    128: Tiles(block_m=64, block_n=128, num_warps=4, num_stages=2),
    256: PREFILL_TILES[256],  # no narrower tile measured: the prefill tile's own
}
# The same rows when a batch gives every SM a program of its own (bf16 caches, 128-wide heads): one
# stage of K/V (64 KiB), so two programs share an SM and one's loads run under the other's products.
# H100 run 52a: 0.86x the two-stage tile's time at batch 64 and 0.88x at 256 (Llama-3-8B, 512
# keys), the same bits; at batch 1 (8 programs) 1.2x, so a lone program keeps its two stages.
CROWDED_INVARIANT_DECODE_TILES: dict[int, Tiles] = {
    **INVARIANT_DECODE_TILES,
    128: Tiles(block_m=64, block_n=128, num_warps=4, num_stages=1),
}
# fp32 caches (tests, CPU-sized runs): the prefill tiles themselves, rows and all. Speed does not
# matter there, and Triton's interpreter, whose products are numpy's, gives other bits for a
# product of other rows.
WIDE_INVARIANT_DECODE_TILES = WIDE_PREFILL_TILES
_HALF_BYTES = 2

# Split-KV: aim for this many resident programs per SM so HBM sees enough loads in flight.
_TARGET_PROGRAMS_PER_SM = 4
# A split shorter than this spends more on its partial write and the merge than it saves.
_MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# What the heuristic assumes when there is no CUDA device to ask (the interpreter).
_FALLBACK_SM_COUNT = 132



def prefill_tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    wide = dtype.itemsize > _HALF_BYTES
    return _tiles_for(WIDE_PREFILL_TILES if wide else PREFILL_TILES, head_dim)


def decode_tiles(head_dim: int, dtype: torch.dtype, fp8_cache: bool = False) -> Tiles:
    """The default mode's decode tiles for products in ``dtype`` (over an fp8 cache: the query's)."""
    if dtype.itemsize > _HALF_BYTES:
        return _tiles_for(WIDE_DECODE_TILES, head_dim)
    return _tiles_for(FP8_DECODE_TILES if fp8_cache else DECODE_TILES, head_dim)


def invariant_decode_tiles(head_dim: int, dtype: torch.dtype, programs: int = 0, sm_count: int = _FALLBACK_SM_COUNT,
                           fp8_cache: bool = False) -> Tiles:  # fmt: skip
    """Deterministic mode's decode tiles for products in ``dtype``; ``programs`` (decode rows x KV
    heads) at least ``sm_count`` take the one-stage tile over a half-precision cache. The key step
    is the prefill tile's in every case, and stages do not change a row's sums."""
    if dtype.itemsize > _HALF_BYTES:
        return _tiles_for(WIDE_INVARIANT_DECODE_TILES, head_dim)
    crowded = programs >= sm_count and not fp8_cache
    return _tiles_for(CROWDED_INVARIANT_DECODE_TILES if crowded else INVARIANT_DECODE_TILES, head_dim)


def _tiles_for(table: dict[int, Tiles], head_dim: int) -> Tiles:
    padded = max(MIN_DOT_DIM, host_ints.next_power_of_2(head_dim))
    for dim in sorted(table):
        if padded <= dim:
            return table[dim]
    raise ValueError(f"head_dim {head_dim} is not supported: at most {MAX_HEAD_DIM}")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
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
    wanted = host_ints.cdiv(sm_count * _TARGET_PROGRAMS_PER_SM, programs)
    useful = host_ints.cdiv(max_seq_len, _MIN_KEYS_PER_SPLIT)
    splits = max(1, min(wanted, useful, MAX_SPLITS))
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
            num_tiles += host_ints.cdiv(q_len, block_q)
            longest = max(longest, seq_len)
    if num_tiles == 0:
        return 1
    return choose_num_splits(num_tiles, num_kv_heads, longest, sm_count)
