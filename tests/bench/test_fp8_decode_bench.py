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
    (half,) = row["half_candidates"]
    assert half["agrees"] and half["us"] > 0
    (summary,) = fd.summary_rows(res)
    assert summary[0] == f"fp8 KV decode / bf16, b{row['batch']} ctx {row['context']}"
    assert summary in gpu.summary({"fp8_decode": res})


def test_parse_candidate() -> None:
    assert fd.parse_candidate("128w4s3") == tiling.Tiles(block_m=tiling.MIN_DOT_DIM, block_n=128, num_warps=4,
                                                         num_stages=3)  # fmt: skip



def test_the_gpu_benchs_section_runs_and_lists_what_compiled(monkeypatch, tmp_path) -> None:
    """``bench gpu --sections fp8_decode`` runs the module and reports what compiled; smoke-sized
    here, where the interpreter compiles nothing and no IR file is written beside the JSON."""
    real_run = fd.run
    # What the section passes goes to the real run unchanged; only the size is the smoke's.
    monkeypatch.setattr(fd, "run", lambda device, **kwargs: real_run(device, smoke=True, **kwargs))
    args = gpu.build_parser().parse_args(["--device", DEVICE.type, "--json", str(tmp_path / "gpu.json"),
                                          "--decode-candidates", "32w4s2"])  # fmt: skip
    res = gpu.SECTIONS["fp8_decode"](args)
    assert [(r["batch"], r["context"]) for r in res["rows"]] == list(fd.SMOKE_CASES)
    (row,) = res["rows"]
    assert [c["tiles"]["block_n"] for c in row["candidates"] + row["half_candidates"]] == [32, 32]
    if DEVICE.type == "cpu":
        assert res["compiled"] == [] and not (tmp_path / "fp8_decode_ttgir.txt").exists()
