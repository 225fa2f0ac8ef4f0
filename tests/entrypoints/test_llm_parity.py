"""Greedy output of the embedded SmolLM2 against transformers' own GGUF loading.

10 chat prompts from 10 to 1,500 tokens, 32 new tokens each, under the default
scheduler and with each mechanism that could corrupt KV forced on: chunked
prefill in small chunks, prefill without chunking, prefix-cache hits,
preemption by recompute. The default engine runs all 10; each forced mechanism
runs the prompts that exercise it, against the same reference outputs (an
engine step costs a decode of the whole model on CPU: fewer prompts, fewer steps).
"""

from __future__ import annotations

import pytest
from conftest import hf_greedy
from prompts import chat_prompt_ids

from siesta import LLM, SamplingParams

# Short and long, around block and chunk edges; 5,026 tokens in all.
LENGTHS = [10, 16, 40, 90, 180, 340, 600, 1000, 1250, 1500]
NEW_TOKENS = 32
KV_BYTES_PER_TOKEN_FP32 = 30 * 2 * 3 * 64 * 4  # layers * (K, V) * kv heads * head dim * fp32
# 96-token chunks: the 600-token prompt takes seven or more, and the decodes that share each step's
# budget move the chunk edges off the block edges.
SMALL_CHUNK_LENGTHS = [10, 16, 40, 90, 180, 340, 600]
# 10 + 180 + 600 fit one step's 2,048 tokens and 1,500 more do not: it waits whole, then
# prefills in one step beside the others' decodes.
UNCHUNKED_LENGTHS = [10, 180, 600, 1500]
# 25 blocks: the 340-token prompt and its new tokens fit alone (24), the six need 57 (less the
# chat template's shared blocks): admitted requests grow past the cache and one is preempted.
PREEMPTION_LENGTHS = [10, 16, 40, 90, 180, 340]
PREEMPTION_KV_BYTES = 400 * KV_BYTES_PER_TOKEN_FP32


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    out = [chat_prompt_ids(embedded_tokenizer, seed=i, num_tokens=n) for i, n in enumerate(LENGTHS)]
    assert [len(p) for p in out] == LENGTHS
    return out


@pytest.fixture(scope="module")
def reference(hf_embedded, prompts, embedded_source):
    return [hf_greedy(hf_embedded, p, NEW_TOKENS, embedded_source.eos_token_ids) for p in prompts]


def pick(lengths: list[int], prompts: list[list[int]], reference: list[list[int]]) -> tuple[list, list]:
    """The prompts of these lengths and their reference outputs."""
    chosen = [LENGTHS.index(n) for n in lengths]
    return [prompts[i] for i in chosen], [reference[i] for i in chosen]


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
    chosen, expected = pick(SMALL_CHUNK_LENGTHS, prompts, reference)
    llm = LLM(dtype="float32", max_num_batched_tokens=96, enable_prefix_caching=False)
    assert generate(llm, chosen) == expected


def test_unchunked_prefill(prompts, reference):
    chosen, expected = pick(UNCHUNKED_LENGTHS, prompts, reference)
    llm = LLM(dtype="float32", enable_chunked_prefill=False, max_model_len=2048, enable_prefix_caching=False)
    assert generate(llm, chosen) == expected


def test_shared_prefixes_hit_and_match(prompts, reference, embedded_source, hf_embedded):
    llm = LLM(dtype="float32")
    long = prompts[-1]
    # Two prompts that share the long prompt's first 1,000 tokens, then diverge, run together.
    variants = [long[:1000] + p[-40:] for p in prompts[2:4]]
    expected = [hf_greedy(hf_embedded, v, NEW_TOKENS, embedded_source.eos_token_ids) for v in variants]
    assert generate(llm, [long]) == [reference[-1]]
    assert generate(llm, variants) == expected
    assert llm.get_metrics()["siesta_prefix_cache_hits_total"] >= len(variants) * (1000 // 16 * 16)


def test_preemption_recomputes_exactly(prompts, reference):
    # Less room than the batch's KV: a request is preempted and recomputed.
    chosen, expected = pick(PREEMPTION_LENGTHS, prompts, reference)
    llm = LLM(dtype="float32", kv_cache_bytes=PREEMPTION_KV_BYTES)
    assert generate(llm, chosen) == expected
    assert llm.get_metrics()["siesta_num_preemptions_total"] > 0


def test_async_scheduling_matches_transformers(prompts, reference):
    # Each step is scheduled and launched before the last one's samples are read back; the
    # small cache preempts requests a step ahead of their last sample, too.
    chosen, expected = pick(PREEMPTION_LENGTHS, prompts, reference)
    llm = LLM(dtype="float32", async_scheduling=True, kv_cache_bytes=PREEMPTION_KV_BYTES)
    assert generate(llm, chosen) == expected
    assert llm.get_metrics()["siesta_num_preemptions_total"] > 0
