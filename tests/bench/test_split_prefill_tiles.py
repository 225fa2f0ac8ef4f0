"""``siesta.bench.split_prefill_tiles``: the smoke case times the shipped tile and a candidate
over both caches, and the candidate's output is the shipped tile's."""

from __future__ import annotations

import json

import torch

from siesta.bench import split_prefill_tiles as bench


def test_the_smoke_case_times_every_candidate_and_checks_its_output() -> None:
    res = bench.run(torch.device("cpu"), smoke=True)
    json.dumps(res)
    assert set(res["dtypes"]) == {"fp8", "bf16"}
    # Another tile and split count, the same attention: to fp32's rounding for the smoke's fp32
    # stand-in for bf16; over fp8 the probabilities go to fp16 (2^-11 a value), each split rounding
    # them against its own running max.
    tolerance = {"fp8": 2e-3, "bf16": 1e-5}
    for name, d in res["dtypes"].items():
        assert [r["tiles"] for r in d["rows"]] == ["shipped", "16x16w4s1"]
        assert all("error" not in r and r["us"] > 0 for r in d["rows"])
        assert d["rows"][1]["rel_err"] < tolerance[name]


def test_a_candidate_reads_as_rows_keys_warps_stages() -> None:
    tiles = bench.parse_candidate("64x32w4s2")
    assert (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages) == (64, 32, 4, 2)
