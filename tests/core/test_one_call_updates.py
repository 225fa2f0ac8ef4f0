"""One-call weight updates and the version rename on a real (tiny) engine: which cached KV a
version keeps reachable, against an engine built on the pushed weights."""

from __future__ import annotations

import pytest

from siesta import LLM, SamplingParams
from siesta.control import EngineStateError

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(10, 74))  # four full blocks of 16
NEW_WEIGHTS = "random:tiny-llama@7"


def make(model: str = "random:tiny-llama") -> LLM:
    return LLM(model, dtype="float32", kv_cache_bytes=1 << 23, max_model_len=256)


def run(llm: LLM):
    return llm.generate([{"prompt_token_ids": PROMPT}], PARAMS, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def pushed_tokens() -> list[int]:
    return run(make(NEW_WEIGHTS)).outputs[0].token_ids


def test_a_rename_keeps_valid_kv_reachable_and_new_weights_never_reuse_it(pushed_tokens):
    llm = make()
    engine = llm.engine
    first = run(llm)
    assert run(llm).num_cached_tokens > 0  # the prompt's blocks are cached under version "0"

    assert engine.update_weight_version("step-1", abort_all_requests=False) == "step-1"
    renamed = run(llm)
    assert renamed.weight_version == "step-1"
    assert renamed.num_cached_tokens > 0  # same weights: their KV is still valid, and found
    assert renamed.outputs[0].token_ids == first.outputs[0].token_ids

    # New weights named "0", the key the cache still uses: nothing cached under it may be served,
    # even when the caller does not ask to flush the cache.
    result = engine.update_weights_from_disk(NEW_WEIGHTS, weight_version="0", flush_cache=False)
    assert (result.weight_version, result.missing_tensors) == ("0", 0)
    after = run(llm)
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == pushed_tokens
    assert run(llm).num_cached_tokens > 0  # what the new weights computed is cached again


def test_every_one_call_update_drops_kv_even_under_the_current_version(pushed_tokens):
    llm = make()
    engine = llm.engine
    run(llm)
    # slime sends every bucket of one update under one version: the second must not keep what
    # was computed between the two.
    assert engine.update_weights_from_disk(NEW_WEIGHTS, weight_version="5").weight_version == "5"
    run(llm)
    assert run(llm).num_cached_tokens > 0
    engine.update_weights_from_disk(NEW_WEIGHTS, weight_version="5", flush_cache=False)
    again = run(llm)
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == pushed_tokens
    assert engine.update_weights_from_disk(NEW_WEIGHTS).weight_version == "6"  # none named: the next


def test_abort_all_requests_ends_requests_in_flight_and_kept_ones_are_counted():
    llm = make()
    engine = llm.engine
    rid = llm.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=50, ignore_eos=True))
    llm.step()
    assert engine.update_weights_from_disk(NEW_WEIGHTS).kept_requests == 1
    assert engine.update_weights_from_disk(NEW_WEIGHTS, abort_all_requests=True).kept_requests == 0
    done = [o for o in llm.step() if o.request_id == rid]
    assert done and done[0].outputs[0].finish_reason == "abort"


def test_one_call_updates_do_not_cut_into_an_open_update():
    llm = make()
    llm.start_weight_update()
    with pytest.raises(EngineStateError, match="a weight update is open"):
        llm.engine.update_weights_from_disk(NEW_WEIGHTS)
    with pytest.raises(EngineStateError, match="a weight update is open"):
        llm.engine.update_weight_version("x")
    llm.finish_weight_update()
