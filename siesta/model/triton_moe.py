"""Fused mixture-of-experts in Triton: tokens sorted by expert, then two grouped GEMMs.

1. ``align``: the step's (token, k) pairs sorted by expert, each expert's run padded to a
   multiple of the row tile ``BLOCK_M``, so every row tile belongs to one expert. Torch ops on
   the device with shapes fixed by the token count (a bound on the padding, not the padding
   itself): no host read, so CUDA graphs capture it per bucket. Steps of up to
   ``ALIGN_KERNEL_MAX_PAIRS`` pairs may be placed by one Triton program (``triton_align``); the
   torch paths place each pair by a one-hot running count of its expert (about 18 launches) or,
   larger, by a stable sort (about 30). All three give the same rows.
2. ``_gate_up_kernel``: per row tile and feature tile, the tile's tokens (gathered by pair) times
   its expert's gate rows and up rows, both accumulated in fp32 from one read of x, then
   ``silu(gate) * up``, stored at the tile's own rows (sorted order, padding rows zero).
3. ``_down_kernel``: those activations (a tile's rows contiguous) times the expert's down rows,
   times the pair's routing weight, stored per pair.
4. Each token's k outputs summed in k order (``moe.sum_over_k``; the weight is in).

At one or two tokens (``PAIR_PATH_MAX_TOKENS``) the experts skip the sort: one program per
(token, k) pair and feature tile streams that pair's expert rows as a GEMV does (products summed
on the CUDA cores in fp32, loads pipelined) for gate/up; for down, one program per token and
feature tile streams its k experts' rows in turn and sums their weighted outputs, so neither the
per-pair buffer nor the sum's launch is needed (``_down_sum_kernel``). ``align`` was some 30
small launches a layer; the pair kernels replace them. On an H100 a Qwen3-30B-A3B batch-1 step
went from 119 to 146 tok/s with them (run 48a), and to 188-191 with the router's tail in one
kernel and down-and-sum (runs 49b, 49d: 1.56x the sorted path, 1.37x at two tokens; 688
launches and 3.8 ms of device time in a 5.2 ms step, still launch-bound). A token's k experts
are distinct, so at one token no expert is read twice; at two, rarely (an expert both tokens
chose is read twice, where the sorted path reads it once). Deterministic mode keeps the sorted path and its one tile set.
With ``DOWN_SUM_SPLIT`` down-and-sum runs a program a (pair, feature tile) instead, k times the
loads in flight, and the last of a token's k programs to finish sums their outputs
(``_down_pair_kernel``, ``siesta/arrivals.py``; the same bits).

Row tiles past the padded total return at once. The weights are read once per row tile that
an expert's tokens fill: at decode, one tile per expert touched, the bytes the roofline counts.

With ``MoeTiles.persistent`` each GEMM is instead one program an SM walking the row tiles in use
(read from the device) with their feature tiles in turn: which program computes a tile, never
its sums. The down GEMM reduces over I = 768 only (12 chunks of 64), so a tile's prologue and
epilogue weigh on it: on an H100 it ran at ~290 TFLOP/s where gate/up ran at ~530 (run 51b's
profile). The persistent launch lets Triton pipeline one tile's loads under the last one's
epilogue; ``MoeTiles.persistent_down`` gives it to the down GEMM alone, which is what the large
prefill tiles ship (``LARGE_PREFILL_TILES`` says why).

Deterministic mode (``batch_invariant``): one tile set (``DETERMINISTIC_TILES``) whatever the
step's size, so a pair's sums run over the same BLOCK_K chunks on the same MMA shape. Nothing
else a pair's bits go through depends on the batch: each output element is reduced by one
program over the whole of H (or I) in order, into one fp32 accumulator (no split-K, no atomics);
a tile holds one expert's pairs, its padding rows are masked to zeros, and an MMA computes each
row from that row alone, so neither the pairs in other tiles nor a pair's place in its tile
changes it. ``align``'s sort is of integers (exact), and the sum over k is an explicit loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from siesta import arrivals, pdl
from siesta.model import batch_invariant, grouped_mm_moe, triton_align
from siesta.model.moe import sort_by_expert, sum_over_k
from siesta.model.triton_matmul import persistent_programs, tma_ready


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # rows (pairs) per tile: each tile is one expert's
    block_n: int  # output features per tile
    block_k: int  # reduction chunk
    num_warps: int = 4
    num_stages: int = 2
    # One program per SM walking the row tiles in use (``_gate_up_kernel``'s docstring), for
    # both GEMMs or the down GEMM alone; in ``python -m siesta.bench.moe_tiles`` a tile's suffix
    # ``p`` or ``d``.
    persistent: bool = False
    persistent_down: bool = False
    # The down GEMM's own feature tile and stages (None: the ones above). Its rows reduce over
    # I only, so a wider tile halves the re-reads of each activation row; in
    # ``python -m siesta.bench.moe_tiles`` a tile's ``:256s3`` suffix.
    down_block_n: int | None = None
    down_num_stages: int | None = None
    # Expert weight tiles (and, in the down GEMM, activation tiles) loaded by TMA descriptors
    # instead of pointer tensors; x's rows are gathered by token, so gate/up still loads them by
    # pointer. Contiguous bf16/fp32 weights only (``_tma_ready``); in
    # ``python -m siesta.bench.moe_tiles`` a tile's ``t`` suffix.
    tma: bool = False

    def down_persistent(self) -> bool:
        return self.persistent or self.persistent_down

    def down_n(self) -> int:
        return self.down_block_n or self.block_n

    def down_stages(self) -> int:
        return self.down_num_stages or self.num_stages


# Few pairs a tile (decode): small row tiles, wide feature tiles. Many (prefill): square-ish
# tiles that reuse each weight tile over 64 rows; from 128 pairs an expert, over 128 rows.
# ``python -m siesta.bench.moe_tiles`` on an H100 (run 51a, Qwen3-30B-A3B's experts): the
# 128-row tile ran both GEMMs in 0.92x the 64-row tile's time at 2k tokens (128 pairs an
# expert) and 0.87x at 8k; at 16 to 256 tokens no candidate beat the decode tiles by over 3 %.
# Persistent launches (runs 52a-b): both GEMMs on the large tile with 4 stages took 0.91x the
# one-tile-a-program time at 2k and 8k tokens in the sweep (slower at 16 to 256 tokens), but in
# the 8k prefill gate/up went from 37.0 to 42.5 ms while down went from 34.7 to 27.6: only down,
# whose I = 768 reduction leaves each tile's prologue and epilogue exposed, runs persistent.
# The down GEMM on a 128 x 256 feature tile (3 stages; ``MoeTiles.down_block_n`` says why): in
# the sweep 0.966x the 128-wide tile's time for both GEMMs at 8k tokens, even at 2k (H100 run
# 57a); in the 8k prefill of one eager engine, alternating tiles on fresh prompts, 159.6-162.0 ms
# against 163.5-166.9 (run 57b, ~2 % of the step). Not better (run 59i, both GEMMs at 8k tokens):
# a 128-wide K chunk (2 stages; 3 need 288 KiB of shared memory) 1.32x the shipped time, the down
# GEMM on 4 stages 1.32x, a 256-wide gate/up tile (2 stages) 5.0x. Weights (and down's
# activations) by TMA descriptors (run 60a, H100): both GEMMs in 0.956x the time at 8k tokens,
# 0.96x at 2k; in the 8k prefill the down GEMM 22.8 -> 18.2 ms, gate/up 37.4 -> 36.4, the step
# 1.03x (MFU 51 -> 53 %). At 16-256 tokens the decode tiles with it ran in 1.00x: they stay as they are.
DECODE_TILES = MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
PREFILL_TILES = MoeTiles(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
LARGE_PREFILL_TILES = MoeTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, persistent_down=True,
                               down_block_n=256, down_num_stages=3, tma=True)  # fmt: skip
# fp32 experts (tests, the CPU-sized shapes) at most this many stages: a 4-stage 128-row fp32
# tile needs 304 KiB of shared memory, over Hopper's 227.
WIDE_MAX_STAGES = 2
# Steps of at least this many pairs run their experts on torch's grouped GEMM instead
# (``grouped_mm_moe``); None keeps every step on the fused kernels. The ``moe`` bench's
# ``library_prefill`` part times the 8k prefill both ways: 0.81x the fused path on an H100 (run
# 54a; its GEMMs are faster, its gather, un-permute and elementwise ops cost more), so off.
LIBRARY_MIN_PAIRS: int | None = None
# Pairs per expert (on average) from which the prefill tiles pay, and the large ones.
PREFILL_PAIRS_PER_EXPERT = 32
LARGE_PREFILL_PAIRS_PER_EXPERT = 128


# Deterministic mode's one tile set. The prefill tiles: on them a decode step is still bound by
# its weight reads (a weight tile's 64-row MMA takes less time than the tile's load), while the
# decode tiles' 16-row MMAs would slow a prefill's compute-bound GEMMs. Not measured yet: small
# decode batches get fewer programs on them (Qwen3-30B-A3B at batch 1: 8 experts x 6 gate/up tiles).
DETERMINISTIC_TILES = PREFILL_TILES
# The per-pair path: steps of at most this many tokens (tiles: ``GATE_UP_PAIR_TILES`` and
# ``DOWN_SUM_TILES``, below).
PAIR_PATH_MAX_TOKENS = 2
# align: steps of up to this many (token, k) pairs place them by a one-hot running count
# ([experts, pairs] int64: 2 MiB at 2,048 pairs and 128 experts), larger ones by a sort.
ONE_HOT_MAX_PAIRS = 2048
# align: steps of up to this many pairs are placed by one Triton program (``triton_align``)
# instead of either torch path's launches. Qwen3-30B-A3B decode steps 1.09x at 16 tokens (128
# pairs), 1.04x at 64 (512) (H100 run 64b, the moe bench's ``knobs`` arm ``align``). One program
# walks every pair four times, so larger steps, not yet timed, keep the launches.
ALIGN_KERNEL_MAX_PAIRS = 512


@dataclass(frozen=True)
class PairTiles:
    """A pair kernel's launch: ``block_n`` features a program, ``block_k`` of the reduction a step."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Feature tiles of 16 rows read 256 at a time (two fp32 accumulators of 16 x 256 on 4 warps: 64
# registers a thread). The down-and-sum kernel has k times fewer programs than pairs (at one
# token, one a feature tile: 128 for Qwen3-30B-A3B on 132 SMs), so each keeps one stage more of
# loads in flight; 8-feature tiles (two programs an SM) gained nothing (H100 run 64b, 1.00x).
# The moe bench's ``knobs`` part sweeps both kernels' tiles (arm ``swept_pairs``).
GATE_UP_PAIR_TILES = PairTiles(block_n=16, block_k=256, num_warps=4, num_stages=3)
DOWN_SUM_TILES = PairTiles(block_n=16, block_k=256, num_warps=4, num_stages=4)
# Down-and-sum split over the token's experts: a program a (pair, feature tile) keeps its pair's
# output, the last of the token's k to finish sums them (``_down_pair_kernel``; the same bits).
# The one-program-a-token kernel has a program a feature tile, 128 for Qwen3-30B-A3B at one token
# on 132 SMs, and read its rows at ~2.5 TB/s on an H200 (run 63a: 0.48 ms a step) where gate/up,
# a program a pair, read at ~3.4. Off until a card measures it: the moe bench's ``knobs`` arm
# ``down_split``.
DOWN_SUM_SPLIT = False


def tiles_for(num_pairs: int, num_experts: int) -> MoeTiles:
    """The default mode's tiles for a step of ``num_pairs`` (token, k) pairs."""
    if num_pairs >= LARGE_PREFILL_PAIRS_PER_EXPERT * num_experts:
        return LARGE_PREFILL_TILES
    return PREFILL_TILES if num_pairs >= PREFILL_PAIRS_PER_EXPERT * num_experts else DECODE_TILES


def step_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """The tiles a step runs on: in deterministic mode one set for every step (a pair's reduction
    must not follow the batch size), otherwise ``tiles_for``."""
    return DETERMINISTIC_TILES if batch_invariant.enabled() else tiles_for(num_pairs, num_experts)


@dataclass
class Alignment:
    sorted_pairs: torch.Tensor  # [max_padded] int32: pair ids by expert, padded with num_pairs
    tile_expert: torch.Tensor  # [max_tiles] int32: the expert of each row tile (num_experts past the end)
    num_padded: torch.Tensor  # [1] int32: rows in use (the padded total)

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.shape[0]


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the (token, k) pairs of ``ids`` ``[T, k]`` by expert, each expert's run padded to a
    multiple of ``block_m``. Pair ``p`` is token ``p // k``'s ``p % k``-th choice; an expert's
    pairs keep their order (a stable sort)."""
    flat = ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    # At most min(n, experts) experts have pairs, each padded by under a tile.
    max_padded = n + min(n, num_experts) * (block_m - 1)
    max_tiles = -(-max_padded // block_m)
    if 0 < n <= ALIGN_KERNEL_MAX_PAIRS:
        return Alignment(*triton_align.align_pairs(flat.contiguous(), num_experts, block_m, max_tiles))
    if 0 < n <= ONE_HOT_MAX_PAIRS:
        # Decode-sized steps: a running count per expert ([n, E]) gives every pair its place in
        # half the launches of a sort (each a graph node that costs ~2 us however small).
        # Experts as rows, pairs along the scan: torch scans a row's inner dimension in parallel,
        # but an outer one column by column (a [512, 128] scan over pairs took 95 us a layer at
        # batch 64, 4.6 ms of H100 run 64a's 30 ms step).
        running = (flat[None, :] == torch.arange(num_experts, device=dev)[:, None]).cumsum(1)
        counts = running[:, -1]
        padded = (counts + block_m - 1) // block_m * block_m
        ends = padded.cumsum(0)
        dest = (ends - padded - 1)[flat] + running.gather(0, flat[None, :])[0]
        sources = torch.arange(n, dtype=torch.int32, device=dev)
    else:
        order, experts_sorted, first = sort_by_expert(flat, num_experts)
        counts = first.diff()
        padded = (counts + block_m - 1) // block_m * block_m
        ends = padded.cumsum(0)
        rank = torch.arange(n, device=dev) - first[experts_sorted]
        dest = (ends - padded)[experts_sorted] + rank
        sources = order.to(torch.int32)
    sorted_pairs = torch.full((max_tiles * block_m,), n, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, sources)
    tile_starts = torch.arange(0, max_tiles * block_m, block_m, device=dev)
    tile_expert = torch.searchsorted(ends, tile_starts, right=True, out_int32=True)
    return Alignment(sorted_pairs, tile_expert, ends[-1:].to(torch.int32))


def fused_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """``sum_k weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t)`` with ``e = ids[t, k]``:
    ``x`` ``[T, H]``, ``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]`` -> ``[T, H]``."""
    t, hidden = x.shape
    k = ids.shape[1]
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    n = t * k
    if tiles is None and uses_pair_path(t, gate_up, down):
        return _fused_moe_pairs(x, weights, ids, gate_up, down)
    if tiles is None and uses_library(n):
        return grouped_mm_moe.grouped_mm_moe(x, weights, ids, gate_up, down)
    tiles = tiles or step_tiles(n, num_experts)
    if x.element_size() > 2:  # each GEMM capped on its own: fewer stages than the cap stay
        tiles = replace(tiles, num_stages=min(tiles.num_stages, WIDE_MAX_STAGES),
                        down_num_stages=min(tiles.down_stages(), WIDE_MAX_STAGES))  # fmt: skip
    a = align(ids, num_experts, tiles.block_m)
    x = x.contiguous()
    tma = tiles.tma and _tma_ready(gate_up, down)
    # fp32 weights are multiplied in fp32, not TF32 (Triton's default for fp32 dots).
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # Activations in the sorted, padded row order (a tile's rows are contiguous for the down
    # GEMM's loads); a padding row holds silu(0) * 0 = 0.
    act = torch.empty((a.max_tiles * tiles.block_m, inter), dtype=x.dtype, device=x.device)
    gate_up_desc = _descriptor(gate_up.view(-1, hidden), tiles.block_n, tiles.block_k) if tma else None
    grid, programs = _grid(a.max_tiles, triton.cdiv(inter, tiles.block_n), tiles.persistent, x.device)
    _gate_up_kernel[grid](
        x, gate_up, gate_up_desc, act, a.sorted_pairs, a.tile_expert, a.num_padded,
        n, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), act.stride(0),
        TOP_K=k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRECISION=precision,
        PERSISTENT=tiles.persistent, PROGRAMS=programs, TMA=tma,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    pair_out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).contiguous()
    act_desc = _descriptor(act, tiles.block_m, tiles.block_k) if tma else None
    down_desc = _descriptor(down.view(-1, inter), tiles.down_n(), tiles.block_k) if tma else None
    grid, programs = _grid(a.max_tiles, triton.cdiv(hidden, tiles.down_n()), tiles.down_persistent(), x.device)
    _down_kernel[grid](
        act, act_desc, down, down_desc, pair_out, flat_weights, a.sorted_pairs, a.tile_expert, a.num_padded,
        n, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), down.stride(2), pair_out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_n(), BLOCK_K=tiles.block_k, PRECISION=precision,
        PERSISTENT=tiles.down_persistent(), PROGRAMS=programs, TMA=tma,
        num_warps=tiles.num_warps, num_stages=tiles.down_stages(),
    )  # fmt: skip
    return sum_over_k(pair_out.view(t, k, hidden))


def _grid(row_tiles: int, feature_tiles: int, persistent: bool, device: torch.device) -> tuple[tuple, int]:
    """A launch's grid and, persistent, its program count: at most one program an SM (the tiles
    in use are known on the device only; the bound on them here)."""
    if not persistent:
        return (row_tiles, feature_tiles), 1
    programs = min(persistent_programs(device), row_tiles * feature_tiles)
    return (programs,), programs


def _tma_ready(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether both expert tensors can be read as 2-D TMA descriptors: contiguous (each expert's
    rows follow the last's), then ``triton_matmul``'s alignment rule on the 2-D views."""
    return gate_up.is_contiguous() and down.is_contiguous() and tma_ready(gate_up.flatten(0, 1), down.flatten(0, 1))


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [rows, cols])


def uses_library(num_pairs: int) -> bool:
    """Whether a step of ``num_pairs`` pairs runs on torch's grouped GEMM (``grouped_mm_moe``):
    from ``LIBRARY_MIN_PAIRS`` pairs (off while that is None), in the default mode."""
    return (LIBRARY_MIN_PAIRS is not None and num_pairs >= LIBRARY_MIN_PAIRS and not batch_invariant.enabled()
            and grouped_mm_moe.available())  # fmt: skip


def uses_pair_path(tokens: int, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether a step of ``tokens`` tokens takes the per-pair kernels: few tokens, the default
    mode, and expert weights contiguous along what each row reduces over (H, then I)."""
    return (0 < tokens <= PAIR_PATH_MAX_TOKENS and not batch_invariant.enabled()
            and gate_up.stride(2) == 1 and down.stride(2) == 1)  # fmt: skip


def _fused_moe_pairs(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    t, hidden = x.shape
    k = ids.shape[1]
    inter = gate_up.shape[1] // 2
    n = t * k
    flat_ids = ids.reshape(-1).contiguous()
    flat_weights = weights.reshape(-1).contiguous()
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    up = GATE_UP_PAIR_TILES
    _gate_up_pair_kernel[(n, triton.cdiv(inter, up.block_n))](
        x, gate_up, flat_ids, act, hidden, inter,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=k, BLOCK_N=up.block_n, BLOCK_K=up.block_k, EVEN_K=hidden % up.block_k == 0,
        NUM_STAGES=up.num_stages, num_warps=up.num_warps, **pdl.launch(x.device),
    )  # fmt: skip
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    dn = DOWN_SUM_TILES
    feature_tiles = triton.cdiv(hidden, dn.block_n)
    counters = arrivals.counters(x.device, t * feature_tiles) if DOWN_SUM_SPLIT else None
    if counters is not None:
        part = torch.empty((n, hidden), dtype=torch.float32, device=x.device)
        _down_pair_kernel[(n, feature_tiles)](
            act, down, flat_ids, flat_weights, part, out, counters, hidden, inter,
            act.stride(0), down.stride(0), down.stride(1), out.stride(0),
            TOP_K=k, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, EVEN_K=inter % dn.block_k == 0,
            NUM_STAGES=dn.num_stages, num_warps=dn.num_warps, **pdl.launch(x.device),
        )  # fmt: skip
        return out
    _down_sum_kernel[(t, feature_tiles)](
        act, down, flat_ids, flat_weights, out, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        TOP_K=k, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, EVEN_K=inter % dn.block_k == 0,
        NUM_STAGES=dn.num_stages, num_warps=dn.num_warps, **pdl.launch(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _gate_up_pair_kernel(
    x_ptr, w_ptr, ids_ptr, out_ptr, H, I,
    stride_xm, stride_xk, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (pair, n): ``silu(gate_e x_t) * up_e x_t`` for BLOCK_N features of pair ``pair``."""
    pdl.wait_for_previous_grid(USE_PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Features past I read real (repeated) rows, dropped by the masked store.
    rows = (offs_n % I).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + I * stride_wn
    x_ptrs = x_ptr + token * stride_xm + offs_k * stride_xk
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            g = tl.load(gate_ptrs)
            u = tl.load(up_ptrs)
            xv = tl.load(x_ptrs)
        else:
            k_mask = (offs_k + k0) < H
            g = tl.load(gate_ptrs, mask=k_mask[None, :], other=0.0)
            u = tl.load(up_ptrs, mask=k_mask[None, :], other=0.0)
            xv = tl.load(x_ptrs, mask=k_mask, other=0.0)
        xf = xv.to(tl.float32)[None, :]
        acc_gate += g.to(tl.float32) * xf
        acc_up += u.to(tl.float32) * xf
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, act.to(out_ptr.dtype.element_ty), mask=offs_n < I)


@triton.jit
def _down_sum_kernel(
    a_ptr, w_ptr, ids_ptr, weight_ptr, out_ptr, H, I,
    stride_am, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (token, n): ``sum_k weight_k * down_{e_k} act_k`` for BLOCK_N outputs of ``token``.

    One loop over the token's k experts' K chunks, so the loads stay pipelined across experts.
    Each pair's output is rounded to the output dtype before it is added, and the k of them are
    summed in k order in fp32, rounded once: what the pair outputs stored and then summed
    (``moe.sum_over_k``) give, without the buffer and the sum's launch."""
    pdl.wait_for_previous_grid(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % H).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    chunks = tl.cdiv(I, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in tl.range(0, TOP_K * chunks, num_stages=NUM_STAGES):
        j = step // chunks
        k0 = (step - j * chunks) * BLOCK_K
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + (k0 + offs_k)[None, :]
        a_ptrs = a_ptr + pair * stride_am + k0 + offs_k
        w, a = _down_chunk(w_ptrs, a_ptrs, offs_k, k0, I, EVEN_K)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        if k0 + BLOCK_K >= I:  # the expert's last chunk: its output joins the sum
            pair_out = tl.sum(acc, axis=1) * tl.load(weight_ptr + pair).to(tl.float32)
            total += pair_out.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < H)


@triton.jit
def _down_chunk(w_ptrs, a_ptrs, offs_k, k0, I, EVEN_K: tl.constexpr):
    """One I chunk of an expert's down rows and of its pair's activations (zeros past I)."""
    if EVEN_K:
        return tl.load(w_ptrs), tl.load(a_ptrs)
    k_mask = (offs_k + k0) < I
    return tl.load(w_ptrs, mask=k_mask[None, :], other=0.0), tl.load(a_ptrs, mask=k_mask, other=0.0)


@triton.jit
def _down_pair_kernel(
    a_ptr, w_ptr, ids_ptr, weight_ptr, part_ptr, out_ptr, counter_ptr, H, I,
    stride_am, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (pair, n): ``weight * down_e act`` for BLOCK_N outputs of one pair, rounded to the
    output dtype and kept (in fp32) at ``part_ptr``; the last of the token's k pairs to arrive
    (``siesta/arrivals.py``) sums them in k order into the token's outputs.

    ``_down_sum_kernel``'s arithmetic on its tiles, so its bits: each pair's chunks summed in
    order into the same ``[BLOCK_N, BLOCK_K]`` accumulator, reduced the same way, rounded, and the
    k of them added to zero in k order in fp32. k times its programs, each streaming one expert's
    rows, so k times the loads in flight."""
    pdl.wait_for_previous_grid(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    token = pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    rows = (offs_n % H).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    a_ptrs = a_ptr + pair * stride_am + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=NUM_STAGES):
        w, a = _down_chunk(w_ptrs, a_ptrs, offs_k, k0, I, EVEN_K)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    pair_out = tl.sum(acc, axis=1) * tl.load(weight_ptr + pair).to(tl.float32)
    tl.store(part_ptr + pair * H + offs_n, pair_out.to(out_ptr.dtype.element_ty).to(tl.float32), mask=n_mask)
    counter = counter_ptr + token * tl.num_programs(1) + pid_n
    if arrivals.arrive(counter) == TOP_K - 1:
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            total += tl.load(part_ptr + (token * TOP_K + j) * H + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)
        arrivals.reset(counter)


@triton.jit
def _gate_up_tile(
    x_ptr, w_ptr, w_desc, out_ptr, sorted_ptr, tile_expert_ptr, pid_m, pid_n,
    num_pairs, H, I,
    stride_xm, stride_we, stride_wn, stride_wk, stride_om,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Row tile ``pid_m`` x feature tile ``pid_n`` of ``silu(gate_e x) * up_e x``, stored at the
    tile's own (sorted) rows."""
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)
    valid = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_xm
    gate_cols = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    up_cols = gate_cols + I * stride_wn
    # The descriptor's rows are [E * 2I, H]: a feature tile past I reads up (or the next
    # expert's) rows, or zeros past the end, into columns that are never stored.
    gate_row = (expert * 2 * I + pid_n * BLOCK_N).to(tl.int32)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < H
        a = tl.load(x_rows + kk[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        if TMA:
            g = w_desc.load([gate_row, k0]).T
            u = w_desc.load([gate_row + I, k0]).T
        else:
            w_mask = k_mask[:, None] & n_mask[None, :]
            g = tl.load(gate_cols + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
            u = tl.load(up_cols + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc_gate = tl.dot(a, g, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


@triton.jit
def _down_tile(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, weight_ptr, sorted_ptr, tile_expert_ptr, pid_m, pid_n,
    num_pairs, H, I,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """Row tile ``pid_m`` x output tile ``pid_n`` of ``weight * down_e act``, stored at the
    tile's pairs' rows."""
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)
    valid = pairs < num_pairs
    rows = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    w_cols = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    w_row = (expert * H + pid_n * BLOCK_N).to(tl.int32)  # the descriptor's rows are [E * H, I]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if TMA:
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([w_row, k0]).T
        else:
            kk = k0 + offs_k
            k_mask = kk < I
            a = tl.load(a_rows + kk[None, :], mask=k_mask[None, :], other=0.0)
            w = tl.load(w_cols + kk[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    routing = tl.load(weight_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    acc = acc * routing[:, None]
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, w_ptr, w_desc, out_ptr, sorted_ptr, tile_expert_ptr, num_padded_ptr,
    num_pairs, H, I,
    stride_xm, stride_we, stride_wn, stride_wk, stride_om,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, PERSISTENT: tl.constexpr, PROGRAMS: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One tile a program on a (row tiles, feature tiles) grid; or, PERSISTENT, PROGRAMS
    programs each walking tiles pid, pid + PROGRAMS, ... over the padded rows in use (the row
    tile's feature tiles in turn), which lets one tile's loads start during the last's epilogue."""
    if PERSISTENT:
        num_n = tl.cdiv(I, BLOCK_N)
        tiles = tl.load(num_padded_ptr) // BLOCK_M * num_n
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
            _gate_up_tile(
                x_ptr, w_ptr, w_desc, out_ptr, sorted_ptr, tile_expert_ptr, tile // num_n, tile % num_n,
                num_pairs, H, I, stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, TMA,
            )  # fmt: skip
    else:
        pid_m = tl.program_id(0)
        if pid_m * BLOCK_M < tl.load(num_padded_ptr):
            _gate_up_tile(
                x_ptr, w_ptr, w_desc, out_ptr, sorted_ptr, tile_expert_ptr, pid_m, tl.program_id(1),
                num_pairs, H, I, stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, TMA,
            )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, weight_ptr, sorted_ptr, tile_expert_ptr, num_padded_ptr,
    num_pairs, H, I,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr, PROGRAMS: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """As ``_gate_up_kernel``, for the down projection."""
    if PERSISTENT:
        num_n = tl.cdiv(H, BLOCK_N)
        tiles = tl.load(num_padded_ptr) // BLOCK_M * num_n
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
            _down_tile(
                a_ptr, a_desc, w_ptr, w_desc, out_ptr, weight_ptr, sorted_ptr, tile_expert_ptr, tile // num_n, tile % num_n,
                num_pairs, H, I, stride_am, stride_we, stride_wn, stride_wk, stride_om,
                BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, TMA,
            )  # fmt: skip
    else:
        pid_m = tl.program_id(0)
        if pid_m * BLOCK_M < tl.load(num_padded_ptr):
            _down_tile(
                a_ptr, a_desc, w_ptr, w_desc, out_ptr, weight_ptr, sorted_ptr, tile_expert_ptr, pid_m, tl.program_id(1),
                num_pairs, H, I, stride_am, stride_we, stride_wn, stride_wk, stride_om,
                BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, TMA,
            )  # fmt: skip
