"""Routed experts over HTTP, in each framework's layout, from a real ``siesta serve`` of a tiny
Qwen3-MoE started with ``--enable-return-routed-experts``.

- SGLang's ``/generate``: ``return_routed_experts`` and ``routed_experts_start_len`` (request
  fields), ``meta_info.routed_experts`` the base64 of int32 ``[seqlen - 1 - start, layers, k]``
  and ``meta_info.routed_experts_start_len``, as slime decodes them;
- vLLM's routes (``/inference/v1/generate``, ``/v1/completions``, ``/v1/chat/completions``,
  streamed or not): every answer of such an engine carries ``choices[i].routed_experts``, the
  base64 of a ``.npy`` file, from ``sampling_params.routed_experts_prompt_start`` on.

The oracle is the same request run in-process by ``LLM`` on the same weights (an independent
path to the same routing: no HTTP, no encoding); that routing is checked against transformers'
router in tests/model/test_qwen3_moe.py. A dense model and an engine without the flag refuse the
request by name.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from e2e.servers import HTTP_TIMEOUT_S, start_server, stop_server

from siesta import LLM, SamplingParams

MODEL = "random:tiny-qwen3-moe"
COMMON = ("--dtype", "float32", "--kv-cache-bytes", str(16 << 20), "--max-model-len", "256")
PROMPT = [5, 9, 33, 71, 2, 18, 250, 400, 13, 77, 301, 45, 6, 88]
NEW = 6
LAYERS, TOP_K = 3, 2  # the tiny shape's


@pytest.fixture(scope="module")
def moe_server():
    server = start_server(MODEL, *COMMON, "--enable-return-routed-experts")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    """The in-process engine's routing of PROMPT and its greedy continuation: ``[rows, layers, k]``."""
    llm = LLM(MODEL, dtype="float32", kv_cache_bytes=16 << 20, max_model_len=256, enable_return_routed_experts=True)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, return_routed_experts=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    return out.routed_experts.array()


def _post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(url + path, json=body, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def _sglang_ids(meta: dict, rows: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(rows, LAYERS, TOP_K)


def _npy(payload: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)


def test_sglang_generate_returns_slimes_layout(moe_server, expected):
    rows = len(PROMPT) + NEW - 1
    assert expected.shape == (rows, LAYERS, TOP_K)
    assert expected.min() >= 0 and expected.max() < 8  # every row computed here: no unknown (-1) ids
    sampling = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": PROMPT, "sampling_params": sampling, "return_routed_experts": True}
    meta = _post(moe_server.url, "/generate", body)["meta_info"]
    assert meta["routed_experts_start_len"] == 0
    assert np.array_equal(_sglang_ids(meta, rows), expected)
    start = 5  # a later turn asks only for what it has not seen
    meta = _post(moe_server.url, "/generate", body | {"routed_experts_start_len": start})["meta_info"]
    assert meta["routed_experts_start_len"] == start
    assert np.array_equal(_sglang_ids(meta, rows - start), expected[start:])
    # Not asked for: nothing is sent.
    assert "routed_experts" not in _post(moe_server.url, "/generate", {"input_ids": PROMPT})["meta_info"]


def test_vllm_routes_return_the_routing_with_every_answer(moe_server, expected):
    sampling = {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    choice = _post(moe_server.url, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": sampling})[
        "choices"][0]  # fmt: skip
    assert np.array_equal(_npy(choice["routed_experts"]), expected)
    late = sampling | {"routed_experts_prompt_start": 4}
    choice = _post(moe_server.url, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": late})[
        "choices"][0]  # fmt: skip
    assert np.array_equal(_npy(choice["routed_experts"]), expected[4:])
    choice = _post(moe_server.url, "/v1/completions", {"prompt": PROMPT, **sampling})["choices"][0]
    assert np.array_equal(_npy(choice["routed_experts"]), expected)


def test_a_stream_carries_the_routing_on_its_last_chunk(moe_server, expected):
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": True}
    found = []
    with httpx.stream("POST", f"{moe_server.url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                for choice in json.loads(line[len("data:"):])["choices"]:
                    if "routed_experts" in choice:
                        found.append((choice["finish_reason"], _npy(choice["routed_experts"])))
    assert len(found) == 1 and found[0][0] == "length"
    assert np.array_equal(found[0][1], expected)


def test_a_start_past_the_prompt_is_refused_naming_the_field(moe_server):
    body = {"input_ids": PROMPT, "return_routed_experts": True, "routed_experts_start_len": len(PROMPT) + 1}
    response = httpx.post(f"{moe_server.url}/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 400, response.text
    assert "routed_experts" in response.text


def _refuses_routing_by_name(url: str, needle: str) -> None:
    body = {"input_ids": PROMPT, "return_routed_experts": True}
    response = httpx.post(f"{url}/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 400 and needle in response.text, response.text
    plain = httpx.post(f"{url}/inference/v1/generate", json={"token_ids": PROMPT}, timeout=HTTP_TIMEOUT_S)
    assert plain.status_code == 200 and "routed_experts" not in plain.json()["choices"][0]


def test_an_moe_engine_without_the_flag_refuses_by_name():
    server = start_server(MODEL, *COMMON)
    try:
        _refuses_routing_by_name(server.url, "--enable-return-routed-experts")
    finally:
        stop_server(server)


def test_a_dense_engine_refuses_by_name(dev_server):
    # The session's server of the embedded (dense) model: no server of its own to start.
    _refuses_routing_by_name(dev_server.url, "dense")
