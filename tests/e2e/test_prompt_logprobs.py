"""vLLM's ``prompt_logprobs`` and OpenAI's ``echo`` over HTTP, against the offline engine.

The offline ``LLM`` (itself checked against transformers in tests/core/test_prompt_logprobs.py)
is the oracle for every value; each token's text is the tokenizer's decoding of its id.
"""

from __future__ import annotations

import json

import pytest

from e2e.servers import single_thread

PROMPT = "The quick brown fox jumps over the lazy dog because"
CHAT = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 4
TOP_N = 3
ATOL = 1e-4


def _offline(llm, prompt, chat: bool = False, **params):
    from siesta import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS).replace(**params)
    with single_thread():
        outs = llm.chat(prompt, params, use_tqdm=False) if chat else llm.generate([prompt], params, use_tqdm=False)
    return outs[0]


@pytest.fixture(scope="module")
def want(offline_llm):
    """The offline result of PROMPT with prompt logprobs and logprobs: the oracle of most tests."""
    return _offline(offline_llm, PROMPT, prompt_logprobs=TOP_N, logprobs=TOP_N)


def _post(http, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: {")]
    return [json.loads(line)["choices"][0] for line in lines]


def check_prompt_logprobs(got: list, want: list, tokenizer, as_ids: bool = False) -> None:
    """vLLM's JSON: null, then {token id: {logprob, rank, decoded_token}} with the offline values."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for got_entry, want_entry in zip(got[1:], want[1:]):
        assert list(got_entry) == [str(t) for t in want_entry]  # the prompt token first, then by rank
        for token_id, lp in want_entry.items():
            entry = got_entry[str(token_id)]
            assert entry["logprob"] == pytest.approx(lp.logprob, abs=ATOL) and entry["rank"] == lp.rank
            assert entry["decoded_token"] == (f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id]))


def test_completion_prompt_logprobs_are_the_offline_engines(http, want, tokenizer):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "prompt_logprobs": TOP_N}
    choice = _post(http, "/v1/completions", body)["choices"][0]
    check_prompt_logprobs(choice["prompt_logprobs"], want.prompt_logprobs, tokenizer)
    assert choice["text"] == want.outputs[0].text and choice["logprobs"] is None
    as_ids = _post(http, "/v1/completions", body | {"return_tokens_as_token_ids": True})["choices"][0]
    check_prompt_logprobs(as_ids["prompt_logprobs"], want.prompt_logprobs, tokenizer, as_ids=True)
    assert "prompt_logprobs" not in _post(http, "/v1/completions", body | {"prompt_logprobs": None})["choices"][0]


def check_echoed_logprobs(logprobs: dict, want, tokenizer, text: str, num_prompt: int) -> None:
    """The prompt's tokens first (the first with null logprob and alternatives), then the sampled
    ones; every token is its id decoded, and the tokens spell the text at their offsets."""
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    entries = want.prompt_logprobs + want.outputs[0].logprobs
    ids, entries = ids[: len(logprobs["tokens"])], entries[: len(logprobs["tokens"])]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert "".join(logprobs["tokens"]) == text
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(ids))]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i, (token_id, entry) in enumerate(zip(ids[1:], entries[1:]), start=1):
        assert logprobs["token_logprobs"][i] == pytest.approx(entry[token_id].logprob, abs=ATOL)
        top = {tokenizer.decode([t]): lp.logprob for t, lp in entry.items()}
        assert logprobs["top_logprobs"][i] == pytest.approx(top, abs=ATOL)
    assert len(ids) >= num_prompt


def test_echo_puts_the_prompt_and_its_logprobs_first(http, want, tokenizer):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "echo": True}
    plain = _post(http, "/v1/completions", body)["choices"][0]
    assert plain["text"] == PROMPT + want.outputs[0].text and plain["logprobs"] is None
    assert "prompt_logprobs" not in plain  # echo alone scores nothing
    choice = _post(http, "/v1/completions", body | {"logprobs": TOP_N})["choices"][0]
    assert choice["text"] == PROMPT + want.outputs[0].text
    num_prompt = len(want.prompt_token_ids)
    assert len(choice["logprobs"]["tokens"]) == num_prompt + MAX_TOKENS
    check_echoed_logprobs(choice["logprobs"], want, tokenizer, choice["text"], num_prompt)
    check_prompt_logprobs(choice["prompt_logprobs"], want.prompt_logprobs, tokenizer)  # vLLM shows them too


def test_echo_with_max_tokens_0_is_the_prompt_alone(http, offline_llm, tokenizer):
    # lm-evaluation-harness scores a continuation this way.
    want = _offline(offline_llm, PROMPT, prompt_logprobs=1, logprobs=1)
    body = {"prompt": PROMPT, "max_tokens": 0, "temperature": 0.0, "echo": True, "logprobs": 1}
    choice = _post(http, "/v1/completions", body)["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    num_prompt = len(want.prompt_token_ids)
    assert len(choice["logprobs"]["tokens"]) == num_prompt
    check_echoed_logprobs(choice["logprobs"], want, tokenizer, PROMPT, num_prompt)
    refused = http.post("/v1/completions", json=body | {"echo": False})
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]


def test_streamed_echo_sends_the_prompt_first_and_adds_up(http, want, tokenizer):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "echo": True, "logprobs": TOP_N}
    whole = _post(http, "/v1/completions", body)["choices"][0]
    chunks = _stream(http, body)
    assert chunks[0]["text"].startswith(PROMPT)
    assert len(chunks[0]["logprobs"]["tokens"]) >= len(want.prompt_token_ids)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key]
    no_logprobs = _stream(http, body | {"logprobs": None})
    assert no_logprobs[0]["text"].startswith(PROMPT) and "".join(c["text"] for c in no_logprobs) == whole["text"]


def test_chat_puts_prompt_logprobs_on_the_response(http, offline_llm, tokenizer):
    want = _offline(offline_llm, CHAT, chat=True, prompt_logprobs=TOP_N)
    body = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "prompt_logprobs": TOP_N}
    out = _post(http, "/v1/chat/completions", body)
    check_prompt_logprobs(out["prompt_logprobs"], want.prompt_logprobs, tokenizer)
    assert out["choices"][0]["message"]["content"] == want.outputs[0].text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}),
        ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}),
    ],
)
def test_prompt_logprobs_a_stream_cannot_carry_or_out_of_range_are_refused(http, path, body):
    response = http.post(path, json=body | {"max_tokens": 2})
    assert response.status_code == 400 and "prompt_logprobs" in response.json()["error"]["message"]
