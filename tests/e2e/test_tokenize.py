"""/tokenize and /detokenize in vLLM's shapes, against the tokenizer itself."""

from __future__ import annotations

import httpx
import pytest

from siesta.tokenizer import chat_to_ids

TEXT = "The sea is wide, and deep, and blue."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_a_prompt_tokenizes_as_the_tokenizer_does(dev_server, embedded_tokenizer):
    r = post(dev_server, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    ids = embedded_tokenizer.encode(TEXT, add_special_tokens=True)
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] > 0
    assert body["token_strs"] == embedded_tokenizer.convert_ids_to_tokens(ids)
    plain = post(dev_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == embedded_tokenizer.encode(TEXT, add_special_tokens=False) and plain["token_strs"] is None


def test_messages_tokenize_through_the_chat_template(dev_server, embedded_tokenizer):
    for add in (True, False):
        body = post(dev_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": add}).json()
        assert body["tokens"] == chat_to_ids(embedded_tokenizer, MESSAGES, add_generation_prompt=add)


def test_detokenize_inverts_tokenize(dev_server):
    ids = post(dev_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert post(dev_server, "/detokenize", {"tokens": ids}).json() == {"prompt": TEXT}


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/tokenize", {}, "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "exactly one of prompt and messages"),
        ("/tokenize", {"prompt": "x", "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "does not exist"),
        ("/tokenize", {"prompt": "sea " * 1_000_000}, "characters, so at least"),  # refused untokenized
        ("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": [True]}, "not the boolean true"),
    ],
)
def test_bad_bodies_are_refused_by_name(dev_server, path, body, needle):
    r = post(dev_server, path, body)
    assert 400 <= r.status_code < 500 and needle in r.json()["error"]["message"], r.text
