"""pause / resume / sleep / wake_up / reset_prefix_cache on a real (tiny) engine."""

from __future__ import annotations

import pytest
import torch

from siesta import LLM, SamplingParams
from siesta.control import EngineStateError

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [list(range(10, 10 + n)) for n in (40, 75, 130)]
LOAD_BYTES = 'siesta_kv_offload_load_bytes_total{tier="host"}'


@pytest.fixture
def llm():
    return LLM("random:tiny-llama", dtype="float32", kv_cache_bytes=1 << 23, max_model_len=512)


@pytest.fixture(scope="module")
def reference():
    ref = LLM("random:tiny-llama", dtype="float32", kv_cache_bytes=1 << 23, max_model_len=512)
    return [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS,
                                                          use_tqdm=False)]  # fmt: skip


def start(llm: LLM, steps: int = 4) -> list[str]:
    ids = [llm.add_request({"prompt_token_ids": p}, PARAMS) for p in PROMPTS]
    for _ in range(steps):
        llm.step()
    return ids


def finish(llm: LLM) -> dict[str, object]:
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_abort_ends_in_flight_requests_with_partial_output(llm):
    ids = start(llm)
    llm.pause(mode="abort")
    assert llm.is_paused()
    done = finish(llm)
    assert all(done[i].outputs[0].finish_reason == "abort" for i in ids)
    assert all(0 < len(done[i].outputs[0].token_ids) < 20 for i in ids)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
    llm.resume()


def test_wait_returns_once_in_flight_requests_finish_and_holds_new_ones(llm, reference):
    ids = start(llm)
    llm.pause(mode="wait")
    assert llm.is_paused()
    outs = {o.request_id: o for o in llm.step()}
    assert [outs[i].outputs[0].token_ids for i in ids] == reference
    late = llm.add_request({"prompt_token_ids": PROMPTS[0]}, PARAMS)
    for _ in range(3):
        assert llm.step() == []  # held while paused
    llm.resume()
    assert finish(llm)[late].outputs[0].token_ids == reference[0]


@pytest.mark.parametrize("clear_cache", [False, True])
def test_keep_freezes_and_resumes_exactly(llm, reference, clear_cache):
    ids = start(llm)
    llm.pause(mode="keep", clear_cache=clear_cache)
    for _ in range(3):
        assert llm.step() == []
    if clear_cache:  # the frozen requests were preempted: they recompute on resume
        assert llm.engine.scheduler.num_running == 0
    llm.resume()
    done = finish(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == reference


@pytest.mark.parametrize("level", [0, 1, 2])
def test_sleep_levels_release_memory_and_resume_exactly(llm, reference, level):
    ids = start(llm)
    kv_bytes = llm.engine.memory.kv_bytes
    kv = llm.engine.runner.kv_cache.tensor
    assert torch.count_nonzero(kv) > 0  # the requests in flight wrote KV
    llm.sleep(level=level, mode="keep")
    assert llm.is_sleeping() and llm.is_paused()
    weight_storage = llm.engine.runner.model.model.embed_tokens.weight.untyped_storage()
    # The CPU cache's pages are dropped (they read as zeros again); the weights' storage goes.
    assert (torch.count_nonzero(kv) == 0) == (level >= 1)
    assert (weight_storage.nbytes() == 0) == (level >= 1)
    released = llm.get_metrics()["siesta_device_bytes_released"]
    assert released == (0 if level == 0 else kv_bytes + llm.engine.memory.weight_bytes)
    with pytest.raises(EngineStateError, match="asleep"):
        llm.resume()
    llm.wake_up(["kv_cache"])
    assert llm.is_sleeping() == (level >= 1)  # staged: the weights are still away (level 0 released nothing)
    llm.wake_up(["weights"])  # level 2 had no backup: reloaded from the model source
    assert not llm.is_sleeping() and not llm.is_paused()
    done = finish(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == reference


def test_sleep_in_wait_mode_releases_after_the_drain(llm, reference):
    ids = start(llm)
    llm.sleep(level=1, mode="wait")
    assert torch.count_nonzero(llm.engine.runner.kv_cache.tensor) == 0
    outs = {o.request_id: o for o in llm.step()}
    assert [outs[i].outputs[0].token_ids for i in ids] == reference
    llm.wake_up()
    assert llm.generate({"prompt_token_ids": PROMPTS[1]}, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == reference[1]


def test_misuse_is_refused_clearly(llm):
    with pytest.raises(ValueError, match="pause mode"):
        llm.pause(mode="later")
    with pytest.raises(ValueError, match="sleep level"):
        llm.sleep(level=3)
    llm.pause(mode="keep")
    with pytest.raises(EngineStateError, match="paused or asleep"):
        llm.generate("x", PARAMS, use_tqdm=False)
    llm.resume()
    llm.sleep(level=1)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        llm.wake_up(["everything"])
    with pytest.raises(EngineStateError, match="wake_up"):
        llm.update_weights([])
    llm.wake_up()


def test_a_second_pause_never_fails_and_only_moves_to_a_stronger_mode(llm, reference):
    """SGLang's pairs (in_place < retract < abort; the engine's keep < keep with its cache
    dropped < abort): a weaker or equal pause is a no-op, a stronger one does what it adds."""
    ids = start(llm)
    llm.pause(mode="keep", clear_cache=False)  # SGLang's in_place
    kept_blocks = llm.engine.kv.pool.num_free_blocks
    llm.pause(mode="wait", clear_cache=False)  # weaker: nothing restarts, nothing ends
    assert llm.is_paused() and not llm.step()
    assert llm.engine.kv.pool.num_free_blocks == kept_blocks
    preemptions = llm.get_metrics()["siesta_num_preemptions_total"]
    llm.pause(mode="keep", clear_cache=True)  # retract: the frozen requests' KV goes
    assert llm.get_metrics()["siesta_num_preemptions_total"] == preemptions + len(ids)
    llm.resume()
    done = finish(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == reference  # recomputed, same tokens
    ids = start(llm)
    llm.pause(mode="keep", clear_cache=False)
    llm.pause(mode="abort")  # stronger: ends what keep froze, with its partial output
    done = finish(llm)
    assert all(done[i].outputs[0].finish_reason == "abort" for i in ids)
    llm.pause(mode="keep")  # after abort: weaker, a no-op
    assert llm.is_paused()
    llm.resume()
    assert not llm.is_paused()


def test_a_pause_while_draining_for_wait_can_freeze_or_end_at_once(llm):
    ids = start(llm, steps=1)
    llm.engine.pause("wait")  # the engine's call: the offline LLM's would step through the drain
    assert not llm.is_paused()
    llm.engine.pause("abort")  # the drain ends now: every request aborted
    assert llm.is_paused()
    done = finish(llm)
    assert all(done[i].outputs[0].finish_reason == "abort" for i in ids)
    llm.resume()


def test_reset_prefix_cache_with_running_requests(llm, reference):
    ids = start(llm)
    before = llm.get_metrics()["siesta_num_preemptions_total"]
    assert llm.reset_prefix_cache(reset_running_requests=True)
    assert llm.get_metrics()["siesta_num_preemptions_total"] == before + len(ids)
    done = finish(llm)
    assert [done[i].outputs[0].token_ids for i in ids] == reference
    c0 = llm.get_metrics()["siesta_prefix_cache_hits_total"]
    llm.reset_prefix_cache()
    llm.generate({"prompt_token_ids": PROMPTS[2]}, PARAMS, use_tqdm=False)
    assert llm.get_metrics()["siesta_prefix_cache_hits_total"] == c0


@pytest.mark.parametrize("keep_tier", [False, True])
def test_a_woken_cache_of_nan_bits_is_zeroed_block_by_block_as_steps_use_it(reference, keep_tier):
    # A wake maps fresh memory, unzeroed: poisoned here with NaN, as fresh pages may read.
    # Blocks a step uses are zeroed first, blocks a tier load writes are left to it, and the
    # outputs are what a never-slept engine gives.
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22}}  # fmt: skip
    llm = LLM("random:tiny-llama", dtype="float32", kv_cache_bytes=1 << 23, max_model_len=512, kv_transfer_config=tier)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    llm.generate(requests, PARAMS, use_tqdm=False)
    llm.sleep(level=1, clear_connector_cache=not keep_tier)
    llm.wake_up()
    kv = llm.engine.runner.kv_cache
    kv.tensor.fill_(float("nan"))
    loaded_before = llm.get_metrics().get(LOAD_BYTES, 0.0)
    outs = llm.generate(requests, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    loaded = llm.get_metrics().get(LOAD_BYTES, 0.0) - loaded_before
    assert (loaded > 0) == keep_tier
    assert kv.unset is not None and 0 < kv.unset.sum() < kv.num_blocks, "only the blocks used were zeroed"
    used = torch.from_numpy(~kv.unset)
    assert torch.isfinite(kv.tensor[used]).all(), "no used block keeps a NaN in an unwritten slot"
    assert torch.isnan(kv.tensor[~used]).all()


def test_a_dropped_engine_is_freed_at_once_without_the_cycle_collector():
    # The core's parts hold no reference back to it: its KV pool and weights go with the last
    # reference, not at some later collection (a trainer that drops an LLM wants the memory now).
    import gc
    import weakref

    llm = LLM("random:tiny-llama", dtype="float32", kv_cache_bytes=1 << 23, max_model_len=512)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False)
    llm.sleep(level=1)
    llm.wake_up()
    engine, kv = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv_cache)
    gc.collect()  # what construction and the calls left behind
    gc.disable()
    try:
        del llm
        assert engine() is None and kv() is None
    finally:
        gc.enable()
