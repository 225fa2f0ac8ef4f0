"""verl's calls, as its code sends them (volcengine/verl @ b178a3cd56f58b2d502255daba591e92833930a7).

SGLang path (``verl/workers/rollout/sglang_rollout/``):
- ``http_server_engine.py``: ``POST /generate {"sampling_params", "input_ids", "return_logprob"}``
  (None fields left out); ``/abort_request {"rid", "abort_all"}``; ``/release_memory_occupation
  {"tags": ["kv_cache", "weights"]}``; ``/resume_memory_occupation {"tags"}``; ``GET /flush_cache``;
- ``sglang_rollout.ServerAdapter``: release; resume ``["weights"]``; ``update_weights``: per bucket
  SGLang's ``update_weights`` (``/update_weights_from_tensor {serialized_named_tensors: [one
  pickle of (name, LocalSerializedTensor)], load_format: null, flush_cache: false}``), then
  ``flush_cache``; resume ``["kv_cache"]``.

vLLM path (``verl/workers/rollout/vllm_rollout/``), over vLLM's dev routes where verl calls its
in-process server actor:
- ``vllm_async_server.generate``: ``SamplingParams(max_tokens, temperature, top_p, top_k,
  logprobs=0, repetition_penalty=1.0)`` on ``/inference/v1/generate``;
- ``vllm_rollout.ServerAdapter``: ``release`` = ``collective_rpc("sleep", level)``; ``resume(tags)``
  = ``collective_rpc("wake_up", tags)``; ``update_weights`` = ``collective_rpc
  ("update_weights_from_ipc")`` with the bucket protocol over ZeroMQ (``trainer.py``:
  ``verl_vllm_push``; on the CPU the buffer is shared by file_system and the socket named by
  siesta's ``zmq_handle``), then ``clear_kv_cache`` = ``/reset_prefix_cache``.
"""

from __future__ import annotations

import uuid

from frameworks.common import LONG_TOKENS, ON_GPU, check_against_trainer, in_flight, ok, post

PROMPT = [21, 22, 23, 24, 25, 400, 401, 402, 403, 404, 60, 61, 62, 63, 64, 65]


def sglang_generate(url: str, **sampling) -> dict:
    sp = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 5, "repetition_penalty": 1.0} | sampling
    return ok(post(url, "/generate", {"sampling_params": sp, "input_ids": PROMPT, "return_logprob": True}))


def sglang_parsed(out: dict) -> tuple[list[int], list[float]]:
    triples = out["meta_info"]["output_token_logprobs"]
    return [t[1] for t in triples], [t[0] for t in triples]


def test_the_sglang_path_release_resume_buckets_abort(url, trainer):
    ok(post(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]}))
    ok(post(url, "/resume_memory_occupation", {"tags": ["weights"]}))
    trainer("seed", seed=401)
    trainer("verl_sglang_push", url=url)
    ok(post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}))
    check_against_trainer(trainer, PROMPT, *sglang_parsed(sglang_generate(url)))
    thread, box = in_flight(url, lambda: sglang_generate(url, max_new_tokens=LONG_TOKENS, ignore_eos=True))
    assert post(url, "/abort_request", {"rid": "", "abort_all": True}).status_code == 200
    thread.join(60)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    check_against_trainer(trainer, PROMPT, *sglang_parsed(box["out"]))


def vllm_generate(url: str) -> dict:
    sampling = {
        "max_tokens": 5,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "logprobs": 0,
        "repetition_penalty": 1.0,
    }
    return ok(post(url, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": sampling}))


def vllm_parsed(out: dict) -> tuple[list[int], list[float]]:
    choice = out["choices"][0]
    return list(choice["token_ids"]), [c["logprob"] for c in choice["logprobs"]["content"]]


def rpc(url: str, method: str, **kwargs) -> dict:
    return ok(post(url, "/collective_rpc", {"method": method, "kwargs": kwargs}))


def test_the_vllm_path_sleep_wake_ipc_buckets(url, trainer):
    # verl's own socket (named by the GPU's UUID) on a GPU; on the CPU siesta's zmq_handle names one.
    handle = None if ON_GPU else f"ipc:///tmp/rl-colocate-zmq-siesta-test-{uuid.uuid4().hex[:8]}.sock"
    for seed, level in ((402, 2), (403, 1)):
        assert rpc(url, "sleep", level=level) == {"results": [None]}
        rpc(url, "wake_up", tags=["weights"])
        trainer("seed", seed=seed)
        trainer(
            "verl_vllm_push", url=url, zmq_handle=handle, bucket_bytes=320 << 10
        )  # several buckets (the embedding takes 256 KiB)
        rpc(url, "wake_up", tags=["kv_cache"])
        ok(post(url, "/reset_prefix_cache"))
        check_against_trainer(trainer, PROMPT, *vllm_parsed(vllm_generate(url)))


def test_collective_rpc_refuses_what_it_does_not_serve(url):
    r = post(url, "/collective_rpc", {"method": "update_weights_from_ipc", "kwargs": {"peft_config": {"r": 8},
                                                                                     "zmq_handle": "ipc:///tmp/x"}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "kwargs.peft_config"
    r = post(url, "/collective_rpc", {"method": "reload_weights"})
    assert r.status_code == 400 and "update_weights_from_ipc" in r.json()["error"]["message"]
