"""Routed experts of KV that a tier brings back: after a sleep that keeps the host tier, a prompt
whose blocks load from the tier reports the expert ids its KV was computed with (none read -1),
equal to the run that computed them. And the archive that keeps them is bounded by what the
tiers hold, and keyed like the tier, so another weight version finds nothing."""

from __future__ import annotations

import numpy as np

from siesta import LLM, SamplingParams
from siesta.config import KVTransferConfig
from siesta.core.routed_experts import tier_blocks

BLOCK = 16
PROMPT = [5 + (7 * i) % 900 for i in range(5 * BLOCK + 3)]  # five full blocks and a tail
TIER = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"block_size": BLOCK, "cpu_bytes_to_use": 64 << 20}}  # fmt: skip
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, return_routed_experts=True)


def _routing(llm: LLM) -> np.ndarray:
    out = llm.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)[0].outputs[0]
    return out.routed_experts.array()


def test_a_prompt_loaded_from_the_tier_after_a_sleep_keeps_its_routing() -> None:
    llm = LLM("random:tiny-qwen3-moe", dtype="float32", kv_cache_bytes=8 << 20, max_model_len=256,
              block_size=BLOCK, enable_return_routed_experts=True, kv_transfer_config=TIER)  # fmt: skip
    computed = _routing(llm)
    assert (computed >= 0).all()
    hits = llm.get_metrics().get("siesta_external_prefix_cache_hits_total", 0)
    llm.sleep(level=1, mode="keep", clear_connector_cache=False)
    llm.wake_up()
    loaded = _routing(llm)
    assert llm.get_metrics()["siesta_external_prefix_cache_hits_total"] - hits >= 5 * BLOCK  # the tier served them
    assert (loaded >= 0).all(), "rows of tier-loaded blocks have no routing"
    assert np.array_equal(loaded, computed)


def test_the_archive_is_bounded_by_the_tiers_and_misses_other_weights() -> None:
    assert tier_blocks(None, 1024) == 0
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [
        {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 4096}},
        {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 2048,
                                                                             "disk_bytes_to_use": 8192}}]})  # fmt: skip
    assert tier_blocks(multi, 1024) == (4096 + 2048 + 8192) // 1024
    llm = LLM("random:tiny-qwen3-moe", dtype="float32", kv_cache_bytes=8 << 20, max_model_len=256,
              block_size=BLOCK, enable_return_routed_experts=True, kv_transfer_config=TIER)  # fmt: skip
    store = llm.engine.runner.routed
    assert store.archive_blocks == tier_blocks(llm.config.kv_transfer, llm.engine.runner.kv_cache.block_bytes)
    _routing(llm)
    archived = set(store.archive)
    assert len(archived) == 5  # the prompt's five full blocks (the output's tokens fill no other)
    llm.update_weights(llm.engine.runner.model.state_dict())  # new weights: a new cache key
    llm.sleep(level=1, mode="keep", clear_connector_cache=False)
    llm.wake_up()
    assert (_routing(llm) >= 0).all()  # recomputed under the new key, not read from the old one
    assert len(set(store.archive) - archived) == 5
