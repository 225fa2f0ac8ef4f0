"""Deterministic (batch-invariant) mode on the CPU: a request's tokens and logprobs are the same
bits alone, in batches of 1-64 beside others, however its prompt is chunked, with its prefix from
the device cache, from the host tier, and across a sleep that keeps the tier (issue 36)."""

from __future__ import annotations

import random

import pytest

from siesta import LLM, SamplingParams
from siesta.config import ConfigError

MODEL = "random:tiny-qwen3"  # q/k norms, head_dim 32 apart from hidden / heads
TIER = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"block_size": 32, "cpu_bytes_to_use": 1 << 26}}  # fmt: skip
PARAMS = SamplingParams(max_tokens=12, temperature=0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
# Prompt logprobs take no cached prefix (cached KV has no logits): prefix-cache runs score decodes only.
DECODE_ONLY = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)


def engine(deterministic: bool = True, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_bytes": 1 << 24, "max_model_len": 1024} | kw
    return LLM(MODEL, deterministic=deterministic, **kw)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(3, 300))] for _ in range(n)]


TARGET = prompts(1, seed=1)[0][:1] + prompts(1, seed=2)[0] + prompts(1, seed=3)[0]  # ~300-600 tokens


def bits(llm: LLM, batch: list[list[int]], index: int = 0, params: SamplingParams = PARAMS) -> tuple:
    """Request ``index``'s generated ids, their logprobs and its prompt logprobs, exactly."""
    out = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)[index]
    gen = out.outputs[0]
    decode = [step[t].logprob for step, t in zip(gen.logprobs, gen.token_ids, strict=True)]
    if params.prompt_logprobs is None:
        return tuple(gen.token_ids), tuple(decode)
    prompt = [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], batch[index][1:], strict=True)]
    return tuple(gen.token_ids), tuple(decode), tuple(prompt)


@pytest.fixture(scope="module")
def alone() -> tuple:
    llm = engine()
    return bits(llm, [TARGET])


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_the_same_bits_alone_and_in_a_batch(alone, batch):
    llm = engine()
    others = prompts(batch - 1, seed=batch)
    position = batch // 2
    assert bits(llm, others[:position] + [TARGET] + others[position:], index=position) == alone


@pytest.mark.parametrize("budget", [16, 100, 4096])
def test_the_same_bits_however_the_prompt_is_chunked(alone, budget):
    assert bits(engine(max_num_batched_tokens=budget), [TARGET] + prompts(3, seed=9)) == alone


def test_the_same_bits_from_the_device_cache_and_the_tier_and_across_a_kept_sleep(alone):
    llm = engine(kv_transfer_config=TIER)
    decoded = alone[:2]
    assert bits(llm, [TARGET], params=DECODE_ONLY) == decoded  # computed, stored into the tier
    device_hits = llm.get_metrics()["siesta_prefix_cache_hits_total"]
    assert bits(llm, [TARGET], params=DECODE_ONLY) == decoded  # its prefix from the device cache
    assert llm.get_metrics()["siesta_prefix_cache_hits_total"] > device_hits
    llm.reset_prefix_cache()
    hits = llm.get_metrics()["siesta_external_prefix_cache_hits_total"]
    assert bits(llm, [TARGET], params=DECODE_ONLY) == decoded  # from the host tier
    assert llm.get_metrics()["siesta_external_prefix_cache_hits_total"] > hits
    # Paused mid-generation with keep, slept (tier kept), woken, resumed.
    rid = llm.add_request({"prompt_token_ids": TARGET}, DECODE_ONLY)
    for _ in range(4):
        llm.step()
    llm.sleep(level=1, mode="keep", clear_connector_cache=False)
    llm.wake_up()
    outs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outs[out.request_id] = out
    gen = outs[rid].outputs[0]
    assert (tuple(gen.token_ids), tuple(step[t].logprob for step, t in zip(gen.logprobs, gen.token_ids, strict=True))) == decoded


def test_at_smollm2s_shape_chunking_leaves_the_bits_alone():
    """SmolLM2's shape (576 wide, head_dim 64: where the default mode's prompt rows go through MKL
    and the C prefill kernel), chunked in 32s or in one."""
    prompt = TARGET[:200]
    runs = [bits(LLM("random:smollm2-135m", dtype="float32", kv_cache_bytes=1 << 26, max_model_len=512,
                     deterministic=True, max_num_batched_tokens=b), [prompt]) for b in (32, 4096)]  # fmt: skip
    assert runs[0] == runs[1]


def test_the_default_mode_is_not_invariant_here():
    """What the tests above guard against: by default a row's linear is the kernel's in a small
    batch and MKL's or oneDNN's in a large one, and they round differently."""
    import torch

    from siesta.model import cpu_linear

    x, w = torch.randn(500, 576, generator=torch.Generator().manual_seed(0)), torch.randn(1536, 576)
    assert not torch.equal(cpu_linear.linear(x[:8].contiguous(), w), torch.nn.functional.linear(x, w)[:8])
    assert torch.equal(cpu_linear.invariant_linear(x[:8].contiguous(), w, None), cpu_linear.invariant_linear(x, w, None)[:8])


def test_it_is_refused_where_it_cannot_hold():
    with pytest.raises(ConfigError, match="float32"):
        LLM(MODEL, dtype="bfloat16", deterministic=True, kv_cache_bytes=1 << 22)
    with pytest.raises(ConfigError, match="one rank"):
        LLM(MODEL, deterministic=True, tensor_parallel_size=2, kv_cache_bytes=1 << 22)


def test_vllms_environment_variable_and_the_flags_turn_it_on(monkeypatch):
    from siesta.config import EngineConfig
    from siesta.entrypoints.cli import build_parser
    from siesta.entrypoints.engine_args import engine_config

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().deterministic
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert not EngineConfig().deterministic
    for flag in ("--deterministic", "--enable-deterministic-inference"):
        assert engine_config(build_parser().parse_args(["serve", flag])).deterministic
    assert not engine_config(build_parser().parse_args(["serve"])).deterministic
