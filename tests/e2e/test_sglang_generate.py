"""SGLang's ``/generate`` with request bodies shaped as slime and AReaL send them.

Greedy, so the returned ids and logprobs are the offline ``LLM``'s for the same request,
and decoding the ids gives the text.
"""

from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import pytest

from e2e.servers import single_thread, wait_for

PROMPT = "The capital of France is"
MAX_NEW = 12
BLOCK = 16
LOGPROB_TOL = 1e-4
SETTLE_S = 0.5


def _offline(llm, prompt, max_tokens: int = MAX_NEW, **extra):
    from siesta import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, **extra)
    inputs = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    with single_thread():
        return llm.generate([inputs], params, use_tqdm=False)[0].outputs[0]


def _post(http, body: dict, status: int = 200):
    response = http.post("/generate", json=body)
    assert response.status_code == status, response.text
    return response.json()


def _stream(url: str, body: dict, chunks: list[dict] | None = None) -> list[dict]:
    chunks = [] if chunks is None else chunks  # filled as they arrive
    with httpx.stream("POST", f"{url}/generate", json=body | {"stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def test_slimes_token_in_token_out_request_gives_the_offline_ids_and_logprobs(http, offline_llm, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "skip_special_tokens": False},
        "return_logprob": True,
    }
    out = _post(http, body)
    expected = _offline(offline_llm, ids, skip_special_tokens=False)
    meta = out["meta_info"]
    assert out["output_ids"] == expected.token_ids
    assert [entry[1] for entry in meta["output_token_logprobs"]] == expected.token_ids
    for (logprob, token_id, text), offline in zip(meta["output_token_logprobs"], expected.logprobs):
        assert abs(logprob - offline[token_id].logprob) < LOGPROB_TOL
        assert text is None  # return_text_in_logprobs defaults to false, as in SGLang
    assert out["text"] == tokenizer.decode(out["output_ids"]) == expected.text
    assert meta["finish_reason"] == {"type": "length", "length": MAX_NEW}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == MAX_NEW
    assert meta["weight_version"] == http.get("/get_weight_version").json()["weight_version"]
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)


def test_sampled_logprobs_are_of_the_temperature_scaled_distribution_as_sglangs(http, offline_llm):
    from siesta import SamplingParams

    body = {"text": PROMPT, "return_logprob": True,
            "sampling_params": {"temperature": 0.5, "max_new_tokens": 6, "sampling_seed": 7}}  # fmt: skip
    meta = _post(http, body)["meta_info"]
    with single_thread():
        outs = {
            scaled: offline_llm.generate(
                [PROMPT], SamplingParams(temperature=0.5, max_tokens=6, seed=7, logprobs=0, scaled_logprobs=scaled),
                use_tqdm=False,
            )[0].outputs[0]
            for scaled in (True, False)
        }
    served = [entry[0] for entry in meta["output_token_logprobs"]]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == outs[True].token_ids == outs[False].token_ids
    for value, token_id, scaled, raw in zip(served, outs[True].token_ids, outs[True].logprobs, outs[False].logprobs):
        assert abs(value - scaled[token_id].logprob) < LOGPROB_TOL
    assert any(abs(v - r[t].logprob) > 1e-2 for v, t, r in zip(served, outs[False].token_ids, outs[False].logprobs))


def test_a_text_batch_answers_a_list_in_prompt_order_with_top_logprobs(http, offline_llm):
    prompts = [PROMPT, "One, two, three,"]
    body = {
        "text": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    outs = _post(http, body)
    assert isinstance(outs, list) and len(outs) == 2
    for out, prompt in zip(outs, prompts):
        expected = _offline(offline_llm, prompt, 4)
        assert out["output_ids"] == expected.token_ids and out["text"] == expected.text
        top = out["meta_info"]["output_top_logprobs"]
        assert len(top) == 4 and all(len(position) == 3 for position in top)
        # Greedy: the sampled token is the likeliest, and the first alternative.
        assert [position[0][1] for position in top] == expected.token_ids
        assert all(isinstance(position[0][2], str) for position in top)


def test_a_stream_sends_cumulative_answers_ending_in_the_whole_one(dev_server, http):
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}}
    whole = _post(http, body)
    chunks = _stream(dev_server.url, body)
    for earlier, later in itertools.pairwise(chunks):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
        assert later["text"].startswith(earlier["text"])
    assert [c["meta_info"]["finish_reason"] for c in chunks].count(None) == len(chunks) - 1
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]


def test_logprob_start_len_scores_the_prompt_and_max_new_tokens_0_generates_nothing(http, offline_llm, tokenizer):
    from siesta import SamplingParams

    ids = tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2}  # fmt: skip
    out = _post(http, body)
    with single_thread():
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
        offline = offline_llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].prompt_logprobs
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["output_token_logprobs"] == []
    triples = meta["input_token_logprobs"]
    assert [t[1] for t in triples] == ids and triples[0][0] is None and meta["input_top_logprobs"][0] is None
    for (logprob, token_id, _), entry in zip(triples[1:], offline[1:]):
        assert abs(logprob - entry[token_id].logprob) < LOGPROB_TOL
    for top, entry in zip(meta["input_top_logprobs"][1:], offline[1:]):
        best = sorted(entry.values(), key=lambda lp: lp.rank)[:2]
        assert [round(t[0], 4) for t in top] == [round(lp.logprob, 4) for lp in best]
    tail = _post(http, body | {"logprob_start_len": 3})["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in tail] == ids[3:]
    assert all(abs(a[0] - b[0]) < LOGPROB_TOL for a, b in zip(tail, triples[3:]))


def test_stop_tokens_and_strings_report_what_they_matched(http, offline_llm):
    expected = _offline(offline_llm, PROMPT)
    stop_id = expected.token_ids[2]
    out = _post(http, {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW,
                                                          "stop_token_ids": [stop_id]}})  # fmt: skip
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == expected.token_ids[:3]
    word = expected.text.split()[1]
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "stop": [word]}
    trimmed = _post(http, {"text": PROMPT, "sampling_params": params})
    kept = _post(http, {"text": PROMPT, "sampling_params": params | {"no_stop_trim": True}})
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in trimmed["text"] and kept["text"] == trimmed["text"] + word


def test_n_samples_of_a_prompt_answer_a_list_with_their_own_rids(http):
    body = {"text": PROMPT, "rid": "sample", "sampling_params": {"n": 3, "max_new_tokens": 4, "sampling_seed": 1}}
    outs = _post(http, body)
    assert [o["meta_info"]["id"] for o in outs] == ["sample_0", "sample_1", "sample_2"]
    assert all(o["meta_info"]["completion_tokens"] == 4 for o in outs)


def test_slimes_abort_all_returns_the_partial_rollouts_which_hit_the_cache_when_resent(dev_server, http):
    prompt = [200 + i for i in range(40)]
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 600, "ignore_eos": True}}  # fmt: skip
    answer: dict = {}
    before = dev_server.metrics()["siesta_generation_tokens_total"]
    worker = threading.Thread(target=lambda: answer.update(_post(http, body)))
    worker.start()
    wait_for(lambda: dev_server.metrics()["siesta_generation_tokens_total"] > before + 20, what="some tokens")
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    worker.join(timeout=60)
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    generated = answer["output_ids"]
    assert 0 < len(generated) < 600 and len(meta["output_token_logprobs"]) == len(generated)
    resent = _post(http, {"input_ids": prompt + generated, "sampling_params": {"max_new_tokens": 1}})
    assert resent["meta_info"]["cached_tokens"] == (len(prompt) + len(generated) - 1) // BLOCK * BLOCK


def test_areals_pause_and_continue_keep_a_rollout_on_its_greedy_path(dev_server, offline_llm):
    from siesta import SamplingParams

    max_new = 40
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    chunks: list[dict] = []
    worker = threading.Thread(target=_stream, args=(dev_server.url, body, chunks))
    worker.start()
    for mode in ("in_place", "retract"):
        wait_for(lambda: len(chunks) > 0, what="tokens")
        r = httpx.post(f"{dev_server.url}/pause_generation", json={"mode": mode}, timeout=30)
        assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
        time.sleep(SETTLE_S)  # chunks already on their way arrive
        frozen = len(chunks)
        assert chunks[-1]["meta_info"]["finish_reason"] is None  # still running: the pause froze it
        time.sleep(SETTLE_S)
        assert len(chunks) == frozen
        assert httpx.post(f"{dev_server.url}/continue_generation", timeout=30).status_code == 200
    worker.join(timeout=120)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    with single_thread():
        expected = offline_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert chunks[-1]["output_ids"] == expected.token_ids


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": PROMPT, "input_ids": [1, 2]}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [10**9]}, "input_ids"),
        ({"text": PROMPT, "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ({"text": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
        ({"text": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": PROMPT, "return_logprob": True, "top_logprobs_num": 99}, "top_logprobs_num"),
        ({"text": PROMPT, "image_data": "x.png"}, "image_data"),
        ({"text": [PROMPT, PROMPT], "sampling_params": [{}]}, "sampling_params"),
        ({"text": PROMPT, "sampling_params": {"max_new_tokens": 5000}}, "max_tokens"),
    ],
)
def test_bad_bodies_are_a_400_naming_the_field(http, body, param):
    response = http.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["message"]


def test_the_info_routes_describe_the_server(http):
    model = http.get("/get_model_info").json()
    assert model["is_generation"] is True and model["weight_version"]
    server = http.get("/get_server_info").json()
    assert server["context_length"] == 1024 and server["page_size"] == BLOCK
    assert server["max_total_num_tokens"] % BLOCK == 0 and server["max_total_num_tokens"] > 0
    assert http.get("/health_generate").status_code == 200


def test_release_and_resume_memory_occupation_by_tags_then_generate_as_before(http, offline_llm):
    expected = _offline(offline_llm, PROMPT)
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}}
    for release, resumes in ((None, [["weights"], ["kv_cache"]]), (["kv_cache"], [["kv_cache"]])):
        assert http.post("/release_memory_occupation", json={"tags": release}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        for tags in resumes:
            assert http.post("/resume_memory_occupation", json={"tags": tags}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _post(http, body)["output_ids"] == expected.token_ids


def test_flush_cache_forgets_cached_prefixes(http):
    body = {"input_ids": list(range(300, 340)), "sampling_params": {"max_new_tokens": 1}}
    _post(http, body)
    assert _post(http, body)["meta_info"]["cached_tokens"] == 32
    assert http.post("/flush_cache").text == "Cache flushed.\n"
    assert _post(http, body)["meta_info"]["cached_tokens"] == 0
