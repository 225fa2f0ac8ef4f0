"""vLLM's ``/inference/v1/generate``: token ids and vLLM's sampling_params in, token ids and
logprobs out. Greedy, so the ids and logprobs are the offline ``LLM``'s."""

from __future__ import annotations

import json

import httpx
import pytest

from e2e.servers import single_thread

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"
MAX_TOKENS = 10
LOGPROB_TOL = 1e-4


def _offline(llm, **params):
    from siesta import SamplingParams

    with single_thread():
        return llm.generate([{"prompt_token_ids": PROMPT_IDS}], SamplingParams(**params), use_tqdm=False)[0]


def test_token_ids_and_logprobs_are_the_offline_engines(http, offline_llm):
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 2, "prompt_logprobs": 1}
    response = http.post("/inference/v1/generate", json={"token_ids": PROMPT_IDS, "sampling_params": params})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = _offline(offline_llm, **params)
    choice = body["choices"][0]
    assert choice["token_ids"] == expected.outputs[0].token_ids and choice["finish_reason"] == "length"
    for entry, token_id, offline in zip(choice["logprobs"]["content"], choice["token_ids"], expected.outputs[0].logprobs):
        assert abs(entry["logprob"] - offline[token_id].logprob) < LOGPROB_TOL and len(entry["top_logprobs"]) == 2
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(PROMPT_IDS)
    for scored, token_id, offline in zip(body["prompt_logprobs"][1:], PROMPT_IDS[1:], expected.prompt_logprobs[1:]):
        assert abs(scored[str(token_id)]["logprob"] - offline[token_id].logprob) < LOGPROB_TOL
    assert body["usage"]["prompt_tokens"] == len(PROMPT_IDS) and body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["weight_version"] == choice["weight_versions"][0]["weight_version"]
    assert "text" not in choice


def test_a_stream_of_deltas_adds_up_to_the_whole_answer(dev_server, http):
    body = {"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0}, "request_id": "t1"}
    whole = http.post("/inference/v1/generate", json=body).json()["choices"][0]["token_ids"]
    ids, finishes = [], []
    with httpx.stream("POST", f"{dev_server.url}/inference/v1/generate", json=body | {"stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                assert chunk["request_id"] == "t1"
                ids += chunk["choices"][0]["token_ids"]
                finishes.append(chunk["choices"][0]["finish_reason"])
    assert ids == whole and finishes.count("length") == 1 and finishes[-1] == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": [], "sampling_params": {}}, "prompt"),
        ({"token_ids": PROMPT_IDS, "sampling_params": {"temprature": 0.5}}, "sampling_params.temprature"),
        ({"token_ids": PROMPT_IDS, "sampling_params": {"best_of": 3}}, "sampling_params.best_of"),
        ({"token_ids": PROMPT_IDS, "sampling_params": {"top_p": 2.0}}, "sampling_params.top_p"),
        ({"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": True}}, "sampling_params.max_tokens"),
        ({"token_ids": PROMPT_IDS, "kv_transfer_params": {"x": 1}}, "kv_transfer_params"),
        ({"token_ids": PROMPT_IDS, "priority": 3}, "priority"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(http, body, param):
    response = http.post("/inference/v1/generate", json=body)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"]
