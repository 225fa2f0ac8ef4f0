"""``siesta.bench.attention_host``: every arm times the same calls, the step cache saves host
time, and the kernels are put back after."""

from __future__ import annotations

import json

from siesta.attention import triton_kernels, triton_kv_write
from siesta.bench import attention_host


def test_arms_run_and_everything_is_restored() -> None:
    kernels_before = {n: getattr(triton_kernels, n) for n in dir(triton_kernels)}
    write_before = {n: getattr(triton_kv_write, n) for n in dir(triton_kv_write)}
    res = attention_host.run(steps=2, layers=4, repeats=1)
    json.dumps(res)
    assert {"stubbed", "stubbed_every_layer"} <= set(res["us_per_layer"])
    assert all(len(runs) == 1 for runs in res["us_per_layer_runs"].values())
    assert res["us_per_layer"]["stubbed"] > 0 and res["step_cache_over_every_layer"]["stubbed"] > 0
    assert {n: getattr(triton_kernels, n) for n in dir(triton_kernels)} == kernels_before
    assert {n: getattr(triton_kv_write, n) for n in dir(triton_kv_write)} == write_before
