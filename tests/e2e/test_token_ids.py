"""vLLM's ``return_token_ids``: the prompt's and the generated token ids beside the text.

Greedy, so the ids are the offline engine's; decoding them gives the text; a stream's
chunks concatenate to the non-streamed ids; without the field nothing new appears.
"""

from __future__ import annotations

import json

import httpx
import pytest

from e2e.servers import single_thread

PROMPT = "The capital of France is"
PROMPTS = ["The capital of France is", "One, two, three,"]
CHAT = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12
TOKEN_FIELDS = {"token_ids", "prompt_token_ids"}


def _offline(llm, prompt, max_tokens: int = MAX_TOKENS, chat: bool = False):
    from siesta import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    with single_thread():
        outs = llm.chat(prompt, params, use_tqdm=False) if chat else llm.generate([prompt], params, use_tqdm=False)
    return outs[0]


def _post(http, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(http, path: str, body: dict) -> list[dict]:
    import json

    chunks = []
    with http.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def _keys(obj) -> set[str]:
    """Every key anywhere in a JSON value."""
    if isinstance(obj, dict):
        return set(obj) | set().union(*(_keys(v) for v in obj.values()))
    if isinstance(obj, list):
        return set().union(*(_keys(v) for v in obj))
    return set()


def test_completion_ids_are_the_offline_engines(http, offline_llm, tokenizer):
    want = _offline(offline_llm, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
    choice = _post(http, "/v1/completions", body)["choices"][0]
    assert choice["prompt_token_ids"] == want.prompt_token_ids == tokenizer.encode(PROMPT)
    assert choice["token_ids"] == list(want.outputs[0].token_ids)
    assert len(choice["token_ids"]) == MAX_TOKENS
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"] == want.outputs[0].text


def test_completion_ids_per_prompt_and_per_sample(http, offline_llm):
    wants = [_offline(offline_llm, p, 6) for p in PROMPTS]
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}
    choices = sorted(_post(http, "/v1/completions", body)["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice in choices:
        want = wants[choice["index"] // 2]
        assert choice["prompt_token_ids"] == want.prompt_token_ids
        assert choice["token_ids"] == list(want.outputs[0].token_ids)
    # Token-id prompts come back as sent.
    ids = wants[0].prompt_token_ids
    choice = _post(http, "/v1/completions", body | {"prompt": ids, "n": 1})["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == list(wants[0].outputs[0].token_ids)


def test_streamed_completion_ids_concatenate_to_the_whole(http, tokenizer):
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True,
            "logprobs": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    whole = {c["index"]: c for c in _post(http, "/v1/completions", body)["choices"]}
    chunks = _stream(http, "/v1/completions", body)
    assert chunks[-1]["choices"] == [] and "usage" in chunks[-1]
    seen: dict[int, list[dict]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        seen.setdefault(choice["index"], []).append(choice)
    assert sorted(seen) == sorted(whole)
    for index, parts in seen.items():
        # The prompt's ids ride on the choice's first chunk only (null later, as vLLM sends them).
        assert parts[0]["prompt_token_ids"] == whole[index]["prompt_token_ids"]
        assert all(p["prompt_token_ids"] is None for p in parts[1:])
        ids = [t for p in parts for t in p["token_ids"]]
        assert ids == whole[index]["token_ids"]
        assert "".join(p["text"] for p in parts) == whole[index]["text"] == tokenizer.decode(ids)
        # Each chunk's ids are its delta's: its logprob tokens are those ids.
        for part in parts:
            assert len(part["token_ids"]) == len(part["logprobs"]["tokens"])


def test_chat_ids_are_the_offline_engines(http, offline_llm, tokenizer):
    want = _offline(offline_llm, CHAT, chat=True)
    body = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
    out = _post(http, "/v1/chat/completions", body)
    assert out["prompt_token_ids"] == want.prompt_token_ids
    choice = out["choices"][0]
    assert choice["token_ids"] == list(want.outputs[0].token_ids)
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]

    chunks = _stream(http, "/v1/chat/completions", body | {"n": 2})
    by_choice: dict[int, list[dict]] = {}
    for chunk in chunks:
        (entry,) = chunk["choices"]
        by_choice.setdefault(entry["index"], []).append(chunk)
    assert sorted(by_choice) == [0, 1]
    for parts in by_choice.values():
        assert parts[0]["prompt_token_ids"] == want.prompt_token_ids
        assert all("prompt_token_ids" not in p for p in parts[1:])
        ids = [t for p in parts for t in p["choices"][0]["token_ids"]]
        assert ids == choice["token_ids"]
        assert "".join(p["choices"][0]["delta"]["content"] for p in parts) == choice["message"]["content"]


def test_no_ids_unless_asked(http):
    for body, path in (
        ({"prompt": PROMPTS, "n": 2, "max_tokens": 4, "temperature": 0.0, "logprobs": 1}, "/v1/completions"),
        ({"messages": CHAT, "max_tokens": 4, "temperature": 0.0, "logprobs": True}, "/v1/chat/completions"),
    ):
        for flag in ({}, {"return_token_ids": False}):
            assert not _keys(_post(http, path, body | flag)) & TOKEN_FIELDS
            assert not _keys(_stream(http, path, body | flag)) & TOKEN_FIELDS


def test_logprob_tokens_as_token_ids_on_both_routes(dev_server):
    """vLLM's return_tokens_as_token_ids: each logprob token reads ``token_id:<id>``, the id
    being the sampled one (and the alternatives' their own)."""
    base = {"max_tokens": 6, "temperature": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    comp = httpx.post(f"{dev_server.url}/v1/completions", json=base | {"prompt": "The sea is", "logprobs": 2},
                      timeout=60).json()["choices"][0]  # fmt: skip
    assert comp["logprobs"]["tokens"] == [f"token_id:{t}" for t in comp["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) for top in comp["logprobs"]["top_logprobs"])
    chat = httpx.post(f"{dev_server.url}/v1/chat/completions", timeout=60,
                      json=base | {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                                   "top_logprobs": 2}).json()["choices"][0]  # fmt: skip
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_each_streamed_choice_finishes_in_exactly_one_chunk(dev_server, route):
    body = {"max_tokens": 8, "n": 4, "ignore_eos": True, "stream": True}
    body |= {"prompt": "The sea"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    finishing: dict[int, int] = {}
    with httpx.stream("POST", f"{dev_server.url}{route}", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    if choice["finish_reason"] is not None:
                        finishing[choice["index"]] = finishing.get(choice["index"], 0) + 1
    assert finishing == {0: 1, 1: 1, 2: 1, 3: 1}
