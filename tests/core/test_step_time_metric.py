"""Every engine step is timed into siesta_engine_step_seconds (what a control call may wait for)."""

import time

from siesta import LLM, SamplingParams

STEP = "siesta_engine_step_seconds"
STEPS = 3


def test_each_step_is_observed_once_and_within_its_wall_time():
    llm = LLM("random:tiny-llama", dtype="float32", kv_cache_bytes=1 << 22, max_model_len=256)
    llm.add_request({"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=STEPS + 1, ignore_eos=True))
    before = llm.get_metrics()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        llm.step()
    wall = time.perf_counter() - t0
    after = llm.get_metrics()
    assert after[f"{STEP}_count"] - before.get(f"{STEP}_count", 0) == STEPS
    assert 0 < after[f"{STEP}_sum"] - before.get(f"{STEP}_sum", 0) <= wall
