"""``siesta.bench.attention_host``: both arms time the same calls, and the kernels and helpers
are put back after."""

from __future__ import annotations

import json

from siesta import host_ints
from siesta.attention import triton_kernels, triton_kv_write
from siesta.bench import attention_host


def test_both_arms_run_and_everything_is_restored() -> None:
    kernels_before = {n: getattr(triton_kernels, n) for n in dir(triton_kernels)}
    write_before = {n: getattr(triton_kv_write, n) for n in dir(triton_kv_write)}
    helpers_before = host_ints.cdiv, host_ints.next_power_of_2
    res = attention_host.run(calls=20, repeats=1)
    json.dumps(res)
    assert len(res["us_per_call"]["host_ints"]) == len(res["us_per_call"]["triton_helpers"]) == 1
    assert res["host_ints_us"] > 0 and res["host_ints_over_triton_helpers"] > 0
    assert {n: getattr(triton_kernels, n) for n in dir(triton_kernels)} == kernels_before
    assert {n: getattr(triton_kv_write, n) for n in dir(triton_kv_write)} == write_before
    assert (host_ints.cdiv, host_ints.next_power_of_2) == helpers_before
