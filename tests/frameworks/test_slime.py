"""slime's calls, as its code sends them (THUDM/slime @ 624b824a898ab0ec1fcb4d373004c7f3852bf515).

- rollout (``slime/rollout/sglang_rollout.py``: ``generate``): ``POST /generate {"sampling_params":
  {temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids, skip_special_tokens,
  no_stop_trim: true, spaces_between_special_tokens: false}, "return_logprob": true, "input_ids"}``,
  plus ``custom_params: {"return_top_p_token_ids": true}`` when ``rollout_top_p != 1``; it reads
  ``meta_info.output_token_logprobs``, ``top_p_token_ids``/``top_p_token_offsets`` (base64 int32,
  ``slime/utils/types.py``) and ``weight_version``;
- abort (``slime/backends/sglang_utils/server_control.py``): ``POST /abort_request {"abort_all":
  true}``, then ``GET /v1/loads?include=core`` until no request is left; an aborted sample is sent
  again as prompt + output (partial rollout);
- weight sync (``slime/backends/megatron_utils/update_weight/``): ``/pause_generation {}``, ``GET
  /flush_cache`` until 200, then per bucket ``/update_weights_from_distributed {names, dtypes,
  shapes, group_name, flush_cache: false, weight_version}`` while broadcasting (the group from
  ``/init_weights_update_group``), or ``/update_weights_from_tensor {serialized_named_tensors,
  load_format: "flattened_bucket", flush_cache: false, weight_version}``, or
  ``/update_weights_from_disk {model_path, weight_version}``; then ``/continue_generation {}``;
- offload (``sglang_engine.py``): ``flush_cache`` then ``/release_memory_occupation {}``;
  ``/resume_memory_occupation {"tags": ["weights"]}``, the push, then ``{"tags": ["kv_cache"]}``;
- ``/get_weight_version``, ``/destroy_weights_update_group {group_name}``.

The trainer process does slime's trainer side (``trainer.py``); this process is the rollout side.
"""

from __future__ import annotations

import base64
import time
import uuid

import pytest
import torch

from frameworks.common import LONG_TOKENS, check_against_trainer, get, in_flight, ok, post
from siesta.weight_transfer.sender import free_port

PROMPT = [5, 17, 42, 7, 99, 300, 11, 64, 8, 1, 250, 77, 21, 9, 4, 33]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "stop": None, "stop_token_ids": [],
            "skip_special_tokens": True, "no_stop_trim": True, "spaces_between_special_tokens": False}  # fmt: skip


def generate(url: str, input_ids: list[int], **sampling) -> dict:
    body = {"sampling_params": SAMPLING | sampling, "return_logprob": True, "input_ids": input_ids}
    return ok(post(url, "/generate", body))


def sampled(out: dict) -> tuple[list[int], list[float]]:
    triples = out["meta_info"]["output_token_logprobs"]
    return [t[1] for t in triples], [t[0] for t in triples]


def serves(url: str, trainer, version: str) -> None:
    out = generate(url, PROMPT)
    check_against_trainer(trainer, PROMPT, *sampled(out))
    assert out["meta_info"]["weight_version"] == version


def ints(value: str) -> list[int]:
    return torch.frombuffer(bytearray(base64.b64decode(value)), dtype=torch.int32).tolist()


def requests_left(url: str) -> int:
    """server_control.num_requests_from_load over SGLang's /v1/loads answer."""
    load = ok(get(url, "/v1/loads", include="core"))
    return sum(row["num_running_reqs"] + row["num_waiting_reqs"] for row in load["loads"])


@pytest.fixture(scope="module")
def group(url, trainer):
    name = f"slime-pp_0-{uuid.uuid4().hex[:6]}"
    trainer("seed", seed=101)
    trainer("slime_join", url=url, port=free_port(), group_name=name)
    yield name
    ok(post(url, "/destroy_weights_update_group", {"group_name": name}))


def test_a_distributed_push_in_buckets_then_rollouts_score_as_the_trainer(url, trainer, group):
    trainer("slime_push_distributed", url=url, group_name=group, version="slime-1")
    assert ok(get(url, "/get_weight_version"))["weight_version"] == "slime-1"
    serves(url, trainer, "slime-1")


def test_top_p_below_one_returns_the_sets_slime_replays(url, trainer, group):
    trainer("slime_push_distributed", url=url, group_name=group, version="slime-2")
    sampling = {"top_p": 0.7, "top_k": 8, "custom_params": {"return_top_p_token_ids": True}}
    out = generate(url, PROMPT, **sampling)
    tokens, logprobs = sampled(out)
    meta = out["meta_info"]
    ids, offsets = ints(meta["top_p_token_ids"]), ints(meta["top_p_token_offsets"])
    assert len(offsets) == len(tokens) + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
    want = trainer("score", prompt=PROMPT, tokens=tokens, temperature=1.0, top_k=8, top_p=0.7)
    for i, token in enumerate(tokens):
        assert ids[offsets[i] : offsets[i + 1]] == want["sets"][i]
        assert token in want["sets"][i]
    worst = max(abs(a - b) for a, b in zip(logprobs, want["renormalised"]))
    assert worst <= 1e-4 and meta["top_p_token_ids_truncated"] == 0


def test_abort_until_idle_then_the_partial_rollout_is_resent_and_hits_its_blocks(url, trainer, group):
    trainer("slime_push_distributed", url=url, group_name=group, version="slime-3")
    long, box = in_flight(url, lambda: generate(url, PROMPT, max_new_tokens=LONG_TOKENS, ignore_eos=True))
    while requests_left(url) > 0:  # abort_server_until_idle
        post(url, "/abort_request", {"abort_all": True})
        time.sleep(0.1)
    long.join(60)
    out = box["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    tokens, logprobs = sampled(out)
    check_against_trainer(trainer, PROMPT, tokens, logprobs)
    assert out["meta_info"]["weight_version"] == "slime-3"
    resent = generate(url, PROMPT + tokens, max_new_tokens=2)
    assert resent["meta_info"]["cached_tokens"] >= (len(PROMPT + tokens) - 1) // 16 * 16 > 0
    check_against_trainer(trainer, PROMPT + tokens, *sampled(resent))


def test_a_colocated_tensor_push_and_a_disk_push(url, trainer, group, tmp_path):
    trainer("seed", seed=102)
    trainer("slime_push_tensor", url=url, version="slime-4")
    serves(url, trainer, "slime-4")
    trainer("seed", seed=103)
    trainer("save_checkpoint", path=str(tmp_path / "ckpt"))
    ok(post(url, "/pause_generation", {}))
    trainer_flush(url)
    body = ok(
        post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "ckpt"), "weight_version": "slime-5"})
    )
    assert body["success"] is True
    ok(post(url, "/continue_generation", {}))
    serves(url, trainer, "slime-5")


def test_release_resume_weights_push_resume_kv_cache(url, trainer, group):
    trainer_flush(url)
    ok(post(url, "/release_memory_occupation", {}))
    ok(post(url, "/resume_memory_occupation", {"tags": ["weights"]}))
    trainer("seed", seed=104)
    trainer("slime_push_distributed", url=url, group_name=group, version="slime-6")
    ok(post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}))
    serves(url, trainer, "slime-6")


def trainer_flush(url: str) -> None:
    assert get(url, "/flush_cache").status_code == 200
