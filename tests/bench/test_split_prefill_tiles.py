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
    for d in res["dtypes"].values():
        assert [r["tiles"] for r in d["rows"]] == ["shipped", "16x16w4s1"]
        assert all("error" not in r and r["us"] > 0 for r in d["rows"])
        assert d["rows"][1]["rel_err"] < 1e-5  # another tile and split count, the same attention


def test_a_candidate_reads_as_rows_keys_warps_stages() -> None:
    tiles = bench.parse_candidate("64x32w4s2")
    assert (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages) == (64, 32, 4, 2)
