"""vLLM's sampling fields over HTTP: logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens.

Greedy throughout, on the shared dev server; the token ids come back with return_token_ids.
"""

from __future__ import annotations

import pytest

PROMPT = "The capital of France is"
MAX_TOKENS = 6
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer):
    return embedded_tokenizer  # the dev server's model's: no offline engine needed


def complete(http, **fields) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True} | fields
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@pytest.fixture(scope="module")
def plain(http) -> dict:
    choice = complete(http)
    assert "Paris" in choice["text"]  # what bad_words below must keep out
    return choice


def test_logit_bias_forces_a_token(http, tokenizer):
    forced = tokenizer.encode(" London")[0]
    # 500 is clamped to 100 (vLLM's range), which still wins every step.
    choice = complete(http, logit_bias={str(forced): 500})
    assert choice["token_ids"] == [forced] * MAX_TOKENS


def test_allowed_token_ids_restrict_the_output(http, tokenizer):
    allowed = tokenizer.encode(" yes no")
    response = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                       "allowed_token_ids": allowed, "return_token_ids": True})  # fmt: skip
    assert response.status_code == 200, response.text
    assert set(response.json()["choices"][0]["token_ids"]) <= set(allowed)


def test_bad_words_keep_a_word_out(http, plain):
    choice = complete(http, bad_words=["Paris"])
    assert "Paris" not in choice["text"] and choice["token_ids"] != plain["token_ids"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, tokenizer, plain):
    ids = tokenizer.encode(PROMPT)
    choice = complete(http, prompt=[7] * 20 + ids, truncate_prompt_tokens=len(ids))
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == plain["token_ids"]


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        ("/v1/completions", "logit_bias", {"not-an-id": 1.0}),
        ("/v1/completions", "logit_bias", {"1000000": 1.0}),
        ("/v1/chat/completions", "allowed_token_ids", []),
        ("/v1/completions", "allowed_token_ids", [0, 10**7]),
        ("/v1/completions", "bad_words", [""]),
        ("/v1/chat/completions", "truncate_prompt_tokens", 0),
        ("/v1/completions", "truncate_prompt_tokens", 10**6),  # beyond max_model_len
        ("/v1/completions", "truncate_prompt_tokens", True),  # JSON's true is not 1
    ],
)
def test_a_bad_value_is_a_400_naming_the_field(http, route, field, value):
    body = {"max_tokens": 2, field: value} | ({"prompt": PROMPT} if route == "/v1/completions" else {"messages": CHAT})
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error
