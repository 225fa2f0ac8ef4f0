"""The ``invariant_matmul`` section of the GPU bench, smoke-sized: it runs end to end (under
Triton's interpreter on the CPU), its candidate tiles are timed and bit-checked, and the table
reads it."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
# @triton.jit reads TRITON_INTERPRET when a kernel is defined: a module imported before the
# flag was set must be loaded again.
if "siesta.model.triton_matmul" in sys.modules:
    importlib.reload(sys.modules["siesta.model.triton_matmul"])

from siesta.bench import gpu  # noqa: E402
from siesta.bench import invariant_matmul as im  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def test_the_smoke_run_with_a_candidate_tile() -> None:
    res = im.run(DEVICE, smoke=True, candidates=[im.parse_config("16x16x16w4s1"), im.parse_config("16x16x16w4s1t")])
    json.dumps(res)
    assert {r["shape"] for r in res["results"]} == {name for name, _, _ in im.SMOKE_SHAPES}
    for r in res["results"]:
        assert r["row_bits_as_alone"] and r["rel_err"] < 1e-5
        plain, tma = r["candidates"]
        assert plain["config"]["block_k"] == 16 and plain["us"] > 0 and tma["config"]["persistent_tma"]
        assert (tma["bits_as_shipped"], tma["row_bits_as_shipped_alone"]) == (plain["bits_as_shipped"],
                                                                       plain["row_bits_as_shipped_alone"])
    rows = {row[0] for row in gpu.summary({"invariant_matmul": res})}
    assert {f"invariant GEMM / cuBLAS, {name} (M=1 / 3)" for name, _, _ in im.SMOKE_SHAPES} <= rows


def test_parse_config() -> None:
    assert im.parse_config("128x256x64w8s3") == im.MatmulConfig(128, 256, 64, 8, 8, 3)
    assert im.parse_config("128x128x64w8s4t") == im.MatmulConfig(128, 128, 64, 8, 8, 4, persistent_tma=True)
