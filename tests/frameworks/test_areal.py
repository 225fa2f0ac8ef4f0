"""AReaL's calls, as its code sends them (inclusionAI/AReaL @ 4aef98d8d818af55b43621aaadba047ae10f4e77).

- rollout (``areal/engine/sglang_remote.py``: ``build_generation_request``): ``POST /generate
  {"input_ids", "image_data": null, "sampling_params": {top_p, top_k, max_new_tokens, temperature,
  stop_token_ids, ignore_eos, skip_special_tokens, frequency_penalty}, "return_logprob": true,
  "stream": false}``; it reads ``meta_info.finish_reason.type`` and ``output_token_logprobs``;
- pause (``get_pause_request`` and ``inference_service/data_proxy/pause.py``): ``/pause_generation
  {}`` from both the weight update and the data proxy, so a second pause meets a paused engine;
  the issue's AReaL @cbff54d then sends ``{"mode": "in_place"}``. ``/continue_generation {}``;
  an interrupted rollout comes back aborted and is resubmitted as prompt + output;
- weight sync (``build_init_weights_group_request``, ``build_distributed_weight_update_requests``,
  ``build_disk_weight_update_requests``): ``/init_weights_update_group {master_address,
  master_port (a string), rank_offset, world_size, backend, group_name}``;
  ``/update_weights_from_distributed {names, dtypes, shapes, group_name, abort_all_requests:
  true}``; ``/update_weights_from_disk {model_path, abort_all_requests: true}``;
- ``/health`` (GET), ``/release_memory_occupation {}``, ``/resume_memory_occupation {"tags"}``.
"""

from __future__ import annotations

import uuid

import pytest

from frameworks.common import LONG_TOKENS, check_against_trainer, get, in_flight, ok, post
from siesta.weight_transfer.sender import free_port

PROMPT = [9, 8, 7, 6, 5, 4, 3, 300, 301, 302, 303, 40, 41, 42, 43, 44]
SAMPLING = {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": 5, "temperature": 1.0, "stop_token_ids": [],
            "ignore_eos": False, "skip_special_tokens": True, "frequency_penalty": 0.0}  # fmt: skip


def generate(url: str, input_ids: list[int], **sampling) -> dict:
    body = {"input_ids": input_ids, "image_data": None, "sampling_params": SAMPLING | sampling,
            "return_logprob": True, "stream": False}  # fmt: skip
    return ok(post(url, "/generate", body))


def parsed(out: dict) -> tuple[list[int], list[float]]:
    """SGLangBackend.parse_generation_response."""
    triples = out["meta_info"]["output_token_logprobs"]
    return [x[1] for x in triples], [x[0] for x in triples]


@pytest.fixture(scope="module")
def group(url, trainer):
    assert get(url, "/health").status_code == 200
    name = f"update_weight_group_{uuid.uuid4().hex[:4]}"
    trainer("seed", seed=201)
    trainer("areal_join", url=url, port=free_port(), group_name=name)
    return name


def test_paused_twice_and_in_place_then_a_distributed_push(url, trainer, group):
    for body in ({}, {}, {"mode": "in_place"}):  # never a 409 that AReaL's retry helper turns into a crash
        assert ok(post(url, "/pause_generation", body))["status"] == "ok"
    trainer("areal_push", url=url, group_name=group)
    ok(post(url, "/continue_generation", {}))
    check_against_trainer(trainer, PROMPT, *parsed(generate(url, PROMPT)))


def test_an_interrupted_rollout_is_resubmitted_with_what_it_generated(url, trainer, group):
    thread, box = in_flight(url, lambda: generate(url, PROMPT, max_new_tokens=LONG_TOKENS, ignore_eos=True))
    ok(post(url, "/pause_generation", {}))
    thread.join(60)
    out = box["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    tokens, logprobs = parsed(out)
    check_against_trainer(trainer, PROMPT, tokens, logprobs)
    trainer("seed", seed=202)
    trainer("areal_push", url=url, group_name=group)  # the new weights, as AReaL updates while paused
    ok(post(url, "/continue_generation", {}))
    again = generate(url, PROMPT + tokens, max_new_tokens=3)
    check_against_trainer(trainer, PROMPT + tokens, *parsed(again))


def test_a_disk_push_and_an_offload_onload_around_a_push(url, trainer, group, tmp_path):
    trainer("seed", seed=203)
    trainer("save_checkpoint", path=str(tmp_path / "step"))
    ok(post(url, "/pause_generation", {}))
    assert ok(post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "step"),
                                                     "abort_all_requests": True}))["success"]  # fmt: skip
    ok(post(url, "/continue_generation", {}))
    check_against_trainer(trainer, PROMPT, *parsed(generate(url, PROMPT)))
    ok(post(url, "/release_memory_occupation", {}))
    ok(post(url, "/resume_memory_occupation", {"tags": ["weights"]}))
    trainer("seed", seed=204)
    ok(post(url, "/pause_generation", {}))
    trainer("areal_push", url=url, group_name=group)
    ok(post(url, "/continue_generation", {}))
    ok(post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}))
    check_against_trainer(trainer, PROMPT, *parsed(generate(url, PROMPT)))
