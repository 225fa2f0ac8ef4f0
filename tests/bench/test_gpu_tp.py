"""The GPU bench's tensor-parallel mode, run on the CPU in a tiny configuration (gloo): what a
host with several GPUs runs with no further code."""

from __future__ import annotations

import argparse

from siesta.bench import gpu

MODEL = "random:tiny-llama"


def _args() -> argparse.Namespace:
    return gpu.build_parser().parse_args([
        "--device", "cpu", "--tp-models", MODEL, "--tp-sizes", "1,2", "--tp-dtype", "float32",
        "--max-model-len", "512", "--max-num-batched-tokens", "256", "--decode-context", "32", "--decode-steps", "3",
        "--resume-requests", "2", "--resume-tokens", "48", "--tier-block-size", "16", "--tier-bytes", str(32 << 20),
    ])  # fmt: skip


def test_every_size_reports_logits_decode_collectives_resume_and_sleep_per_rank():
    result = gpu.tensor_parallel(_args())[MODEL]
    one, two = result["tp1"], result["tp2"]
    assert one["reference"] is True
    vs = two["against_reference"]
    assert vs["tokens_agree"] == vs["of"] and vs["max_abs_logprob_diff"] < 1e-3  # fp32: the same model
    for entry in (one, two):
        assert entry["decode"]["batch1"]["tok_s"] > 0 and entry["decode"]["batch64"]["step_ms"] > 0
        assert entry["resume"]["kept"]["external_hits"] == 2 * ((48 - 1) // 16 * 16)  # both prompts' full blocks
        assert entry["resume"]["cleared"]["external_hits"] == 0
    assert len(two["sleep_wake"]["freed_GiB_per_rank"]) == 2
    rows = gpu.tensor_parallel_rows({MODEL: result})
    assert len(rows) == 2 and "tp2" in rows[1][0]
