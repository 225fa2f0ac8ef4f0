"""The ``invariant_attention`` section of the GPU bench, smoke-sized: it runs end to end (under
Triton's interpreter on the CPU), a candidate tile is timed and bit-checked against the prefill
tile, and the table reads it."""

from __future__ import annotations

import json

import torch

from siesta.attention import triton_tiles as tiling
from siesta.bench import gpu
from siesta.bench import invariant_attention as ia

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: the interpreter (conftest)


def test_the_smoke_run_with_a_candidate_tile() -> None:
    res = ia.run(DEVICE, smoke=True, candidates=[ia.parse_candidate("64w4s2")])
    json.dumps(res)
    (row,) = res["rows"]
    assert row["shipped_bits_equal"] and res["all_shipped_bits_equal"]
    assert min(row["split_us"], row["prefill_tile_us"], row["shipped_us"]) > 0
    (cand,) = row["candidates"]
    # The key step is the prefill tile's, whatever the candidate's rows.
    assert cand["tiles"]["block_n"] == tiling.prefill_tiles(32, torch.float32).block_n
    assert cand["bits_equal"]  # the wide prefill tile's own rows: the same products
    (summary,) = ia.summary_rows(res)
    assert summary[0] == "deterministic decode rows / prefill tile, tiny (b3, 40)" and "bits equal: True" in summary[2]
    assert summary in gpu.summary({"invariant_attention": res})


def test_parse_candidate() -> None:
    assert ia.parse_candidate("16w4s3") == tiling.Tiles(block_m=16, block_n=0, num_warps=4, num_stages=3)


def test_decode_rows_keep_the_prefill_tiles_key_step() -> None:
    """A row's bits depend on its key step: deterministic mode's decode tiles take the prefill
    tiles' for every head size and width."""
    for head_dim in (64, 128, 256):
        for dtype in (torch.bfloat16, torch.float32):
            for programs, fp8 in ((1, False), (4096, False), (4096, True)):
                decode = tiling.invariant_decode_tiles(head_dim, dtype, programs, 132, fp8)
                assert decode.block_n == tiling.prefill_tiles(head_dim, dtype).block_n


def test_a_crowded_batch_takes_one_stage_and_a_lone_program_two() -> None:
    """Stages do not change a row's sums, so the tile may follow the batch: one stage once every SM
    has a program (two then share it), two for a few programs, and fp8 caches keep two."""
    lone = tiling.invariant_decode_tiles(128, torch.bfloat16, 8, 132)
    crowded = tiling.invariant_decode_tiles(128, torch.bfloat16, 132, 132)
    assert (lone.num_stages, crowded.num_stages) == (2, 1)
    assert tiling.invariant_decode_tiles(128, torch.bfloat16, 2048, 132, fp8_cache=True) == lone
    assert lone.block_m == crowded.block_m == 64
