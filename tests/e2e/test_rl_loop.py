"""``examples/rl_loop.py`` against a real server: rollouts, GRPO steps and weight pushes.

Two short iterations and a final rollout. After every push the engine's logprobs of what it
samples are the trainer's under the weights it pushed; no request is served KV computed by
older weights; the samples paused across a keep sleep resume by loading KV from the tier.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from e2e.servers import single_thread, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import rl_loop

ITERATIONS = 2
LOGPROB_TOLERANCE = 1e-3  # fp32 on both sides, temperature 1, no top-p/top-k
CFG = rl_loop.LoopConfig(tasks=4, group_size=4, max_tokens=6, paused_samples=2, paused_max_tokens=48,
                         pause_after_tokens=12, seed=0)  # fmt: skip


@pytest.fixture(scope="module")
def loop():
    with ThreadPoolExecutor(1) as pool:
        model = pool.submit(rl_loop.load_trainer_model)  # loads while the server starts
        server = start_server(*rl_loop.server_flags())
        model = model.result()
    try:
        with single_thread():  # the server runs one thread too: two busy cores, no fighting
            records = rl_loop.run(ITERATIONS, url=server.url, cfg=CFG, model=model)
    except BaseException:
        print(server.log())
        raise
    finally:
        stop_server(server)
    return records


def test_every_round_samples_groups_and_scores_them(loop):
    assert [r["iteration"] for r in loop] == list(range(ITERATIONS + 1))
    for record in loop:
        assert len(record["rewards"]) == CFG.tasks * CFG.group_size
        assert set(record["rewards"]) <= {0.0, 1.0}
    # The task is neither always solved nor never: some group has something to learn from.
    groups = [r["rewards"][g : g + CFG.group_size] for r in loop[:-1] for g in range(0, CFG.tasks * CFG.group_size,
                                                                                      CFG.group_size)]  # fmt: skip
    assert any(len(set(g)) > 1 for g in groups)
    assert all(r["loss"] == r["loss"] for r in loop[:-1])  # finite, not NaN


def test_each_push_is_a_new_version_and_the_next_rollout_uses_it(loop):
    pushed = [r["pushed_version"] for r in loop[:-1]]
    assert len(set(pushed)) == ITERATIONS and loop[0]["weight_version"] not in pushed
    assert [r["weight_version"] for r in loop[1:]] == pushed
    assert all(r["engine_weight_version"] == r["weight_version"] for r in loop)


def test_engine_logprobs_are_the_trainers_under_the_pushed_weights(loop):
    # Round 0 samples under the weights both sides loaded; every later round under a push.
    for record in loop:
        assert record["logprob_max_abs_diff"] <= LOGPROB_TOLERANCE, record
    for record in loop[:-1]:
        assert record["paused"]["logprob_max_abs_diff"] <= LOGPROB_TOLERANCE, record["paused"]
        # Each step moved the logprobs far more than that: stale weights would not pass.
        assert record["step_logprob_change"] > 10 * LOGPROB_TOLERANCE, record


def test_no_kv_of_older_weights_is_served(loop):
    # The tier held KV of the old weights (the same prompts) across the level-2 sleep...
    assert all(r["tier_bytes_before_push"] > 0 for r in loop[:-1])
    for record in loop[1:]:
        # ...and none of it, nor any device block, served the first sample of a task after the push.
        assert record["first_sample_cached_tokens"] == 0, record
        assert record["tier_hits"] == 0, record
    # Under unchanged weights the same prompt does hit: the zeros above are not for want of a cache.
    assert all(r["same_version_cached_tokens"] >= rl_loop.BLOCK_SIZE for r in loop)


def test_paused_samples_resume_from_the_tier(loop):
    for record in loop[:-1]:
        paused = record["paused"]
        assert all(CFG.pause_after_tokens <= n < CFG.paused_max_tokens for n in paused["tokens_at_sleep"]), paused
        assert paused["tokens"] == [CFG.paused_max_tokens] * CFG.paused_samples
        assert paused["finish_reasons"] == ["length"] * CFG.paused_samples
        # Each one's prompt and its tokens so far, whole blocks of them, came back from the tier.
        assert paused["tier_hits"] >= CFG.paused_samples * rl_loop.BLOCK_SIZE, paused
