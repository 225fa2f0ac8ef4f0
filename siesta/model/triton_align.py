"""A decode step's (token, k) pairs sorted by expert and padded to whole row tiles, in one Triton
program: what ``triton_moe.align`` computes with some 18 torch launches a layer.

Each of those launches is a node of the decode graph, and at batch 16 to 256 a Qwen3-30B-A3B
step runs 48 layers of them: ~860 nodes of a few microseconds each, between kernels that wait on
them. One program does it all, in four passes over the pairs in chunks of ``BLOCK_P``:

1. each expert's count (a one-hot sum per chunk), then each expert's first row (an exclusive
   sum of the counts padded to ``BLOCK_M``) and the padded total;
2. each pair's row: its expert's first row, plus the pairs of that expert before it (the pairs
   of earlier chunks, carried, and of its own chunk, an exclusive scan of the one-hot chunk);
3. the padding value (the pair count) into every row no pair took: each expert's last rows,
   all at once, then the unused tiles past the padded total;
4. each row tile's expert: the experts whose run ends at or before the tile's first row
   (``searchsorted(..., right=True)``), ``num_experts`` past the total.

The rows of passes 2 and 3 are disjoint, so no store waits on another. Integer arithmetic only:
the result is ``align``'s, element for element (the tests compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from siesta import pdl

# Pairs (and rows, and tiles) a chunk: a [BLOCK_P, experts] one-hot of int32 per pass.
BLOCK_P = 64
NUM_WARPS = 8


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, tile_expert_ptr, num_padded_ptr, n, rows,
    NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_for_previous_grid(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    real = experts < NUM_EXPERTS
    chunk = tl.arange(0, BLOCK_P)

    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, n, BLOCK_P):
        ids = tl.load(ids_ptr + p0 + chunk, mask=p0 + chunk < n, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded

    running = starts  # each expert's next free row
    for p0 in range(0, n, BLOCK_P):
        offs = p0 + chunk
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # this chunk's earlier pairs of the same expert
        dest = tl.sum(hit * (before + running[None, :]), axis=1)
        tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=offs < n)
        running += tl.sum(hit, axis=0)

    # Each expert's run is padded by under a tile: its padding rows at once, as [experts, BLOCK_M].
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    empty = tl.zeros((BLOCK_E, BLOCK_M), dtype=tl.int32) + n
    tl.store(sorted_ptr + pad, empty, mask=pad < ends[:, None])
    total = tl.sum(padded, axis=0)
    for r0 in range(total, rows, BLOCK_P):  # past the last run: whole tiles nobody uses
        r = r0 + chunk
        tl.store(sorted_ptr + r, tl.zeros((BLOCK_P,), dtype=tl.int32) + n, mask=r < rows)

    tiles = rows // BLOCK_M
    for t0 in range(0, tiles, BLOCK_P):
        t = t0 + chunk
        first_row = t * BLOCK_M
        ended = (ends[None, :] <= first_row[:, None]) & real[None, :]
        tl.store(tile_expert_ptr + t, tl.sum(ended.to(tl.int32), axis=1), mask=t < tiles)
    tl.store(num_padded_ptr, total)


def align_pairs(
    flat: torch.Tensor, num_experts: int, block_m: int, max_tiles: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_pairs [max_tiles * block_m], tile_expert [max_tiles], num_padded [1])``, all int32,
    for the expert ids ``flat`` (one a pair, contiguous): ``triton_moe.Alignment``'s fields."""
    n = flat.numel()
    rows = max_tiles * block_m
    sorted_pairs = torch.empty((rows,), dtype=torch.int32, device=flat.device)
    tile_expert = torch.empty((max_tiles,), dtype=torch.int32, device=flat.device)
    num_padded = torch.empty((1,), dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](
        flat, sorted_pairs, tile_expert, num_padded, n, rows,
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_P=BLOCK_P, BLOCK_M=block_m,
        num_warps=NUM_WARPS, **pdl.launch(flat.device),
    )  # fmt: skip
    return sorted_pairs, tile_expert, num_padded
