"""Greedy output of the embedded SmolLM2 against transformers' own GGUF loading.

10 chat prompts from 10 to 1,500 tokens, 32 new tokens each, under the default
scheduler and with each mechanism that could corrupt KV forced on: chunked
prefill in small chunks, prefill without chunking, prefix-cache hits,
preemption by recompute.
"""

from __future__ import annotations

import pytest
from conftest import hf_greedy
from prompts import chat_prompt_ids

from siesta import LLM, SamplingParams

# Short and long, around block and chunk edges; 5,400 tokens in all, over twice what the
# preemption tests' caches hold.
LENGTHS = [10, 16, 40, 90, 180, 340, 600, 1000, 1250, 1500]
NEW_TOKENS = 32
KV_BYTES_PER_TOKEN_FP32 = 30 * 2 * 3 * 64 * 4  # layers * (K, V) * kv heads * head dim * fp32


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    out = [chat_prompt_ids(embedded_tokenizer, seed=i, num_tokens=n) for i, n in enumerate(LENGTHS)]
    assert [len(p) for p in out] == LENGTHS
    return out


@pytest.fixture(scope="module")
def reference(hf_embedded, prompts, embedded_source):
    return [hf_greedy(hf_embedded, p, NEW_TOKENS, embedded_source.eos_token_ids) for p in prompts]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                        use_tqdm=False)  # fmt: skip
    return [o.outputs[0].token_ids for o in outs]


def test_default_engine_matches_transformers(prompts, reference):
    llm = LLM(dtype="float32")
    assert generate(llm, prompts) == reference
    # Run again: every prompt's full blocks now come from the prefix cache.
    before = llm.get_metrics()["siesta_prefix_cache_hits_total"]
    assert generate(llm, prompts) == reference
    hits = llm.get_metrics()["siesta_prefix_cache_hits_total"] - before
    block = llm.config.cache.block_size
    assert hits == sum((len(p) - 1) // block * block for p in prompts)


def test_small_prefill_chunks(prompts, reference):
    llm = LLM(dtype="float32", max_num_batched_tokens=96, enable_prefix_caching=False)
    assert generate(llm, prompts) == reference


def test_unchunked_prefill(prompts, reference):
    llm = LLM(dtype="float32", enable_chunked_prefill=False, max_model_len=2048, enable_prefix_caching=False)
    assert generate(llm, prompts) == reference


def test_shared_prefixes_hit_and_match(prompts, reference, embedded_source, hf_embedded):
    llm = LLM(dtype="float32")
    long = prompts[-1]
    # Prompts that share the long prompt's first 1,000 tokens, then diverge.
    variants = [long[:1000] + p[-40:] for p in prompts[:4]]
    expected = [hf_greedy(hf_embedded, v, NEW_TOKENS, embedded_source.eos_token_ids) for v in variants]
    assert generate(llm, [long]) == [reference[-1]]
    assert generate(llm, variants) == expected
    assert llm.get_metrics()["siesta_prefix_cache_hits_total"] >= 4 * (1000 // 16 * 16)


def test_preemption_recomputes_exactly(prompts, reference):
    # Room for about a quarter of the batch's KV: requests are preempted and recomputed.
    llm = LLM(dtype="float32", kv_cache_bytes=2200 * KV_BYTES_PER_TOKEN_FP32)
    assert generate(llm, prompts) == reference
    assert llm.get_metrics()["siesta_num_preemptions_total"] > 0


def test_async_scheduling_matches_transformers(prompts, reference):
    # Each step is scheduled and launched before the last one's samples are read back; the
    # small cache preempts requests a step ahead of their last sample, too.
    llm = LLM(dtype="float32", async_scheduling=True, kv_cache_bytes=2200 * KV_BYTES_PER_TOKEN_FP32)
    assert generate(llm, prompts) == reference
    assert llm.get_metrics()["siesta_num_preemptions_total"] > 0
