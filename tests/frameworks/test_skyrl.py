"""SkyRL's calls, as its code sends them (NovaSky-AI/SkyRL @ a9564572eb8e91076be43c1bd5e4615e3de17265).

- rollout (``skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py``:
  ``_generate_single``): ``POST /inference/v1/generate {"sampling_params", "model", "token_ids",
  "cache_salt"}`` with an ``X-Session-ID`` header; it reads ``choices[0].token_ids``,
  ``finish_reason`` and ``logprobs.content[].logprob``;
- control: ``/pause?mode=keep&clear_cache=false`` (``pause_generation``), ``/resume``, ``/sleep
  ?level=2``, ``/wake_up?tags=...``, ``/reset_prefix_cache {"reset_running_requests": false}``
  (a JSON body), ``GET /get_world_size``; ``/collective_rpc`` ``skyrl_sleep_for_weight_sync
  {offload_kv}`` and ``skyrl_wake_for_weight_sync {tags}`` (``workers/worker_dispatch.py``);
- weight sync (``weight_sync/broadcast_strategy.py``): ``/init_weight_transfer_engine
  {"init_info": BroadcastInitInfo.to_api_payload()}``; ``collective_rpc``
  ``skyrl_start_weight_update``, ``update_weights_nccl {update_info: {names, dtype_names, shapes,
  packed: true}}`` while vLLM's ``trainer_send_weights`` broadcasts, ``skyrl_finish_weight_update``.
"""

from __future__ import annotations

import pytest

from frameworks.common import LONG_TOKENS, check_against_trainer, get, in_flight, ok, post
from siesta.weight_transfer.sender import free_port

PROMPT = [31, 32, 33, 34, 35, 36, 700, 701, 702, 703, 704, 90, 91, 92, 93, 94]


def generate(url: str, version: int, max_tokens: int = 5) -> dict:
    body = {"sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": max_tokens, "logprobs": 0},
            "model": ok(get(url, "/v1/models"))["data"][0]["id"], "token_ids": PROMPT, "cache_salt": f"v{version}"}  # fmt: skip
    return ok(post(url, "/inference/v1/generate", body, headers={"X-Session-ID": "s-1"}))


def parsed(out: dict) -> tuple[list[int], list[float]]:
    choice = out["choices"][0]
    return list(choice["token_ids"]), [c["logprob"] for c in choice["logprobs"]["content"]]


def rpc(url: str, method: str, **kwargs) -> None:
    ok(post(url, "/collective_rpc", {"method": method, "kwargs": kwargs}))


@pytest.fixture(scope="module")
def joined(url, trainer):
    assert ok(get(url, "/get_world_size"))["world_size"] == 1
    trainer("skyrl_init", url=url, port=free_port())


def test_non_colocated_keep_pause_and_broadcast(url, trainer, joined):
    trainer("seed", seed=501)
    ok(post(url, "/pause", params={"mode": "keep", "clear_cache": "false"}))
    try:
        trainer("skyrl_push", url=url)
    finally:
        ok(post(url, "/resume"))
    check_against_trainer(trainer, PROMPT, *parsed(generate(url, 1)))


def test_fully_async_sleep_for_weight_sync_with_a_frozen_rollout(url, trainer, joined):
    thread, box = in_flight(url, lambda: generate(url, 1, max_tokens=LONG_TOKENS))
    trainer("seed", seed=502)
    ok(post(url, "/pause", params={"mode": "keep", "clear_cache": "false"}))
    try:
        rpc(url, "skyrl_sleep_for_weight_sync", offload_kv=True)
        rpc(url, "skyrl_wake_for_weight_sync", tags=["weights"])
        trainer("skyrl_push", url=url)
        rpc(url, "skyrl_wake_for_weight_sync", tags=["kv_cache"])
    finally:
        ok(post(url, "/resume"))
    thread.join(120)
    assert box["out"]["choices"][0]["finish_reason"] in ("length", "stop")  # frozen, then finished
    check_against_trainer(trainer, PROMPT, *parsed(generate(url, 2)))


def test_colocated_sleep_wake_in_stages(url, trainer, joined):
    trainer("seed", seed=503)
    ok(post(url, "/sleep", params={"level": "2"}))
    ok(post(url, "/wake_up", params={"tags": ["weights"]}))
    trainer("skyrl_push", url=url)
    ok(post(url, "/wake_up", params={"tags": ["kv_cache"]}))
    ok(post(url, "/reset_prefix_cache", {"reset_running_requests": False}))
    check_against_trainer(trainer, PROMPT, *parsed(generate(url, 3)))
