"""The logprob oracle on the CPU: transformers-initialised models of the four architectures the
engine serves (Llama-3 with llama3 rope, Qwen3 with q/k norms, Qwen2 with q/k/v biases, Mistral),
pushed and loaded from a checkpoint, scored on prompt and decoded tokens against transformers in
fp32 up to 8k positions. In fp32 the engine is held to 1e-4 (the bf16 floor is ~1e-2 here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from siesta.bench import fidelity

# head_dim 64: the CPU's C prefill kernel serves these (head_dim a multiple of its 64-wide tile).
SMALL = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
SHAPES = {
    "llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 1024}}),
    "qwen3": ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "mistral": ("mistral", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "sliding_window": None}),
}  # fmt: skip
LONG = 8192 - 2 * fidelity.DECODE_TOKENS
TOLERANCE = 1e-4


def config(shape: str):
    model_type, extra = SHAPES[shape]
    return AutoConfig.for_model(model_type, **(SMALL | extra))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_engine_in_fp32_is_the_trainer_at_every_position(shape):
    out = fidelity.run_shape(shape, config(shape), device="cpu", long_len=LONG, batch=4, engine_dtype="float32",
                             kv_cache_bytes=1 << 27, checkpoint=True)  # fmt: skip
    for run in ("push_batch1", "push_batch4", "checkpoint_batch1"):
        buckets = out[run]["buckets"]
        assert set(buckets["prompt"]) == {"1-64", "64-256", "256-1024", "1024-4096", "4096-8192"}
        worst = {kind: max(c["siesta"] for c in cells.values()) for kind, cells in buckets.items()}
        assert worst["prompt"] <= TOLERANCE and worst["decode"] <= TOLERANCE, (run, buckets)
        assert all(c["floor"] > 10 * TOLERANCE for c in buckets["prompt"].values())  # bf16 is far coarser
    assert out["push_equals_checkpoint"]


def test_an_engine_whose_rope_is_not_the_trainers_is_seen_drifting():
    """What the oracle is for: the trainer's config says llama3 rope at theta 500000, the engine
    serves the same weights with theta 10000. Position 0 agrees; the drift grows with position."""
    trainer = config("llama3")
    served = AutoConfig.for_model("llama", **(SMALL | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}))
    out = fidelity.run_shape("llama3", trainer, device="cpu", long_len=1024, batch=1, engine_dtype="float32",
                             kv_cache_bytes=1 << 25, served=served)  # fmt: skip
    prompt = out["push_batch1"]["buckets"]["prompt"]
    assert prompt["256-1024"]["siesta"] > 20 * TOLERANCE  # matched, the same weights are within TOLERANCE


def test_buckets_report_the_worst_error_and_its_ratio_to_the_floor():
    s = fidelity.Scored(prompt=[5, 6, 7], generated=[8, 9], prompt_lp=[-1.0, -2.0], decode_lp=[-3.0, -4.0])
    ref, floor = [-1.0, -2.5, -3.25, -4.0], [-1.5, -2.0, -3.0, -4.0]
    report = fidelity.errors_by_bucket([s], [ref], [floor])
    assert report["prompt"] == {"1-64": {"siesta": 0.5, "floor": 0.5, "ratio": 1.0, "positions": 2}}
    assert report["decode"]["1-64"] == {"siesta": 0.25, "floor": 0.25, "ratio": 1.0, "positions": 2}


def test_routing_counts_sets_unlike_fp32s_and_those_past_the_bf16_floor():
    """Two positions, one sparse layer (1), top 2 of 4 experts. fp32's probabilities rank experts
    0 > 1 > 2 > 3 at both. Position 0: the engine swaps the order within the top 2 (no difference),
    bf16 transformers takes expert 2 (0.05 below the 2nd): the floor. Position 1: the engine takes
    expert 3, 0.2 below the 2nd: beyond the floor; bf16 agrees."""
    probs = torch.tensor([[0.5, 0.25, 0.2, 0.05], [0.4, 0.3, 0.2, 0.1]])
    s = fidelity.Scored(prompt=[1, 2, 3], generated=[], prompt_lp=[], decode_lp=[],
                        routing=np.array([[[-1, -1], [1, 0]], [[-1, -1], [0, 3]]]))  # layer 0 dense  # fmt: skip
    key = tuple(s.ids)
    fp32 = {key: {1: (probs, torch.tensor([[0, 1], [0, 1]]))}}
    bf16 = {key: {1: (probs, torch.tensor([[0, 2], [0, 1]]))}}
    report = fidelity.routing_report([s], fp32, bf16)
    assert report["decisions"] == 2 and report["engine_differs"] == 1 and report["trainer_bf16_differs"] == 1
    assert report["floor_margin"] == pytest.approx(0.05) and report["engine_widest_margin"] == pytest.approx(0.2)
    assert report["engine_beyond_floor"] == 1


def test_the_gpu_section_runs_on_the_cpu_in_small(tmp_path, monkeypatch):
    import argparse

    from siesta import fidelity_report
    from siesta.bench import gpu
    from siesta.cache_dir import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))  # where the section keeps each report for /metrics
    args = gpu.build_parser().parse_args([])
    small = {"device": "cpu", "fidelity_shapes": ["tiny-qwen3", "tiny-qwen2"], "fidelity_tokens": 256,
             "fidelity_batch": 3, "fidelity_checkpoint": "tiny-qwen2", "fidelity_kv_bytes": 1 << 24,
             "fidelity_head_shape": "tiny-qwen3", "fidelity_decode_tokens": 6,
             "decode_context": 32, "decode_steps": 2}  # fmt: skip
    out = gpu.fidelity(argparse.Namespace(**(vars(args) | small)))
    assert set(out) == {"tiny-qwen3", "tiny-qwen3+fp32_head", "tiny-qwen2"}
    # The long prompt leaves room for its decoded tokens, and each of them is scored.
    assert out["tiny-qwen3"]["long_prompt"] == 256 - 2 * 6 and out["tiny-qwen3"]["decode_tokens"] == 6
    assert sum(c["positions"] for c in out["tiny-qwen3"]["push_batch1"]["buckets"]["decode"].values()) == 6
    # Each shape's report is kept under its engine's numerics; the fp32 head computes otherwise.
    keys = {name: out[name]["numerics_key"] for name in out}
    assert len(set(keys.values())) == 3
    for name, key in keys.items():
        assert fidelity_report.load(key)["push_batch1"]["worst_ratio"] == out[name]["push_batch1"]["worst_ratio"]
    assert set(out["tiny-qwen3"]["probe"]) == {"decode_b1_step_ms", "decode_b64_step_ms"}
    assert out["tiny-qwen2"]["push_equals_checkpoint"] is not None
    rows = gpu.summary({"fidelity": out})
    assert any("tiny-qwen2 checkpoint_batch1" in r[0] for r in rows)

