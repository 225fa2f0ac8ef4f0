"""The ``fp8_decode`` section of the GPU bench, smoke-sized: it runs end to end (under Triton's
interpreter on the CPU), times the decode over a half-precision and an fp8 cache and a candidate
tile, checks the candidate against the shipped tile, and the table reads it."""

from __future__ import annotations

import json

import torch

from siesta.attention import triton_tiles as tiling
from siesta.bench import fp8_decode as fd
from siesta.bench import gpu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: the interpreter (conftest)


def test_the_smoke_run_with_a_candidate_tile() -> None:
    res = fd.run(DEVICE, smoke=True, candidates=[fd.parse_candidate("32w4s2")])
    json.dumps(res)
    (row,) = res["rows"]
    assert (row["batch"], row["context"]) == fd.SMOKE_CASES[0]
    assert row["half"]["us"] > 0 and row["fp8"]["us"] > 0 and row["fp8_over_half"] > 0
    (cand,) = row["candidates"]
    assert cand["agrees"] and cand["us"] > 0
    (summary,) = fd.summary_rows(res)
    assert summary[0] == f"fp8 KV decode / bf16, b{row['batch']} ctx {row['context']}"
    assert summary in gpu.summary({"fp8_decode": res})


def test_parse_candidate() -> None:
    assert fd.parse_candidate("128w4s3") == tiling.Tiles(block_m=tiling.MIN_DOT_DIM, block_n=128, num_warps=4,
                                                         num_stages=3)  # fmt: skip
