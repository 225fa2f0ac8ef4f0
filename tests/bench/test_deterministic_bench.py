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
