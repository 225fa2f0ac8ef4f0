"""The GPU bench's ``fp8`` section on the CPU: its accuracy part end to end on a tiny model (the
fidelity oracle with an fp8 KV cache against the model's own dtype), and its summary."""

from __future__ import annotations

import argparse
import json

from siesta.bench import gpu
from siesta.bench.fp8 import AUTO, FP8


def test_the_accuracy_part_runs_fp8_against_the_models_dtype() -> None:
    args = gpu.build_parser().parse_args([])
    small = {"model": "random:tiny-llama", "fp8_parts": ["accuracy"], "fp8_check_shape": "tiny-llama",
             "fp8_check_layers": 2, "fidelity_tokens": 160, "fidelity_kv_bytes": 16 << 20, "device": "cpu"}  # fmt: skip
    out = gpu.SECTIONS["fp8"](argparse.Namespace(**(vars(args) | small)))
    json.dumps(out)
    runs = out["accuracy"]
    assert set(runs) == {AUTO, FP8}
    # The fp8 engine really ran an fp8 cache: its errors are its own, and within the fidelity scale.
    fp8, auto = runs[FP8]["push_batch1"]["max_error"], runs[AUTO]["push_batch1"]["max_error"]
    assert fp8 != auto and 0 < fp8 < 1.0
    rows = [r[0] for r in gpu.summary({"fp8": out})]
    assert "logprobs / bf16 floor, KV fp8" in rows and "logprobs / bf16 floor, KV auto" in rows


def test_the_summary_reads_every_part() -> None:
    res = {"capacity": {AUTO: {"kv_tokens": 100, "decode_b64_ctx8192": {"tok_s": 10.0}},
                        FP8: {"kv_tokens": 200, "decode_b64_ctx8192": {"tok_s": 11.0}}, "kv_tokens_ratio": 2.0},
           "resume": {"fp8_kept_vs_bf16_cleared": 30.0, "bf16_kept_vs_bf16_cleared": 17.0, "fp8_kept_over_floor": 1.1},
           "seed_client": {"speedup_p50": 25.0}}  # fmt: skip
    rows = {r[0]: r[1] for r in gpu.summary({"fp8": res})}
    assert rows["fp8 KV tokens / bf16's"] == 2.0 and rows["fp8 decode_b64_ctx8192 tok/s"] == 11.0
    assert rows["fp8 kept vs bf16 cleared (p50)"] == 30.0 and rows["seed client over HTTP, fp8 KV (p50)"] == 25.0
    # Only the sections that ran have rows: no empty decode, resume or sleep rows beside fp8's.
    assert not {"decode b1 tok/s", "resume kept vs cleared (p50 speedup)", "sleep freed fraction"} & set(rows)
