"""Bad input is a 4xx in OpenAI's error shape, and the server serves on afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest

from e2e.servers import HTTP_TIMEOUT_S

ERROR_KEYS = {"message", "type", "param", "code"}
HUGE = 10**30  # beyond 64 bits: must not reach the wire


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=60, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["code"] == status
    return body["error"]


@pytest.fixture(autouse=True)
def still_healthy(dev_server):
    yield
    assert httpx.get(f"{dev_server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    ok = _post(dev_server, "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("raw", [b'{"prompt": "x",', b"not json", b"", b"[1, 2]", b'"a string"', b"\xff\xfe"])
def test_malformed_bodies_are_400(dev_server, raw):
    error = _error(_post(dev_server, "/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert error["type"] == "BadRequestError"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], [10**6]]}, "prompt"),
        ({"prompt": [1, -5]}, "prompt"),
    ],
)
def test_bad_completion_parameters_are_400_naming_the_field(dev_server, body, param):
    error = _error(_post(dev_server, "/v1/completions", json=body), 400)
    assert error["param"] == param, error
    assert param in error["message"]


def test_values_beyond_64_bits_are_400(dev_server):
    for field in ("max_tokens", "top_k", "seed", "stop_token_ids"):
        value = [HUGE] if field == "stop_token_ids" else HUGE
        _error(_post(dev_server, "/v1/completions", json={"prompt": "x", field: value}), 400)


def test_requests_the_engine_cannot_hold_are_400(dev_server):
    error = _error(_post(dev_server, "/v1/completions", json={"prompt": [5] * 2000}), 400)
    assert "max_model_len" in error["message"]
    _error(_post(dev_server, "/v1/completions", json={"prompt": ""}), 400)


def test_chat_errors(dev_server):
    error = _error(_post(dev_server, "/v1/chat/completions", json={"messages": [], "top_logprobs": 2}), 400)
    assert error["param"] == "top_logprobs"
    _error(_post(dev_server, "/v1/chat/completions", json={"messages": "hello"}), 400)
    parts = [{"role": "user", "content": [{"type": "image_url"}]}]
    _error(_post(dev_server, "/v1/chat/completions", json={"messages": parts}), 400)


def test_unknown_model_is_404_like_vllm(dev_server):
    error = _error(_post(dev_server, "/v1/completions", json={"prompt": "x", "model": "gpt-4"}), 404)
    assert error["type"] == "NotFoundError" and "gpt-4" in error["message"]
    client = openai.OpenAI(base_url=f"{dev_server.url}/v1", api_key="unused")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", temperature=-1)


def test_unknown_routes_and_methods_are_shaped_errors(dev_server):
    _error(httpx.get(f"{dev_server.url}/v1/nope", timeout=HTTP_TIMEOUT_S), 404)
    _error(httpx.get(f"{dev_server.url}/v1/completions", timeout=HTTP_TIMEOUT_S), 405)


def test_lone_surrogates_never_break_a_response(dev_server):
    raw = b'{"prompt": "x", "model": "\\ud800"}'
    _error(_post(dev_server, "/v1/completions", content=raw, headers={"content-type": "application/json"}), 404)
    raw = b'{"prompt": "bad \\udc80 text", "max_tokens": 1}'
    response = _post(dev_server, "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code in (200, 400), response.text
