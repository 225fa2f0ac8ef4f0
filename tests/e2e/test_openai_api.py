"""The OpenAI routes through the official ``openai`` client: text matches the offline engine."""

from __future__ import annotations

import httpx
import openai
import pytest

from e2e.servers import HTTP_TIMEOUT_S, offline_chat, offline_greedy

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def oai(dev_server):
    client = openai.OpenAI(base_url=f"{dev_server.url}/v1", api_key="unused")
    yield client
    client.close()


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_models_lists_the_served_model(oai, dev_server):
    models = oai.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    card = httpx.get(f"{dev_server.url}/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"][0]
    assert card["max_model_len"] == 1024


def test_completion_matches_offline_greedy(oai, model, offline_llm):
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert out.choices[0].text == offline_greedy(offline_llm, PROMPT, MAX_TOKENS)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.usage.total_tokens == out.usage.prompt_tokens + MAX_TOKENS


def test_streamed_completion_concatenates_to_the_same_text(oai, model, offline_llm):
    stream = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_greedy(offline_llm, PROMPT, MAX_TOKENS)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_matches_offline_chat(oai, model, offline_llm):
    want = offline_chat(offline_llm, CHAT, MAX_TOKENS)
    out = oai.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0.0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want
    stream = oai.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_token_id_prompts_and_prompt_lists(oai, model, offline_llm):
    ids = offline_llm.get_tokenizer().encode(PROMPT)
    want = offline_greedy(offline_llm, PROMPT, 4)
    for prompt in ([ids, ids], [PROMPT, PROMPT]):
        out = oai.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0.0)
        assert sorted(c.index for c in out.choices) == [0, 1]
        assert [c.text for c in out.choices] == [want, want]
        assert out.usage.prompt_tokens == 2 * len(ids)
    single = oai.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0.0)
    assert single.choices[0].text == want


def test_n_seed_and_sampling_extras(oai, model):
    extra = {"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 3, "ignore_eos": True}
    a = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, seed=7, temperature=1.0, extra_body=extra)
    b = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, seed=7, temperature=1.0, extra_body=extra)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert all(c.finish_reason == "length" for c in a.choices)
    assert a.usage.completion_tokens == 12


def test_completion_logprobs(oai, model):
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0.0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and token in top and len(top) >= 2
        assert logprob == max(top.values())  # greedy picks the most likely token


def test_chat_logprobs(oai, model):
    out = oai.chat.completions.create(
        model=model, messages=CHAT, max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)


def test_stop_strings_and_stop_reason(oai, model, offline_llm):
    full = offline_greedy(offline_llm, PROMPT, MAX_TOKENS)
    stop = full.strip().split()[1]  # a word the greedy text is known to contain
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop


def test_cached_prefix_is_reported(oai, model):
    prompt = "A long shared prefix for the cache. " * 8
    oai.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
    out = oai.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
    assert out.usage.prompt_tokens_details.cached_tokens > 0


def test_version_health_and_metrics(dev_server):
    assert httpx.get(f"{dev_server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    assert httpx.get(f"{dev_server.url}/version", timeout=HTTP_TIMEOUT_S).json()["version"]
    metrics = dev_server.metrics()
    for name in ("siesta_generation_tokens_total", "siesta_time_to_first_token_seconds_count",
                 "siesta_inter_token_latency_seconds_count", "siesta_e2e_request_latency_seconds_count"):  # fmt: skip
        assert metrics[name] > 0, name
