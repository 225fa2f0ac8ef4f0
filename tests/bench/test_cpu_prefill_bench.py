"""The prefill attention bench: its FLOP count and one tiny case, both arms agreeing."""

from __future__ import annotations

import pytest

from siesta.attention.cpu_attention import load_prefill_kernel
from siesta.bench.cpu_prefill import Case, causal_flops, time_case


def test_causal_flops_counts_every_pair_a_query_sees() -> None:
    case = Case("two", ((3, 5), (4, 4)), q_heads=2, kv_heads=1, head_dim=8, layers=1)
    # Request 0: new tokens at positions 2, 3, 4 see 3, 4, 5 keys; request 1: 1 + 2 + 3 + 4.
    pairs = (3 + 4 + 5) + (1 + 2 + 3 + 4)
    assert causal_flops(case) == 4 * 2 * 8 * pairs


def test_a_tiny_case_times_both_arms_and_they_agree() -> None:
    if load_prefill_kernel() is None:
        pytest.skip("no C compiler: the bench refuses to run (tests/attention/test_cpu_prefill.py says why)")
    case = Case("tiny", ((20, 40), (7, 7)), layers=2)
    result = time_case(case, rounds=1)
    assert set(result["arms"]) == {"torch", "kernel"}
    assert all(arm["ms_per_layer"] > 0 for arm in result["arms"].values())
    assert result["max_abs_diff"] < 1e-4
