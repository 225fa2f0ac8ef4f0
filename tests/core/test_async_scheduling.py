"""Async scheduling: step k+1 is scheduled and launched before step k's samples are read
back, its input tokens taken from step k's samples on the device. Outputs must be those of
the synchronous engine (itself checked against transformers); the parity test against
transformers with async scheduling is in tests/entrypoints/test_llm_parity.py."""

from __future__ import annotations

import random

import pytest

from siesta import LLM, SamplingParams
from siesta.control import RequestRejected
from siesta.core.model_runner import LaunchedStep

MODEL = "random:tiny-llama"


def engine(async_scheduling: bool, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_bytes": 1 << 22, "max_model_len": 512} | kw
    return LLM(MODEL, async_scheduling=async_scheduling, **kw)


def prompts(n: int = 6, seed: int = 0, max_len: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 900) for _ in range(rng.randrange(5, max_len))] for _ in range(n)]


def run(llm: LLM, ps: list[list[int]], params: list[SamplingParams]):
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs]


def assert_same(got, expected) -> None:
    """Same tokens and finish reasons; logprobs the same up to float rounding (batches may be
    made up differently when the scheduler runs a step ahead, which changes reduction order)."""
    assert [(t, r) for t, r, _ in got] == [(t, r) for t, r, _ in expected]
    for (_, _, a), (_, _, b) in zip(got, expected):
        assert (a is None) == (b is None)
        for pa, pb in zip(a or [], b or []):
            assert list(pa) == list(pb)
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-5 and pa[t].rank == pb[t].rank for t in pa)


def mixed_params(ps: list[list[int]]) -> list[SamplingParams]:
    """Greedy and seeded sampling, lengths that end at once or late, logprobs, min_tokens."""
    out = []
    for i in range(len(ps)):
        out.append(SamplingParams(temperature=0 if i % 2 else 0.9, seed=None if i % 2 else 100 + i,
                                  max_tokens=[1, 2, 17, 40][i % 4], logprobs=2 if i % 3 == 0 else None,
                                  min_tokens=1 if i == 4 else 0))  # fmt: skip
    return out


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 32}, {"kv_cache_bytes": 1 << 16}],
                         ids=["default", "chunked", "preempting"])  # fmt: skip
def test_outputs_equal_the_synchronous_engine(kw):
    ps = prompts(8, max_len=60)  # at most 5 blocks each: 8 of them overflow a 1 << 16 cache (8 blocks)
    params = mixed_params(ps)
    sync_llm = engine(False, **kw)
    expected = run(sync_llm, ps, params)
    async_llm = engine(True, **kw)
    assert_same(run(async_llm, ps, params), expected)
    if "kv_cache_bytes" in kw:
        assert async_llm.get_metrics()["siesta_num_preemptions_total"] > 0


def test_a_stop_token_seen_a_step_late_ends_the_request_where_the_synchronous_one_does():
    ps = prompts(4, seed=3)
    free = run(engine(False), ps, [SamplingParams(temperature=0, max_tokens=12)] * 4)
    # Stop on each request's 5th greedy token: the async engine has already launched the
    # step after it, whose sample must be dropped.
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[4]]) for tokens, _, _ in free]
    expected = run(engine(False), ps, params)
    assert run(engine(True), ps, params) == expected
    assert all(reason == "stop" for _, reason, _ in expected)


def test_penalties_fall_back_to_reading_each_step_first():
    ps = prompts(4, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5)] * 4
    assert run(engine(True), ps, params) == run(engine(False), ps, params)


def test_multi_token_bad_words_fall_back_to_reading_each_step_first():
    """A two-token bad word is matched against the whole output, so a step may not run ahead of
    the last sample: the async engine must ban exactly what the synchronous one bans."""
    ps, sync = prompts(2, seed=6, max_len=40), engine(False)
    free = run(sync, ps, [SamplingParams(temperature=0, max_tokens=8)] * 2)
    words = [tokens[3:5] for tokens, _, _ in free]  # each greedy run would complete its word
    params = [SamplingParams(temperature=0, max_tokens=8, bad_words_token_ids=[word]) for word in words]
    expected = run(sync, ps, params)
    assert run(engine(True), ps, params) == expected
    for (tokens, _, _), word in zip(expected, words):
        assert all(tokens[i : i + 2] != word for i in range(len(tokens) - 1))


def test_the_next_step_is_launched_before_the_last_is_read_back():
    llm = engine(True)
    events: list[str] = []
    runner = llm.engine.runner
    launch, results = runner.launch, LaunchedStep.results

    def spy_launch(sched, prev=None, peers=None):
        events.append("launch")
        return launch(sched, prev, peers)

    def spy_results(self):
        events.append("read")
        return results(self)

    runner.launch = spy_launch
    LaunchedStep.results = spy_results
    try:
        run(llm, prompts(2), [SamplingParams(temperature=0, max_tokens=6)] * 2)
    finally:
        LaunchedStep.results = results
    # Decode steps alternate: launch k+1, then read k.
    assert "launch,launch,read" in ",".join(events)
    assert events.count("launch") == events.count("read")


def test_control_calls_read_back_the_step_in_flight_first():
    ps = prompts(3, seed=7)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = run(engine(False), ps, [params] * 3)
    llm = engine(True)
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in ps]
    for _ in range(5):
        llm.step()
    assert llm.engine._inflight is not None
    llm.pause(mode="keep", clear_connector_cache=True)
    assert llm.engine._inflight is None
    llm.resume()
    done = {}
    while llm.engine.has_work():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == [tokens for tokens, _, _ in expected]


def test_abort_of_a_request_in_flight_drops_its_late_sample():
    llm = engine(True)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    keep, drop = (llm.add_request({"prompt_token_ids": p}, params) for p in prompts(2, seed=9))
    for _ in range(4):
        llm.step()
    assert llm.engine._inflight is not None
    llm.abort([drop])
    finished = {}
    while llm.engine.has_work():
        for out in llm.step():
            assert out.request_id != drop, "nothing of an aborted request comes back"
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert len(finished[keep].token_ids) == 30
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def _count_adds_at_steps(llm: LLM, monkeypatch) -> list[int]:
    """How many requests had been added when each engine step began."""
    added: list[str] = []
    at_steps: list[int] = []
    add, step = llm.engine.add_requests, llm.engine.step
    monkeypatch.setattr(llm.engine, "add_requests", lambda reqs: (add(reqs), added.extend(r.request_id for r in reqs)))
    monkeypatch.setattr(llm.engine, "step", lambda: (at_steps.append(len(added)), step())[1])
    return at_steps


def test_a_batch_whose_first_prompt_fills_a_step_starts_before_the_rest_is_added(monkeypatch):
    ps = prompts(6, seed=3, max_len=60)
    ps[0] = ps[0] + [7] * 40  # past the 32-token budget alone
    params = mixed_params(ps)
    llm = engine(True, max_num_batched_tokens=32)
    at_steps = _count_adds_at_steps(llm, monkeypatch)
    got = run(llm, ps, params)
    assert at_steps[0] == 1 and at_steps[1] == len(ps)  # one step on the first prompt, then the rest
    assert_same(got, run(engine(False, max_num_batched_tokens=32), ps, params))


def test_a_batch_that_fills_no_step_is_all_added_first(monkeypatch):
    ps = prompts(6, seed=4, max_len=20)  # under the budget together
    for llm in (engine(True), engine(False, max_num_batched_tokens=32)):  # short; or no device running ahead
        at_steps = _count_adds_at_steps(llm, monkeypatch)
        run(llm, ps, [SamplingParams(temperature=0, max_tokens=4)] * len(ps))
        assert at_steps[0] == len(ps)


def test_a_bad_prompt_after_the_engine_started_on_the_batch_leaves_nothing_behind(monkeypatch):
    ps = prompts(3, seed=5, max_len=60)
    ps[0] = ps[0] + [7] * 40
    llm = engine(True, max_num_batched_tokens=32)
    at_steps = _count_adds_at_steps(llm, monkeypatch)
    bad = [{"prompt_token_ids": p} for p in ps] + [{"prompt_token_ids": [5, 10**9]}]
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        llm.generate(bad, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert at_steps[0] == 1  # the engine had started on the first prompt
    while llm.engine.has_work():
        llm.engine.step()
    assert not llm.engine.has_unfinished_requests() and not llm.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
    greedy = [SamplingParams(temperature=0, max_tokens=4)] * len(ps)
    assert_same(run(llm, ps, greedy), run(engine(False, max_num_batched_tokens=32), ps, greedy))


def test_add_requests_queues_a_batch_for_step_and_starts_it_as_generate_does(monkeypatch):
    ps = prompts(4, seed=6, max_len=60)
    ps[0] = ps[0] + [7] * 40
    greedy = SamplingParams(temperature=0, max_tokens=4)
    llm = engine(True, max_num_batched_tokens=32)
    at_steps = _count_adds_at_steps(llm, monkeypatch)
    ids = llm.add_requests([{"prompt_token_ids": p} for p in ps], greedy)
    assert at_steps == [1]
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in llm.step() if o.finished)
    expected = run(engine(False, max_num_batched_tokens=32), ps, [greedy] * len(ps))
    assert [done[i] for i in ids] == [tokens for tokens, _, _ in expected]
