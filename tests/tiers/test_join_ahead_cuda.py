"""Loads joined ahead of their landing, on CUDA: the step waits for the copies on the device.

The load stream is held back by a sleep kernel before each copy, so every join ahead happens
while the blocks are still on their way: a step that did not wait for the landing would read
stale blocks, and the greedy tokens would differ from the uninterrupted run's.
"""

from __future__ import annotations

import random

import pytest
import torch

from siesta import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events and streams: a GPU test")

TIER_BLOCK = 32
SLEEP_CYCLES = 20_000_000  # ~10 ms on the load stream before each copy
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_requests_joined_before_their_loads_land_compute_on_the_loaded_blocks(monkeypatch) -> None:
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"block_size": TIER_BLOCK, "cpu_bytes_to_use": 1 << 28}}  # fmt: skip
    llm = LLM("random:tiny-llama", dtype="bfloat16", kv_cache_bytes=1 << 26, max_model_len=2048,
              kv_transfer_config=tier, async_scheduling=True)  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 900) for _ in range(TIER_BLOCK * (20 + i) + 8)] for i in range(6)]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    ref = [o.outputs[0].token_ids for o in llm.generate(inputs, GREEDY, use_tqdm=False)]
    llm.sleep(level=1, clear_connector_cache=False)
    llm.wake_up()

    copier = llm.engine.connector.copier
    load = copier.load

    def late_load(pieces, kv, after=None):
        with torch.cuda.stream(copier._load_stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        return load(pieces, kv, after=after)

    monkeypatch.setattr(copier, "load", late_load)
    monkeypatch.setattr(llm.engine, "_join_within_s", lambda: 10.0)
    joined: list[str] = []
    join_ahead = llm.engine.connector.join_ahead
    monkeypatch.setattr(llm.engine.connector, "join_ahead", lambda s: joined.extend(ids := join_ahead(s)) or ids)
    out = [o.outputs[0].token_ids for o in llm.generate(inputs, GREEDY, use_tqdm=False)]
    assert joined, "no request joined ahead of its landing"
    assert out == ref
    assert not llm.engine.scheduler.landing
