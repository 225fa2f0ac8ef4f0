"""The ``moe_tiles`` section of the GPU bench, smoke-sized: it runs end to end (under Triton's
interpreter on the CPU), the shipped tiles and a candidate are timed and compared, a tile that
cannot run is a result rather than a crash, and the table reads it."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

from siesta.bench import gpu
from siesta.bench import moe_tiles as mt
from siesta.model.triton_moe import MoeTiles

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: the interpreter (conftest)


def test_the_smoke_run_with_a_candidate_tile() -> None:
    bad = MoeTiles(block_m=16, block_n=24, block_k=16, num_warps=4, num_stages=1)  # tl.arange needs a power of 2
    res = mt.run(DEVICE, smoke=True, candidates=[mt.parse_candidate("16x32x32w4s2d:64s1"), bad])
    json.dumps(res)
    assert [r["tokens"] for r in res["rows"]] == list(mt.SMOKE_TOKENS)
    for row in res["rows"]:
        good, failed = row["candidates"]
        assert row["shipped_us"] > 0 and good["us"] > 0
        assert good["agrees"] and good["max_rel_diff"] < 1e-5  # fp32 products: tilings agree to rounding
        assert "error" in failed and row["best"]["tiles"] == good["tiles"]
    rows = mt.summary_rows(res)
    assert [r[0] for r in rows] == [f"MoE tiles, {n} tokens: best candidate / shipped" for n in mt.SMOKE_TOKENS]
    assert rows[0] in gpu.summary({"moe_tiles": res})


def test_parse_candidate() -> None:
    assert mt.parse_candidate("128x64x32w8s4") == MoeTiles(block_m=128, block_n=64, block_k=32, num_warps=8,
                                                           num_stages=4)  # fmt: skip
    with pytest.raises(ValueError, match="BLOCK_MxBLOCK_NxBLOCK_K"):
        mt.parse_candidate("128w8s4")
    assert mt.parse_candidate("128x64x32w8s4p") == MoeTiles(block_m=128, block_n=64, block_k=32, num_warps=8,
                                                            num_stages=4, persistent=True)  # fmt: skip
    down_only = mt.parse_candidate("128x64x32w8s4d")
    assert down_only.persistent_down and not down_only.persistent and down_only.down_persistent()
    wide_down = mt.parse_candidate("128x128x64w8s4d:256s3")
    assert (wide_down.down_n(), wide_down.down_stages(), wide_down.block_n, wide_down.num_stages) == (256, 3, 128, 4)
    assert (down_only.down_n(), down_only.down_stages()) == (64, 4)
    tma = mt.parse_candidate("128x128x64w8s4dt:256s3")
    assert tma == replace(wide_down, tma=True) and mt.tile_label(asdict(tma)) == "128x128x64w8s4dt:256s3"
    assert mt.parse_candidate("16x64x128w4s3t").tma and not wide_down.tma
    assert all(mt.tile_label(asdict(mt.parse_candidate(c))) == c for c in mt.CANDIDATES.split(","))


def test_the_gpu_benchs_section_runs_its_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench gpu --sections moe_tiles`` calls the module as its own main does (smoke-sized here)."""
    monkeypatch.setattr(mt, "SHAPE", mt.SMOKE_SHAPE)
    monkeypatch.setattr(mt, "TOKENS", mt.SMOKE_TOKENS[:1])
    args = gpu.build_parser().parse_args(["--device", DEVICE.type, "--moe-tile-candidates", "16x32x32w4s2"])
    res = gpu.SECTIONS["moe_tiles"](args)
    (row,) = res["rows"]
    (cand,) = row["candidates"]
    assert cand["tiles"] == asdict(mt.parse_candidate("16x32x32w4s2")) and cand["agrees"]
