"""The GPU bench's deterministic section on the CPU, tiny, so the H200 run cannot break on a path or a key."""

from __future__ import annotations


def test_the_deterministic_section_runs_both_modes_on_the_cpu_in_small():
    """bench gpu's deterministic section, tiny: both processes run, the deterministic one's
    request is bit-identical in every case, and the cost table has its rows."""
    import argparse

    from siesta.bench import gpu

    args = gpu.build_parser().parse_args([])
    small = {"model": "random:tiny-qwen3", "device": "cpu", "max_model_len": 512,
             "deterministic_extra": "--dtype float32 --kv-cache-bytes 16777216 --tier-bytes 33554432 --prompt-tokens 96 "
                                    "--batch 8 --small-chunk 16 --decode-batches 1,8 --decode-context 32 "
                                    "--decode-steps 2 --prefill-tokens 256"}  # fmt: skip
    out = gpu.deterministic(argparse.Namespace(**(vars(args) | small)))
    assert out["bit_identical"], out["deterministic"]["equal_to_alone"]
    assert {"decode_b1_step_ms", "decode_b8_step_ms", "prefill256_s"} <= set(out["cost"])
    # A profiled step of each mode at the smallest and largest batch, and what grew between them.
    assert set(out["kernels_grown_ms"]) == {"kernels_b1", "kernels_b8"}
    rows = [r[0] for r in gpu.summary({"deterministic": out})]
    assert "deterministic step, b8: device ms added" in rows
    for grown in out["kernels_grown_ms"].values():
        assert {"device_busy", "launches"} <= set(grown) and len(grown) > 2


def test_grown_kernels_counts_a_kernel_only_one_mode_runs_in_full():
    from siesta.bench.deterministic import grown_kernels

    base = {"device_busy_ms": 5.0, "launches": 100,
            "top_kernels_ms_per_step": {"nvjet_sm90_tst": 3.0, "decode_split_kernel": 1.0, "_rope_kernel": 0.1}}
    det = {"device_busy_ms": 7.5, "launches": 90,
           "top_kernels_ms_per_step": {"_matmul_tma_kernel": 3.5, "unified_kernel": 2.0, "_rope_kernel": 0.1}}
    assert grown_kernels(base, det) == {
        "device_busy": 2.5, "launches": -10, "families": {"GEMM": 0.5, "attention": 1.0, "other": 0.0},
        "_matmul_tma_kernel": 3.5, "unified_kernel": 2.0, "_rope_kernel": 0.0, "decode_split_kernel": -1.0,
        "nvjet_sm90_tst": -3.0}  # fmt: skip
