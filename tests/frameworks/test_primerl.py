"""prime-rl's calls, as its code sends them (PrimeIntellect-ai/prime-rl @ 559b44772e471d1538537b8805cc77f3824a5e64,
its client PrimeIntellect-ai/verifiers @ a60a606ecc4d309247edf9ff92c3eabca362781f and renderers'
``renderers/client.py`` @ 010c894c1ad98194f50d1c1de99a610ea88e4765).

- rollout (verifiers ``v1/clients/train.py`` then renderers ``generate``): ``POST
  /inference/v1/generate {"model", "token_ids", "sampling_params"}`` with the orchestrator's
  ``extra_body`` merged into ``sampling_params`` (``cache_salt``: the policy version,
  ``orchestrator/envs.py``), ``stop_token_ids`` from the renderer, ``logprobs: 1``,
  ``skip_special_tokens: false``; an ``X-Session-ID`` header; it reads ``choices[0].token_ids``
  and ``logprobs.content[].logprob``;
- admin (``utils/client.py``): ``GET /health``, ``GET /v1/models``; ``update_weights``:
  ``POST /pause?mode=keep&clear_cache=false``, the ``NCCL_READY`` marker in ``weight_dir``,
  ``POST /update_weights {"weight_dir"}``, ``POST /resume``; ``init_nccl_broadcast``: ``POST
  /init_broadcaster {host, port, rank_offset, inference_world_size, timeout,
  quantize_in_weight_transfer}``; ``load_lora_adapter``: ``POST /load_lora_adapter {lora_name,
  lora_path}`` (it retries 404 and 500 only); the server's ``GET /liveness``;
- the trainer (``transports/weights/filesystem.py``, ``nccl.py``): shards without
  ``config.json``, or the broadcast of layer state dicts (``trainer.py``: ``primerl_broadcast``).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from frameworks.common import LONG_TOKENS, check_against_trainer, get, in_flight, ok, post
from siesta.weight_transfer.sender import free_port

PROMPT = [12, 13, 14, 15, 200, 201, 202, 203, 7, 7, 7, 7, 500, 600, 700, 800]


def generate(url: str, model: str, version: int, max_tokens: int = 5) -> dict:
    sampling = {"temperature": 1.0, "max_tokens": max_tokens, "cache_salt": str(version), "stop_token_ids": [2],
                "logprobs": 1, "skip_special_tokens": False, "routed_experts_prompt_start": 0}  # fmt: skip
    body = {"model": model, "token_ids": PROMPT, "sampling_params": sampling}
    return ok(post(url, "/inference/v1/generate", body, headers={"X-Session-ID": "rollout-1"}))


def parsed(out: dict) -> tuple[list[int], list[float]]:
    choice = out["choices"][0]
    return list(choice["token_ids"]), [c["logprob"] for c in choice["logprobs"]["content"]]


def update_weights(url: str, weight_dir: Path) -> None:
    """utils/client.update_weights, without LoRA."""
    ok(post(url, "/pause", params={"mode": "keep", "clear_cache": "false"}))
    try:
        (weight_dir / "NCCL_READY").touch()
        body = ok(post(url, "/update_weights", {"weight_dir": weight_dir.as_posix()}))
        assert body["status"] == "ok"
    finally:
        ok(post(url, "/resume"))


def model_name(url: str) -> str:
    assert get(url, "/health").status_code == 200
    return ok(get(url, "/v1/models"))["data"][0]["id"]


def test_filesystem_updates_while_a_rollout_is_frozen(url, trainer, tmp_path):
    model = model_name(url)
    trainer("seed", seed=301, dtype="bfloat16")  # prime-rl's trainer sends bf16
    trainer("primerl_save", weight_dir=str(tmp_path / "step_1"))
    update_weights(url, tmp_path / "step_1")
    check_against_trainer(trainer, PROMPT, *parsed(generate(url, model, 1)))
    long, box = in_flight(url, lambda: generate(url, model, 1, max_tokens=LONG_TOKENS))
    trainer("seed", seed=302, dtype="bfloat16")
    trainer("primerl_save", weight_dir=str(tmp_path / "step_2"))
    update_weights(url, tmp_path / "step_2")  # keep mode: the rollout in flight waits, then goes on
    long.join(120)
    assert box["out"]["choices"][0]["finish_reason"] in ("length", "stop")
    check_against_trainer(trainer, PROMPT, *parsed(generate(url, model, 2)))


def test_the_broadcaster_cpu_arm(url, trainer, tmp_path):
    model = model_name(url)
    port = free_port()
    trainer("primerl_listen", port=port)
    ok(post(url, "/init_broadcaster", {"host": "127.0.0.1", "port": port, "rank_offset": 0, "inference_world_size": 1,
                                      "timeout": 60, "quantize_in_weight_transfer": False}))  # fmt: skip
    trainer("primerl_joined")
    for step, seed in ((3, 303), (4, 304)):
        trainer("seed", seed=seed, dtype="bfloat16")
        weight_dir = tmp_path / f"step_{step}"
        weight_dir.mkdir()
        trainer("primerl_broadcast", weight_dir=str(weight_dir))
        update_weights(url, weight_dir)
        trainer("primerl_sent")
        check_against_trainer(trainer, PROMPT, *parsed(generate(url, model, step)))


def test_liveness_and_lora_answer_as_prime_rl_expects(url):
    assert ok(get(url, "/liveness")) == {"status": "ok"}
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "r8", "lora_path": "/nope"}, timeout=30)
    assert r.status_code == 400 and "LoRA is not enabled" in r.json()["error"]["message"]


def test_the_cache_salt_inside_sampling_params_salts_the_cache(url):
    """prime-rl's orchestrator salts per policy version: its salt arrives inside sampling_params."""
    model = model_name(url)
    prompt = list(range(100, 140))

    def cached(salt: str) -> int:
        sampling = {"temperature": 0.0, "max_tokens": 1, "cache_salt": salt, "logprobs": 1}
        out = ok(
            post(url, "/inference/v1/generate", {"model": model, "token_ids": prompt, "sampling_params": sampling})
        )
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("salt-a")
    assert cached("salt-a") == 32  # every full block but the last token's
    assert cached("salt-b") == 0  # another salt: another namespace
