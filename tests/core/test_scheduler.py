"""Scheduler against a fake model: budgets, chunking, preemption, stop conditions."""

import pytest

from siesta.config import SchedulerConfig
from siesta.core.sampler import SampleResult
from siesta.core.scheduler import Scheduler
from siesta.kv.hashing import ExtraKeys
from siesta.kv.kv_manager import KVManager
from siesta.metrics import EngineStats
from siesta.request import Request, RequestStatus
from siesta.sampling import SamplingParams

BS = 4
EOS = 2


def make(rid, n_prompt, shared_prefix=False, **params):
    # Distinct prompts unless asked: a shared prefix would be served from the prefix cache.
    base = 10 if shared_prefix else 1000 * (1 + sum(map(ord, rid)))
    r = Request(rid, list(range(base, base + n_prompt)), SamplingParams(**params), frozenset({EOS}))
    r.hash_extra = ExtraKeys("m", "0").encode()
    return r


def scheduler(num_blocks=64, budget=32, max_seqs=8, chunked=True, max_len=128):
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked)
    cfg.resolve(max_len)
    return Scheduler(cfg, KVManager(num_blocks, BS, True), max_len, EngineStats())


def step(s, token=7):
    out = s.schedule()
    samples = {i.request.request_id: SampleResult(token, None, None, []) for i in out.scheduled if i.sample}
    return out, s.update(out, samples, "0")


def test_budget_and_chunked_prefill():
    s = scheduler(budget=16)
    s.add_request(make("a", 20, max_tokens=3))
    s.add_request(make("b", 6, max_tokens=3))
    out, _ = step(s)
    assert [(i.request.request_id, i.num_new_tokens, i.sample) for i in out.scheduled] == [("a", 16, False)]
    out, _ = step(s)
    # a finishes its prompt (4 tokens) and b's prompt fits in the rest of the budget.
    assert [(i.request.request_id, i.num_new_tokens, i.sample) for i in out.scheduled] == [("a", 4, True), ("b", 6, True)]
    out, _ = step(s)
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 1)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = scheduler(budget=24, chunked=False, max_len=24)
    s.add_request(make("a", 10, max_tokens=5))
    s.add_request(make("b", 20, max_tokens=5))
    out, _ = step(s)
    assert [i.request.request_id for i in out.scheduled] == ["a"]
    out, _ = step(s)
    # With a's prompt done the step has room for all of b's.
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 20)]


def test_max_num_seqs():
    s = scheduler(max_seqs=2)
    for r in "abc":
        s.add_request(make(r, 3, max_tokens=5))
    out, _ = step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_preemption_frees_the_newest_and_recomputes_it():
    # 6 blocks of 4: two requests of 8-token prompts take 2 blocks each, then grow.
    s = scheduler(num_blocks=5, budget=64)
    s.add_request(make("a", 8, max_tokens=20, ignore_eos=True))
    s.add_request(make("b", 8, max_tokens=20, ignore_eos=True))
    preempted = set()
    for _ in range(6):
        out, _ = step(s)
        preempted |= out.preempted_req_ids
    assert preempted == {"b"}
    b = s.requests["b"]
    assert b.num_preemptions >= 1
    # Block accounting stays exact: what requests hold plus what is free equals the pool.
    held = {bid for r in s.requests for bid in s.kv.block_ids(r)}
    assert len(held) + s.kv.pool.num_free_blocks == 5


def test_stops_eos_min_tokens_stop_ids_and_length():
    s = scheduler()
    s.add_request(make("eos", 3, max_tokens=10))
    _, outs = step(s, token=EOS)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason is None

    s.add_request(make("min", 3, max_tokens=10, min_tokens=2))
    _, outs = step(s, token=EOS)
    assert outs[0].finish_reason is None  # the sampler bans EOS here; the scheduler also refuses to stop
    _, outs = step(s, token=EOS)
    assert outs[0].finish_reason == "stop"

    s.add_request(make("ids", 3, max_tokens=10, stop_token_ids=[7]))
    _, outs = step(s, token=7)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 7

    s.add_request(make("ign", 3, max_tokens=2, ignore_eos=True))
    _, outs = step(s, token=EOS)
    _, outs = step(s, token=EOS)
    assert outs[0].finish_reason == "length"
    assert not s.has_unfinished() and s.kv.pool.num_free_blocks == 64


def test_max_model_len_ends_with_length():
    s = scheduler(max_len=8)
    s.add_request(make("a", 6, max_tokens=None))
    finish = None
    for _ in range(5):
        _, outs = step(s)
        if outs and outs[0].finish_reason:
            finish = outs[0].finish_reason
            break
    assert finish == "length" and s.kv.pool.num_free_blocks == 64


def test_abort_frees_blocks_and_reports_abort():
    s = scheduler()
    s.add_request(make("a", 9, max_tokens=10))
    step(s)
    assert s.kv.pool.num_free_blocks < 64
    s.abort_requests(["a"])
    assert s.kv.pool.num_free_blocks == 64
    assert s.requests == {} and s.running == []
    assert s.schedule().finished_req_ids == {"a"}


def test_prefix_hits_are_counted_in_tokens():
    s = scheduler()
    s.add_request(make("a", 9, shared_prefix=True, max_tokens=1))
    step(s)
    s.add_request(make("b", 9, shared_prefix=True, max_tokens=1))
    step(s)
    snap = s.stats.drain()
    counters = {name: v for name, _, v in snap.counters}
    assert counters["prefix_cache_queries"] == 18 and counters["prefix_cache_hits"] == 8


@pytest.mark.parametrize("chunked", [True, False])
def test_preempt_all_running_then_resume(chunked):
    s = scheduler(chunked=chunked, max_len=32)
    s.add_request(make("a", 9, max_tokens=4))
    step(s)
    assert s.preempt_all_running() == {"a"}
    assert s.requests["a"].status == RequestStatus.PREEMPTED and s.kv.pool.num_free_blocks == 64
    out, _ = step(s)
    # The prompt's full blocks come back from the prefix cache; the rest is recomputed.
    (item,) = out.scheduled
    assert item.start == 8 and item.num_new_tokens == 2 and item.sample
