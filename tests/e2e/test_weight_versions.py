"""Every response names its weights: the version of its last tokens, and per choice the spans of
output tokens each version sampled (prime-rl's flow: pause keep, update, resume)."""

from __future__ import annotations

import json
import threading

import httpx

from e2e.servers import HTTP_TIMEOUT_S, wait_for
from siesta.model.loader import default_model_path

BODY = {"prompt": "Tell me a very long story about the sea.", "max_tokens": 48, "ignore_eos": True, "temperature": 0}


def test_a_request_across_a_weight_update_reports_both_versions(dev_server):
    with dev_server.client() as client:
        before = client.weight_version()
        assert httpx.get(f"{dev_server.url}/get_weight_version", timeout=HTTP_TIMEOUT_S).json() == {"weight_version": before}
        box = {}
        thread = threading.Thread(
            target=lambda: box.update(r=httpx.post(f"{dev_server.url}/v1/completions", json=BODY, timeout=120))
        )
        streamed = threading.Thread(target=lambda: box.update(chunks=_chunks(dev_server.url, BODY)))
        generated = dev_server.metrics()["siesta_generation_tokens_total"]
        thread.start()
        streamed.start()
        wait_for(lambda: dev_server.metrics()["siesta_generation_tokens_total"] >= generated + 8, what="some tokens")
        client.pause(mode="keep", clear_cache=False)
        after = client.update_weights(default_model_path())  # the same tensors: a new version all the same
        client.finish_weight_update()
        client.resume()
        thread.join(120)
        streamed.join(120)
    body = box["r"].json()
    spans = body["choices"][0]["weight_versions"]
    assert [s["weight_version"] for s in spans] == [before, after] and after != before
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 48
    assert body["weight_version"] == after
    assert httpx.get(f"{dev_server.url}/v1/models", timeout=HTTP_TIMEOUT_S).json()["data"][0]["weight_version"] == after
    # The stream's chunks name the weights of their own tokens; its finishing chunk, the spans.
    chunks = box["chunks"]
    versions = [c["weight_version"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert versions[0] == before and versions[-1] == after and sorted(set(versions)) == sorted({before, after})
    assert versions == sorted(versions, key=[before, after].index)  # old, then new: never back
    spans = chunks[-1]["choices"][0]["weight_versions"]
    assert [s["weight_version"] for s in spans] == [before, after] and spans[-1]["end"] == 48


def _chunks(url: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[len("data: ") :]))
    return out


def test_an_ordinary_response_has_one_span(dev_server):
    r = httpx.post(f"{dev_server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True})  # fmt: skip
    body = r.json()
    version = body["weight_version"]
    assert body["choices"][0]["weight_versions"] == [{"weight_version": version, "start": 0, "end": 4}]


def test_every_streamed_chunk_names_its_weights(dev_server):
    version = httpx.get(f"{dev_server.url}/get_weight_version", timeout=HTTP_TIMEOUT_S).json()["weight_version"]
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                       "ignore_eos": True},
              "/inference/v1/generate": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "ignore_eos": True}}}  # fmt: skip
    for path, body in bodies.items():
        chunks = []
        with httpx.stream("POST", dev_server.url + path, json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: ") :]))
        assert chunks and all(c["weight_version"] == version for c in chunks), path
        assert chunks[-1]["choices"][0]["weight_versions"] == [{"weight_version": version, "start": 0, "end": 4}], path


def test_an_aborted_answer_names_the_weights_of_its_tokens(dev_server):
    # slime stores meta_info.weight_version per sample: an abort used to answer "0" whatever
    # weights sampled its tokens. A rename gives the tokens a version no other test uses.
    url = dev_server.url
    version = "abort-check"
    original = httpx.get(f"{url}/get_weight_version", timeout=HTTP_TIMEOUT_S).json()["weight_version"]
    assert httpx.post(f"{url}/update_weight_version", json={"new_version": version}, timeout=HTTP_TIMEOUT_S).json()[
        "success"]  # fmt: skip
    long = {"temperature": 0, "max_new_tokens": 600, "max_tokens": 600, "ignore_eos": True}
    requests = {
        "/generate": {"input_ids": list(range(200, 240)), "sampling_params": {k: v for k, v in long.items() if k != "max_tokens"}},
        "/inference/v1/generate": {"token_ids": list(range(200, 240)),
                                   "sampling_params": {k: v for k, v in long.items() if k != "max_new_tokens"}},
    }  # fmt: skip
    try:
        for path, body in requests.items():
            box: dict = {}
            generated = dev_server.metrics()["siesta_generation_tokens_total"]
            worker = threading.Thread(target=lambda box=box, path=path, body=body: box.update(
                r=httpx.post(url + path, json=body, timeout=120)))
            worker.start()
            wait_for(lambda generated=generated: dev_server.metrics()["siesta_generation_tokens_total"] > generated + 10,
                     what="tokens")
            assert httpx.post(f"{url}/pause", params={"mode": "abort"}, timeout=HTTP_TIMEOUT_S).status_code == 200
            assert httpx.post(f"{url}/resume", timeout=HTTP_TIMEOUT_S).status_code == 200
            worker.join(120)
            answer = box["r"].json()
            if path == "/generate":
                meta = answer["meta_info"]
                assert meta["finish_reason"]["type"] == "abort", meta
                reported, spans, count = meta["weight_version"], meta["weight_versions"], len(answer["output_ids"])
            else:
                choice = answer["choices"][0]
                assert choice["finish_reason"] == "abort", choice
                reported, spans, count = answer["weight_version"], choice["weight_versions"], len(choice["token_ids"])
            assert 0 < count < 600
            assert reported == version, path
            assert spans == [{"weight_version": version, "start": 0, "end": count}], path
    finally:
        httpx.post(f"{url}/update_weight_version", json={"new_version": original}, timeout=HTTP_TIMEOUT_S)
