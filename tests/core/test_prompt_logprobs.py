"""Prompt logprobs (vLLM's ``prompt_logprobs``) against transformers on the same random weights.

Every position of a prompt that prefills in several chunks; ranks and top-n; a neighbour in
the batch unaffected; no prefix hits, though the blocks are cached for others; preemption,
scheduling a step ahead and a pause resumed from the KV tier score no position twice.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, hf_twin

from siesta import LLM, SamplingParams
from siesta.core.scheduler import Scheduler
from siesta.model.loader import resolve_model

MODEL = "random:tiny-llama"
VOCAB = 1024
BLOCK = 16
CHUNK = 48  # max_num_batched_tokens: a 150-token prompt prefills in four chunks
PROMPT_LENGTHS = (150, 95, 130, 111)
TOP_N = 5
# fp32 (siesta) against fp64 log_softmax of fp32 logits (transformers).
ATOL = 1e-4
BLOCK_BYTES = 8192  # tiny-llama, fp32: 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes


def engine(**kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_bytes": 1 << 22, "max_model_len": 512, "max_num_batched_tokens": CHUNK} | kw
    return LLM(MODEL, **kw)


@pytest.fixture(scope="module")
def hf():
    return hf_twin(resolve_model(MODEL))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(hf, prompts) -> list[torch.Tensor]:
    """log_softmax of transformers' logits: row i scores prompt token i + 1."""
    with torch.inference_mode():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1) for p in prompts]


def check(scored, prompt: list[int], ref: torch.Tensor, top_n: int) -> None:
    """vLLM's shape, and every value against the oracle: one entry per prompt token, None first;
    the prompt token first in each, with its logprob and rank; then the top_n by rank."""
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        row, token, entry = ref[i - 1], prompt[i], scored[i]
        assert next(iter(entry)) == token
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=ATOL)
        # Ranks count the tokens strictly above; near-ties may fall either way within the tolerance.
        above = int((row > row[token] + ATOL).sum()) + 1
        at_or_above = int((row > row[token] - ATOL).sum()) + 1
        assert above <= entry[token].rank <= at_or_above
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank <= top_n)
        assert [r for r, _, _ in top] == list(range(1, top_n + 1))
        assert len(entry) == top_n + (entry[token].rank > top_n)
        kth = row.topk(top_n).values.min().item() if top_n else 0.0
        for _, tid, lp in top:
            assert lp == pytest.approx(row[tid].item(), abs=ATOL) and lp >= kth - ATOL


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_chunked_prefill_scores_every_prompt_token_and_leaves_its_neighbour_alone(hf, prompts, reference):
    llm = engine()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    params = [greedy.replace(prompt_logprobs=TOP_N, logprobs=2), greedy, greedy.replace(prompt_logprobs=0)]
    scored, plain, bare = run(llm, [prompts[0], prompts[1], prompts[0]], params)
    check(scored.prompt_logprobs, prompts[0], reference[0], TOP_N)
    check(bare.prompt_logprobs, prompts[0], reference[0], 0)
    assert plain.prompt_logprobs is None
    eos = llm.engine.source.eos_token_ids
    for out, prompt in ((scored, prompts[0]), (plain, prompts[1]), (bare, prompts[0])):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8, eos)
    # The sampled tokens' logprobs came back in the same copy as the prompt's: the same as alone.
    alone = run(llm, prompts[:1], [greedy.replace(logprobs=2)])[0].outputs[0]
    for got, want in zip(scored.outputs[0].logprobs, alone.logprobs, strict=True):
        assert {t: lp.rank for t, lp in got.items()} == {t: lp.rank for t, lp in want.items()}
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=ATOL)


def test_no_prefix_hits_but_its_blocks_serve_the_next_request(prompts, reference):
    llm = engine()
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP_N)
    first = run(llm, prompts[:1], [params])[0]
    plain = run(llm, prompts[:1], [params.replace(prompt_logprobs=None)])[0]
    again = run(llm, prompts[:1], [params])[0]
    full_blocks = (len(prompts[0]) - 1) // BLOCK * BLOCK
    assert (first.num_cached_tokens, plain.num_cached_tokens, again.num_cached_tokens) == (0, full_blocks, 0)
    check(again.prompt_logprobs, prompts[0], reference[0], TOP_N)
    assert again.prompt_logprobs == first.prompt_logprobs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_requests_score_each_position_once(monkeypatch, prompts, reference, async_scheduling):
    # Room for about two of the four requests: the one admitted last is preempted, mid-prefill
    # too, and recomputes, taking prefix hits only over what it scored before.
    llm = engine(kv_cache_bytes=24 * BLOCK_BYTES, async_scheduling=async_scheduling)
    preempted_at: list[tuple[int, int]] = []  # (positions scored, prompt positions to score)
    preempt = Scheduler._preempt

    def recording(self, request, out):
        preempted_at.append((request.num_prompt_logprob_positions, request.num_prompt_tokens - 1))
        preempt(self, request, out)

    monkeypatch.setattr(Scheduler, "_preempt", recording)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=TOP_N)
    outs = run(llm, prompts, [params] * len(prompts))
    assert any(0 < done < total for done, total in preempted_at), preempted_at
    for out, prompt, ref in zip(outs, prompts, reference):
        check(out.prompt_logprobs, prompt, ref, TOP_N)
    plain = run(engine(), prompts, [params.replace(prompt_logprobs=None)] * len(prompts))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_a_pause_resumed_from_the_tier_scores_each_position_once(prompts, reference):
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"block_size": 2 * BLOCK, "cpu_bytes_to_use": 1 << 24}}  # fmt: skip
    # Step by step as the engine schedules without running ahead: with async scheduling (the
    # default on CUDA) a request's first token is read back a step later than counted here.
    llm = engine(kv_transfer_config=tier, async_scheduling=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=TOP_N)
    ids = [llm.add_request({"prompt_token_ids": p}, params) for p in prompts[:2]]
    first, second = (llm.engine.scheduler.requests[i] for i in ids)

    def pause_and_resume() -> None:  # preempts both; their KV stays in the tier
        llm.pause(mode="keep", clear_connector_cache=False)
        llm.resume()

    llm.step()
    assert 0 < first.num_prompt_logprob_positions < first.num_prompt_tokens - 1  # scored in part
    pause_and_resume()  # the first recomputes, from position 0, taking no tier hits
    for _ in range(4):
        llm.step()
    assert not first.prompt_logprobs_pending and first.num_output_tokens > 0 and second.prompt_logprobs_pending
    hits = llm.get_metrics()["siesta_external_prefix_cache_hits_total"]
    pause_and_resume()  # the first loads its KV from the tier, the second recomputes its prompt
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step() if o.finished)
    assert llm.get_metrics()["siesta_external_prefix_cache_hits_total"] - hits == 4 * 2 * BLOCK  # the first's tier blocks
    for rid, prompt, ref in zip(ids, prompts, reference):
        check(outs[rid].prompt_logprobs, prompt, ref, TOP_N)
        assert len(outs[rid].outputs[0].token_ids) == params.max_tokens
