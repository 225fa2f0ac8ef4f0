"""The seed's counters, read as the seed reads them: a finished request's blocks are in the
tier (and counted) by the time its output is out, so a kept replay stores nothing.

The seed's arm on the embedded model, offline: warm up, read the counters, sleep(level=1)
keeping the tier, wake up, replay the same prompts, read them again. Expected bytes are
counted independently: tier entries times the bytes of one entry from the checkpoint's own
config (layers x K and V x KV heads x head dim x tokens x 4 bytes of float32).
"""

from __future__ import annotations

import pytest

from siesta import LLM, SamplingParams

TIER_BLOCK = 64
NEW_TOKENS = 8
FLOAT32_BYTES = 4
LOADS = 'siesta_kv_offload_load_bytes_total{tier="host"}'
STORES = 'siesta_kv_offload_store_bytes_total{tier="host"}'
HITS = "siesta_external_prefix_cache_hits_total"


def seed_prompt(idx: int, words: int) -> str:
    """The seed client's prompt generator: distinct prefixes of numbered words."""
    return f"session-{idx}: " + " ".join(f"w{idx}_{i}" for i in range(words))


def seed_prompts(tokenizer) -> list[list[int]]:
    """The seed's prompts cut to lengths that cover every way a request's last blocks fill:
    its last step fills a tier block (the case stored only a step late before), a block fills
    mid-generation, and no generated token fills one."""
    # KV is computed for prompt + NEW_TOKENS - 1 tokens (the last sample has none).
    ends = {"last_step_fills": 4 * TIER_BLOCK, "fills_mid_generation": 5 * TIER_BLOCK + 3, "none_fills": 3 * TIER_BLOCK + 20}
    lengths = [end - (NEW_TOKENS - 1) if name == "last_step_fills" else end for name, end in ends.items()]
    lengths = [lengths[0], lengths[1] - 5, lengths[2], lengths[0] + TIER_BLOCK]
    prompts = []
    for idx, length in enumerate(lengths):
        ids = tokenizer.encode(seed_prompt(idx, length))  # more than ``length`` tokens
        assert len(ids) > length
        prompts.append(ids[:length])
    return prompts


def entry_bytes(hf_config) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return hf_config.num_hidden_layers * 2 * hf_config.num_key_value_heads * head_dim * TIER_BLOCK * FLOAT32_BYTES


def counters(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.get_metrics().items() if "offload" in k or "prefix_cache" in k}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seed_arm_kept_replay_stores_nothing_and_loads_what_warmup_stored(async_scheduling, embedded_source,
                                                                          embedded_tokenizer):  # fmt: skip
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"block_size": TIER_BLOCK, "cpu_bytes_to_use": 1 << 28}}  # fmt: skip
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_bytes=1 << 26, kv_transfer_config=tier,
              async_scheduling=async_scheduling)  # fmt: skip
    prompts = seed_prompts(embedded_tokenizer)
    ends = [len(p) + NEW_TOKENS - 1 for p in prompts]
    assert any(end % TIER_BLOCK == 0 for end in ends), "a request whose last step fills a tier block"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    per_entry = entry_bytes(embedded_source.hf_config)

    start = counters(llm)
    warm = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    before = counters(llm)  # the seed's snapshot: right after the warm-up's responses
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()
    replay = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = counters(llm)

    assert [o.outputs[0].token_ids for o in replay] == [o.outputs[0].token_ids for o in warm]
    warm_stored = before.get(STORES, 0.0) - start.get(STORES, 0.0)
    assert warm_stored == sum(end // TIER_BLOCK for end in ends) * per_entry, "every full block, generated ones too"
    prompt_entries = sum((len(p) - 1) // TIER_BLOCK for p in prompts)  # the last prompt token is computed
    assert after.get(STORES, 0.0) - before.get(STORES, 0.0) == 0, "the kept replay stores nothing"
    assert after.get(LOADS, 0.0) - before.get(LOADS, 0.0) == prompt_entries * per_entry
    assert after.get(HITS, 0.0) - before.get(HITS, 0.0) == prompt_entries * TIER_BLOCK
